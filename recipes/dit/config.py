"""Schemas of the DiT recipe's own config sections: `model` (architecture) and `diffusion`."""

from __future__ import annotations

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

from common.config import TrainConfig
from common.errors import ConfigError


@dataclass
class DiTModelConfig:
    """Arguments of diffusers' DiTTransformer2DModel (pixel space: no VAE)."""

    num_layers: int = 4
    num_attention_heads: int = 4
    attention_head_dim: int = 16
    patch_size: int = 2
    in_channels: int = 1
    num_classes: int = 10
    dropout: float = 0.0
    norm_num_groups: int = 32


@dataclass
class DiffusionConfig:
    num_train_timesteps: int = 1000
    beta_schedule: str = "squaredcos_cap_v2"
    prediction_type: str = "v_prediction"  # or epsilon
    class_dropout: float = 0.1  # label dropout for classifier-free guidance
    ema_decay: float = 0.999
    sample_steps: int = 50  # DDIM steps for sample grids and eval
    guidance_scale: float = 2.0
    samples_per_class: int = 8  # sample grid: one row per class
    eval_samples_per_class: int = 50


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(group="model", name="dit_schema", node=DiTModelConfig)
    cs.store(group="diffusion", name="dit_schema", node=DiffusionConfig)


def validate(cfg: TrainConfig) -> None:
    m, d = cfg.model, cfg.diffusion
    if not isinstance(m, DiTModelConfig) or not isinstance(d, DiffusionConfig):
        raise ConfigError("recipe.family=dit needs model=dit_* and diffusion=ddpm config groups")
    for key in ("num_layers", "num_attention_heads", "attention_head_dim", "patch_size", "in_channels", "num_classes"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"model.{key}={getattr(m, key)} must be > 0")
    if cfg.data.image_size % m.patch_size:
        raise ConfigError(f"data.image_size={cfg.data.image_size} must be a multiple of model.patch_size={m.patch_size}")
    inner = m.num_attention_heads * m.attention_head_dim
    if inner % m.norm_num_groups:
        raise ConfigError(f"model.num_attention_heads*attention_head_dim={inner} must be divisible by model.norm_num_groups={m.norm_num_groups}")
    if cfg.parallel.tp != 1 or cfg.parallel.pp != 1:
        raise ConfigError(f"parallel.tp={cfg.parallel.tp} parallel.pp={cfg.parallel.pp}: the DiT recipe shards with ZeRO data parallelism only (tp=pp=1)")
    if d.prediction_type not in ("epsilon", "v_prediction"):
        raise ConfigError(f"diffusion.prediction_type={d.prediction_type!r} is not allowed; choose epsilon or v_prediction")
    if not 0.0 <= d.class_dropout < 1.0:
        raise ConfigError(f"diffusion.class_dropout={d.class_dropout} must be in [0, 1)")
    if not 0.0 <= d.ema_decay < 1.0:
        raise ConfigError(f"diffusion.ema_decay={d.ema_decay} must be in [0, 1)")
    for key in ("num_train_timesteps", "sample_steps", "samples_per_class", "eval_samples_per_class"):
        if getattr(d, key) <= 0:
            raise ConfigError(f"diffusion.{key}={getattr(d, key)} must be > 0")
    if d.sample_steps > d.num_train_timesteps:
        raise ConfigError("diffusion.sample_steps must be <= diffusion.num_train_timesteps")
