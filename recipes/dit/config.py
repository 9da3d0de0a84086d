"""Schemas of the DiT recipe's own config sections: `model` (architecture), `diffusion` and `data` (images)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from common.config import (
    ZERO_LAYOUTS,
    DataConfig,
    TrainConfig,
    ZeroParallelConfig,
    check_family_sections,
    fill_from_checkpoint,
)
from common.diffusion.config import DiffusionConfig
from common.errors import ConfigError

OBJECTIVES = ("ddpm", "flow")
PREDICTION_TYPES = ("epsilon", "v_prediction")
FLOW_TIMESTEPS = ("logit_normal", "uniform")
# parallel.cp_method (its spec's cp_methods, the default first): Ulysses (common/ulysses.py), named as the LLM names
# the same exchange of heads for tokens. One method, so the default and the only choice.
CP_METHODS = ("alltoall",)
# finetune=lora (common/lora.py): the blocks' attention and feed-forward linears (diffusers' names), all by default.
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2")


@dataclass
class DiTModelConfig:
    """Arguments of diffusers' DiTTransformer2DModel. Its input shape follows the data: the image
    channels and `data.image_size` in pixel space, the VAE's latent channels and latent size with
    `diffusion.vae` (common/diffusion/vae.py)."""

    num_layers: int = 4
    num_attention_heads: int = 4
    attention_head_dim: int = 16
    patch_size: int = 2
    in_channels: int = 1  # pixel space: the images' channels (1 for the digits, 3 for RGB); unused with a VAE
    num_classes: int = 10  # label table size (>= the dataset's classes); the null class for CFG is this index
    dropout: float = 0.0
    norm_num_groups: int = 32
    # The DiT paper's layout: one timestep + class embedding shared by every block (diffusers'
    # layout gives each block its own copy: +2.78M parameters per block at DiT-XL/2's width).
    shared_conditioning: bool = False
    # A diffusers DiT to start from (recipes/dit/weights.py): a DiTPipeline folder, a Kiln DiT export or run dir,
    # or a DiTTransformer2DModel folder. Its config.json sets the keys above; finetune=lora adapts it.
    init_from: str = ""


@dataclass
class DiTDataConfig(DataConfig):
    """Image shards (configs/data/digits|images), or the latent cache encoded from them."""

    image_size: int = 16
    latents: str = ""  # a latent cache (python -m data.cache_latents) to train from instead of encoding data.root


# The top-level sections only this family has (its spec's `sections`, recipes/registry.py): diffusion.* keys.
SECTIONS = {"diffusion": DiffusionConfig}
# Keys this family renamed (its spec's `renamed`): old dotted key -> new. The old spelling still composes, with one
# note, until the next release (scripts/kiln/launch.py rename_overrides; scripts/export.py reads old runs' config.yaml).
RENAMED = {"trainer.sample_every": "diffusion.sample_every"}  # only the DiT draws sample grids


# The schemas of this family's config groups (its spec's `config.SCHEMAS`): (group, name, dataclass), stored in
# Hydra's ConfigStore by common/compose.py; the group files name them in their defaults (`- dit_schema`).
SCHEMAS = [
    ("data", "dit_schema", DiTDataConfig),
    ("model", "dit_schema", DiTModelConfig),
    ("diffusion", "dit_schema", DiffusionConfig),
]


def complete(cfg: TrainConfig, command_line: set[str]) -> None:
    """With model.init_from: the model.* keys from its config.json, in place (config.yaml, run.dry_run and the
    planner see the real model); a key given on the command line that disagrees stops the run. Otherwise the
    DiT's shape is its model.* keys (and diffusion.vae's latents)."""
    from recipes.dit.weights import CHECKPOINT_KEYS, base_config, transformer_folder

    m = cfg.model
    if not isinstance(m, DiTModelConfig) or not m.init_from:
        return
    folder = transformer_folder(m.init_from)
    config = base_config(folder)
    m.init_from = str(folder)
    fill_from_checkpoint(
        m, {key: (name, config[name]) for key, name in CHECKPOINT_KEYS.items()}, command_line, m.init_from
    )


def validate(cfg: TrainConfig) -> None:
    m, d = cfg.model, cfg.diffusion
    if not isinstance(m, DiTModelConfig) or not isinstance(d, DiffusionConfig):
        raise ConfigError("recipe.family=dit needs model=dit_* and diffusion=ddpm config groups")
    for key in ("num_layers", "num_attention_heads", "attention_head_dim", "patch_size", "in_channels", "num_classes"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"model.{key}={getattr(m, key)} must be > 0")
    inner = m.num_attention_heads * m.attention_head_dim
    if inner % m.norm_num_groups:
        raise ConfigError(
            f"model.num_attention_heads*attention_head_dim={inner} must be divisible by "
            f"model.norm_num_groups={m.norm_num_groups}"
        )
    if cfg.finetune == "lora" and not m.init_from and not cfg.run.dry_run:  # sizing reads no weights
        raise ConfigError(
            "finetune=lora trains an adapter on a DiT checkpoint: set model.init_from=<a DiTPipeline folder "
            "or a DiT run's export>"
        )
    if m.init_from and m.shared_conditioning:
        raise ConfigError(
            f"model.shared_conditioning=true with model.init_from={m.init_from}: a diffusers DiT holds one "
            "conditioning embedding per block; set model.shared_conditioning=false"
        )
    check_family_sections(
        cfg,
        "DiT",
        parallel=ZeroParallelConfig,
        layouts=f"DeepSpeed ZeRO ({ZERO_LAYOUTS})",
        data=DiTDataConfig,
        datasets="digits or images (image shards)",
    )
    if cfg.data.image_size <= 0:
        raise ConfigError(f"data.image_size={cfg.data.image_size} must be > 0")
    check_diffusion(cfg)
    check_latent_size(cfg)


def check_diffusion(cfg: TrainConfig) -> None:
    """diffusion.*'s choices and ranges (and model.dropout's), and what data.latents needs of it."""
    m, d = cfg.model, cfg.diffusion
    if d.objective not in OBJECTIVES:
        raise ConfigError(f"diffusion.objective={d.objective!r} is not allowed; choose one of: {', '.join(OBJECTIVES)}")
    if d.prediction_type not in PREDICTION_TYPES:
        raise ConfigError(
            f"diffusion.prediction_type={d.prediction_type!r} is not allowed; choose epsilon or v_prediction"
        )
    if d.flow_timesteps not in FLOW_TIMESTEPS:
        raise ConfigError(
            f"diffusion.flow_timesteps={d.flow_timesteps!r} is not allowed; choose one of: {', '.join(FLOW_TIMESTEPS)}"
        )
    for key in ("flow_logit_std", "flow_shift"):
        if not getattr(d, key) > 0:
            raise ConfigError(f"diffusion.{key}={getattr(d, key)} must be > 0")
    if not 0.0 <= m.dropout < 1.0:  # (with activation checkpointing the recomputation replays its masks)
        raise ConfigError(f"model.dropout={m.dropout} must be in [0, 1)")
    if not 0.0 <= d.class_dropout < 1.0:
        raise ConfigError(f"diffusion.class_dropout={d.class_dropout} must be in [0, 1)")
    if d.sample_every < 0:
        raise ConfigError(f"diffusion.sample_every={d.sample_every} must be >= 0")
    if not 0.0 <= d.ema_decay < 1.0:
        raise ConfigError(f"diffusion.ema_decay={d.ema_decay} must be in [0, 1)")
    for key in ("num_train_timesteps", "sample_steps", "samples_per_class", "eval_samples_per_class"):
        if getattr(d, key) <= 0:
            raise ConfigError(f"diffusion.{key}={getattr(d, key)} must be > 0")
    if d.objective == "ddpm" and d.sample_steps > d.num_train_timesteps:
        raise ConfigError("diffusion.sample_steps must be <= diffusion.num_train_timesteps")
    if cfg.data.latents and not d.vae:
        raise ConfigError(
            f"data.latents={cfg.data.latents} needs diffusion.vae (the VAE that encoded them decodes the samples)"
        )


def check_latent_size(cfg: TrainConfig) -> None:
    """The DiT's input (the VAE's latents or the images) against model.patch_size, parallel.cp and model.init_from."""
    from common.diffusion.vae import vae_geometry

    m, d = cfg.model, cfg.diffusion
    # The VAE's config.json decides the latent shape (a missing folder is reported when training
    # starts: sizing a run with run.dry_run or scripts/plan.py does not need it).
    geometry = vae_geometry(d.vae, cfg.data.image_size, must_exist=False) if d.vae else None
    size = geometry.latent_size if geometry else cfg.data.image_size
    if size % m.patch_size:
        what = (
            f"the latent size {size} (data.image_size={cfg.data.image_size} through diffusion.vae)"
            if geometry
            else f"data.image_size={cfg.data.image_size}"
        )
        raise ConfigError(f"{what} must be a multiple of model.patch_size={m.patch_size}")
    check_context_parallel(cfg, (size // m.patch_size) ** 2)
    base_size = json.loads((Path(m.init_from) / "config.json").read_text())["sample_size"] if m.init_from else size
    if base_size != size:
        raise ConfigError(
            f"model.init_from={m.init_from} is a DiT on {base_size}x{base_size} inputs; this run's are "
            f"{size}x{size} (data.image_size={cfg.data.image_size}{' through diffusion.vae' if geometry else ''})"
        )


def check_context_parallel(cfg: TrainConfig, tokens: int) -> None:
    """parallel.cp (Ulysses, common/ulysses.py): what it cannot split, and diffusers' eager processor, which has no
    (B, S, H, D) kernel to wrap (sdpa and flash have)."""
    from common import ulysses  # torch: here, so that the registry (which serving reads) imports light

    m = cfg.model
    ulysses.check_layout(
        cfg,
        heads=m.num_attention_heads,
        tokens=tokens,
        heads_from="model.num_attention_heads",
        tokens_from=f"data.image_size={cfg.data.image_size}, model.patch_size={m.patch_size}",
    )
    if cfg.parallel.cp > 1 and cfg.toggles.attention == "eager":
        raise ConfigError(
            f"toggles.attention=eager with parallel.cp={cfg.parallel.cp}: Ulysses attention wraps the sdpa or flash "
            "kernel; use toggles.attention=sdpa"
        )
