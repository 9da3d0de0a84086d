"""A text-to-image run's export/ rebuilt from any of its DeepSpeed checkpoints (scripts/export.py): the pipeline folder
(StableDiffusion3Pipeline, FluxPipeline: the base's class) the end of the run writes (T2ITrainer.export), with the
checkpoint's EMA transformer and the base pipeline's other parts; of a finetune=lora checkpoint, the EMA adapter as
diffusers' LoRA file on the base (and the merged pipeline with export.merge_lora). The shared diffusers-pipeline export
(common/diffusion/release.py) with this family's weights module."""

from __future__ import annotations

import functools

from common.config import TrainConfig
from common.diffusion import release
from recipes.t2i import weights

export_checkpoint = functools.partial(release.export_checkpoint, weights)
export_lora_checkpoint = functools.partial(release.export_lora_checkpoint, weights)


def lora_base(cfg: TrainConfig) -> str:
    """The folder a finetune=lora export loads its base from (and whose fingerprint its checkpoints record): the
    pipeline folder model.init_from (resolved when the run composed)."""
    return cfg.model.init_from
