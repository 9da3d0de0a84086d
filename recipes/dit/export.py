"""A DiT run's export/ rebuilt from any of its DeepSpeed checkpoints (scripts/export.py), in bounded memory: the
folder the end of the run writes (DiTTrainer.export), tensor for tensor, for the checkpoint's step.

The end of a run exports the EMA weights in the module's dtype, in diffusers' per-block layout: here they come
from the checkpoint's TrainState (the whole EMA by parameter name), anything the EMA does not track (buffers)
from DeepSpeed's model states, one safetensors shard at a time (common/ds_export.py).

A finetune=lora run's checkpoints hold the adapter only (and its EMA in the TrainState): `export_lora_checkpoint`
builds the adapted DiT on model.init_from's weights, whole in host memory (the merged export needs them, and the
adapter is small), puts the EMA adapter in and writes what the end of the run writes (recipes/dit/lora.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.config import TrainConfig
from common.data.dataset import load_dataset_meta
from common.diffusion import vae as vae_lib
from common.ds_export import ZeroCheckpoint, export_ema_lora, export_zero, load_ema_adapter, write_ema_module
from recipes.dit import lora as dit_lora
from recipes.dit.data import class_names
from recipes.dit.model import build_model, null_class
from recipes.dit.train import model_geometry, write_export_files, write_pipeline


def export_parts(cfg: TrainConfig) -> tuple[list[str], vae_lib.VaeGeometry | None, object]:
    """(class names, VAE geometry or None, the VAE or None): what an export holds besides the transformer."""
    classes = class_names(load_dataset_meta(cfg.data.root))
    _, _, geometry = model_geometry(cfg)
    vae = None
    if geometry is not None:
        geometry = vae_lib.vae_geometry(cfg.diffusion.vae, cfg.data.image_size)  # the folder must be here
        vae = vae_lib.load_vae(geometry, torch.device("cpu"))
    return classes, geometry, vae


def export_checkpoint(cfg: TrainConfig, path: Path, meta: dict, out: Path, *, max_shard_size: str | None) -> str:
    """Write the export of checkpoint `path` to `out` (scripts/export.py); returns what was written, in words."""
    return export_zero(
        path,
        max_shard_size,
        lambda ckpt, shard_size: write_export(cfg, ckpt, out, step=int(meta["step"]), max_shard_size=shard_size),
    )


def write_export(cfg: TrainConfig, ckpt: ZeroCheckpoint, out: Path, *, step: int, max_shard_size: int) -> int:
    """Write the export of checkpoint `ckpt` (of step `step`) to `out`; returns the weight bytes written."""
    classes, geometry, vae = export_parts(cfg)
    in_channels, sample_size, _ = model_geometry(cfg)
    with torch.device("meta"):
        model = build_model(cfg.model, sample_size, in_channels)
    # The EMA's names: the trainable parameters (a shared embedding once); the saved layout: every state-dict key,
    # a shared embedding under each block (untied()'s layout).
    written = write_ema_module(ckpt, model, out / "transformer", "diffusion_pytorch_model.safetensors", max_shard_size)
    write_export_files(
        out, cfg, geometry, classes, vae=vae, step=step, null_class=null_class(model), sample_size=sample_size
    )
    return written


def lora_base(cfg: TrainConfig) -> str:
    """The folder a finetune=lora export loads its base from: model.init_from's transformer (resolved when the run
    composed)."""
    return cfg.model.init_from


def export_lora_checkpoint(cfg: TrainConfig, path: Path, meta: dict, out: Path, *, max_shard_size: str | None) -> str:
    """Write the export of finetune=lora checkpoint `path` to `out` (scripts/export.py); returns what was written."""
    return export_ema_lora(cfg, path, meta, out, max_shard_size, write_lora_export)


def write_lora_export(cfg: TrainConfig, ckpt: ZeroCheckpoint, out: Path, *, step: int) -> int:
    """Write the export of finetune=lora checkpoint `ckpt` (of step `step`) to `out`: the EMA adapter as a PEFT folder,
    with export.merge_lora the merged model as a whole export in out/merged; returns the adapter's parameter count."""
    in_channels, sample_size, _ = model_geometry(cfg)
    model = dit_lora.adapted_model(cfg, sample_size, in_channels)
    adapter = load_ema_adapter(model, ckpt)

    def pipeline(folder: Path, transformer) -> None:  # export.merge_lora only: the data's classes and the VAE
        classes, geometry, vae = export_parts(cfg)
        write_pipeline(
            folder,
            transformer,
            cfg,
            geometry,
            classes,
            vae=vae,
            step=step,
            null_class=null_class(model),
            sample_size=sample_size,
        )

    dit_lora.write_export(model, cfg, out, base=cfg.model.init_from, write_pipeline=pipeline)
    return sum(p.numel() for p in adapter.values())
