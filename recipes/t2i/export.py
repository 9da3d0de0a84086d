"""A text-to-image run's export/ rebuilt from any of its DeepSpeed checkpoints (scripts/export.py): the
pipeline folder (StableDiffusion3Pipeline, FluxPipeline: the base's class) the end of the run writes
(T2ITrainer.export), with the checkpoint's EMA transformer (common/ds_export.py: write_ema_module, one safetensors
shard at a time) and the base pipeline's other parts.

A finetune=lora run's checkpoints hold the adapter only (and its EMA in the TrainState): `export_lora_checkpoint`
builds the adapted transformer on model.init_from's weights, whole in host memory (the merged export needs them, and
the adapter is small), puts the EMA adapter in and writes what the end of the run writes (recipes/t2i/lora.py)."""

from __future__ import annotations

from pathlib import Path

from common.config import TrainConfig
from common.ds_export import ZeroCheckpoint, export_ema, export_ema_lora, load_ema_adapter, write_ema_module
from recipes.t2i import lora as t2i_lora
from recipes.t2i.weights import meta_transformer, pipeline_folder, write_pipeline


def export_checkpoint(cfg: TrainConfig, path: Path, meta: dict, out: Path, *, max_shard_size: str | None) -> str:
    """Write the export of checkpoint `path` to `out`; returns what was written, in words."""
    return export_ema(cfg, path, meta, out, max_shard_size, write_export)


def write_export(cfg: TrainConfig, ckpt: ZeroCheckpoint, out: Path, *, step: int, max_shard_size: int) -> int:
    """Write the export of checkpoint `ckpt` (of step `step`) to `out`; returns the weight bytes written."""
    base = pipeline_folder(cfg.model.init_from)
    model = meta_transformer(base)
    write_pipeline(out, base, cfg, step=step)
    return write_ema_module(ckpt, model, out / "transformer", "diffusion_pytorch_model.safetensors", max_shard_size)


def lora_base(cfg: TrainConfig) -> str:
    """The folder a finetune=lora export loads its base from (and whose fingerprint its checkpoints record): the
    pipeline folder model.init_from (resolved when the run composed)."""
    return cfg.model.init_from


def export_lora_checkpoint(cfg: TrainConfig, path: Path, meta: dict, out: Path, *, max_shard_size: str | None) -> str:
    """Write the export of finetune=lora checkpoint `path` to `out` (scripts/export.py); returns what was written."""
    return export_ema_lora(cfg, path, meta, out, max_shard_size, write_lora_export)


def write_lora_export(cfg: TrainConfig, ckpt: ZeroCheckpoint, out: Path, *, step: int) -> int:
    """Write the export of finetune=lora checkpoint `ckpt` (of step `step`) to `out`: the EMA adapter as diffusers'
    LoRA file, with export.merge_lora the merged pipeline in out/merged; returns the adapter's parameter count."""
    base = pipeline_folder(cfg.model.init_from)
    model = t2i_lora.adapted_model(cfg, base)
    adapter = load_ema_adapter(model, ckpt)
    t2i_lora.write_export(model, cfg, out, base=base, step=step)
    return sum(p.numel() for p in adapter.values())
