"""A video run's export/ rebuilt from any of its DeepSpeed checkpoints (scripts/export.py): the WanPipeline folder the
end of the run writes (VideoTrainer.export) with the checkpoint's EMA transformer, or of a finetune=lora checkpoint the
EMA adapter as diffusers' LoRA file on the base (and the merged pipeline with export.merge_lora): the shared
diffusers-pipeline export (common/diffusion/release.py) with this family's weights module."""

from __future__ import annotations

import functools

from common.config import TrainConfig
from common.diffusion import release
from recipes.video import weights

export_checkpoint = functools.partial(release.export_checkpoint, weights)
export_lora_checkpoint = functools.partial(release.export_lora_checkpoint, weights)


def lora_base(cfg: TrainConfig) -> str:
    """The folder a finetune=lora export loads its base from: the pipeline folder model.init_from."""
    return cfg.model.init_from
