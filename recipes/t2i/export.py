"""A text-to-image run's export/ rebuilt from any of its DeepSpeed checkpoints (scripts/export.py): the
StableDiffusion3Pipeline folder the end of the run writes (T2ITrainer.export), with the checkpoint's EMA transformer
(common/ds_export.py: write_ema_module, one safetensors shard at a time) and the base pipeline's other parts."""

from __future__ import annotations

from pathlib import Path

import torch

from common.config import TrainConfig
from common.ds_export import ZeroCheckpoint, export_zero, write_ema_module
from recipes.t2i.pipeline import pipeline_folder, transformer_config
from recipes.t2i.train import write_pipeline


def export_checkpoint(cfg: TrainConfig, path: Path, meta: dict, out: Path, *, max_shard_size: str | None) -> str:
    """Write the export of checkpoint `path` to `out`; returns what was written, in words."""
    return export_zero(
        path,
        max_shard_size,
        lambda ckpt, shard_size: write_export(cfg, ckpt, out, step=int(meta["step"]), max_shard_size=shard_size),
    )


def write_export(cfg: TrainConfig, ckpt: ZeroCheckpoint, out: Path, *, step: int, max_shard_size: int) -> int:
    """Write the export of checkpoint `ckpt` (of step `step`) to `out`; returns the weight bytes written."""
    from diffusers import SD3Transformer2DModel

    base = pipeline_folder(cfg.model.init_from)
    with torch.device("meta"):
        model = SD3Transformer2DModel.from_config(transformer_config(base))
    write_pipeline(out, base, cfg, step=step)
    return write_ema_module(ckpt, model, out / "transformer", "diffusion_pytorch_model.safetensors", max_shard_size)
