"""The DiT in the memory model (common/memory.py) for scripts/plan.py and run.dry_run, and its geometry: the latent
shape it is built for (what the trainer and the export build it with too). Imports the model, never the trainer."""

from __future__ import annotations

import functools

import torch

from common import lora
from common.config import TrainConfig
from common.diffusion import vae as vae_lib
from common.memory import Block, ModelSpec, count_params, largest_module_params, largest_trainable
from recipes.dit.model import build_model, shared_conditioning


def model_geometry(cfg: TrainConfig) -> tuple[int, int, vae_lib.VaeGeometry | None]:
    """(in_channels, sample_size, VAE geometry or None) of the DiT: the VAE's latent shape for
    `data.image_size` images with `diffusion.vae`, else `model.in_channels` x `data.image_size`. A
    VAE folder that is not here reads as its assumed shape (sizing only: training loads it)."""
    if not cfg.diffusion.vae:
        return cfg.model.in_channels, cfg.data.image_size, None
    geometry = vae_lib.vae_geometry(cfg.diffusion.vae, cfg.data.image_size, must_exist=False)
    return geometry.latent_channels, geometry.latent_size, geometry


def memory_spec(cfg: TrainConfig) -> ModelSpec:
    """The DiT for the memory model (common/memory.py): built on the meta device, counted."""
    m = cfg.model
    in_channels, sample_size, _ = model_geometry(cfg)
    with torch.device("meta"):
        model = build_model(m, sample_size, in_channels)
    if cfg.finetune == "lora":  # the adapters train; the base is frozen weights only (in the compute dtype)
        lora.apply_lora(model, cfg.lora)
    trained = functools.partial(count_params, trainable_only=True)
    first_block = model.transformer_blocks[0]
    # A shared conditioning embedding belongs to no layer: counted once, with the patch embedding.
    layer = trained(first_block) - trained(shared_conditioning(model))
    block = Block(
        hidden=m.num_attention_heads * m.attention_head_dim,
        heads=m.num_attention_heads,
        ffn=first_block.ff.net[-1].in_features,
        norm="adaln_zero",
        mlp="gelu",
        dropout=m.dropout > 0,
        attention="eager" if cfg.toggles.attention == "eager" else "fused",
        selective="save_narrow_matmuls",
    )
    # The DiT only: a VAE (sd-vae-ft-mse: 84M parameters, 335 MB in fp32 on every rank) sits outside
    # the engine, and a latent cache removes its activations from the step.
    return ModelSpec(
        cfg.recipe.name,
        block,
        layers=m.num_layers,
        seq=(sample_size // m.patch_size) ** 2,
        micro_batch=cfg.trainer.micro_batch_size,
        layer_params=layer,
        first_params=trained(model) - m.num_layers * layer,
        frozen_params=count_params(model) - trained(model),
        gather_unit_params=largest_module_params(model),
        largest_trainable=largest_trainable(model),
        precision=cfg.toggles.precision,
        ac_modes=("none", "selective", "full"),
        ema=True,
        context_parallel=True,  # the planner varies parallel.cp
        cp_method=cfg.parallel.cp_method,  # alltoall (Ulysses: common/ulysses.py), the DiT's only method
    )
