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

import json
from pathlib import Path

import torch

from common.config import TrainConfig
from common.data.dataset import load_dataset_meta
from common.diffusion import vae as vae_lib
from common.diffusion.objective import sampling_scheduler
from common.ds_export import ZeroCheckpoint, export_ema, export_ema_lora, load_ema_adapter, write_ema_module
from recipes.dit import lora as dit_lora
from recipes.dit.data import class_names
from recipes.dit.model import build_model, null_class
from recipes.dit.sizing import model_geometry


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
    return export_ema(cfg, path, meta, out, max_shard_size, write_export)


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


def write_pipeline(
    folder: Path,
    transformer,
    cfg: TrainConfig,
    geometry: vae_lib.VaeGeometry | None,
    classes: list[str],
    *,
    vae,
    step: int,
    null_class: int,
    sample_size: int,
) -> None:
    """A whole DiT export of ``transformer`` in ``folder``: transformer/ and what every DiT export holds besides
    (write_export_files)."""
    transformer.save_pretrained(folder / "transformer", safe_serialization=True)
    write_export_files(
        folder, cfg, geometry, classes, vae=vae, step=step, null_class=null_class, sample_size=sample_size
    )


def write_export_files(
    folder: Path,
    cfg: TrainConfig,
    geometry: vae_lib.VaeGeometry | None,
    classes: list[str],
    *,
    vae,
    step: int,
    null_class: int,
    sample_size: int,
) -> None:
    """What a DiT export holds besides transformer/ (the end of a run and scripts/export.py write the same):
    the sampling scheduler/, the VAE (vae/) and a DiTPipeline model_index.json for latent DDPM models, kiln.json."""
    sampling_scheduler(cfg.diffusion).save_pretrained(folder / "scheduler")
    if vae is not None:
        vae.save_pretrained(folder / "vae", safe_serialization=True)
    info = export_info(cfg, geometry, classes, step=step, null_class=null_class, sample_size=sample_size)
    if info["diffusers_pipeline"]:
        (folder / "model_index.json").write_text(json.dumps(dit_pipeline_index(classes), indent=2))
    (folder / "kiln.json").write_text(json.dumps(info, indent=2))


def dit_pipeline_index(classes: list[str]) -> dict:
    """model_index.json of a diffusers DiTPipeline over the export's folders; `id2label` maps class
    ids to names (DiTPipeline.get_label_ids reads it)."""
    import diffusers

    return {
        "_class_name": "DiTPipeline",
        "_diffusers_version": diffusers.__version__,
        "transformer": ["diffusers", "DiTTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "scheduler": ["diffusers", "DDIMScheduler"],
        "id2label": {str(i): name for i, name in enumerate(classes)},
    }


def export_info(
    cfg: TrainConfig,
    geometry: vae_lib.VaeGeometry | None,
    classes: list[str],
    *,
    step: int,
    null_class: int,
    sample_size: int,
) -> dict:
    """kiln.json: what sampling an export needs besides the diffusers folders, and whether diffusers'
    DiTPipeline runs it. It does for latent DDPM models: its denoising loop is DDIM's here, its decode
    is vae.decode(latents / scaling_factor). It does not for pixel-space models (it always decodes
    with a VAE), for flow models (FlowMatchEulerDiscreteScheduler has no scale_model_input, which its
    loop calls) or for VAEs with a shift_factor (its decode leaves the shift out): scripts/sample_dit.py
    samples every kind. DiTPipeline's guidance uses ImageNet's null class 1000, so guided sampling
    (guidance_scale > 1) through it is right only for model.num_classes=1000."""
    d = cfg.diffusion
    why_not = (
        "pixel space (DiTPipeline decodes with a VAE)"
        if geometry is None
        else "flow objective (DiTPipeline's loop is for DDPM schedulers)"
        if d.objective == "flow"
        else "the VAE has a shift_factor (DiTPipeline's decode ignores it)"
        if geometry.shift_factor
        else None
    )
    info = {
        "recipe": cfg.recipe.name,
        "step": step,
        "objective": d.objective,
        "prediction": "velocity (noise - x_0)" if d.objective == "flow" else d.prediction_type,
        "image_size": cfg.data.image_size,
        "sample_size": sample_size,
        "num_classes": len(classes),
        "classes": classes,
        "null_class": null_class,
        "sample_steps": d.sample_steps,
        "guidance_scale": d.guidance_scale,
        "scheduler": "FlowMatchEulerDiscreteScheduler (Euler on the velocity, t from 1 to 0)"
        if d.objective == "flow"
        else "DDIMScheduler (eta=0) on the DDPM schedule the model was trained with",
        "latent": None
        if geometry is None
        else {
            "vae": "vae/",
            "scaling_factor": geometry.scaling_factor,
            "shift_factor": geometry.shift_factor,
            "decode": "vae.decode(latents / scaling_factor + shift_factor)",
        },
        "diffusers_pipeline": None if why_not else "DiTPipeline",
        "sample_with": "python scripts/sample_dit.py EXPORT_DIR",
    }
    if why_not:
        info["diffusers_pipeline_note"] = f"not loadable as a diffusers DiTPipeline: {why_not}"
    return info
