"""Schemas of the text-to-image recipe's config sections: `model` (a released pipeline folder to train), `data`
(captioned image shards) and, shared with the class-conditional DiT, `diffusion` (common/diffusion/config.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from common.config import ZERO_LAYOUTS, DataConfig, TrainConfig, ZeroParallelConfig, check_family_sections
from common.diffusion.config import DiffusionConfig, check_text_diffusion, refuse_dit_only, take_schedule
from common.errors import ConfigError


@dataclass
class T2IModelConfig:
    """The pipeline to train: its folder's model_index.json names the transformer, VAE, text encoders, tokenizers
    and scheduler (recipes/t2i/weights.py); nothing about the architecture is a key here."""

    # A diffusers StableDiffusion3Pipeline or FluxPipeline folder (save_pretrained / a downloaded
    # stabilityai/stable-diffusion-3.5-*, black-forest-labs/FLUX.1-*).
    init_from: str = ""
    # T5 tokens per prompt (diffusers' StableDiffusion3Pipeline default, its `max_sequence_length`); CLIP's length is
    # its tokenizer's model_max_length. Longer prompts are truncated with one warning, as the pipeline does.
    max_sequence_length: int = 256


@dataclass
class T2IDataConfig(DataConfig):
    """Captioned image shards (python -m data.prepare_captions)."""

    image_size: int = 16
    caption_dropout: float = 0.1  # share of samples trained on the empty prompt: classifier-free guidance
    # A cache of the frozen encoders' outputs on data.root (python -m data.cache_latents, as the DiT's latent cache):
    # the run then reads latents' moments and prompt embeddings from it and never loads the text encoders.
    latents: str = ""
    # Aspect-ratio buckets: data.root built with prepare_captions --buckets (shapes of about data.image_size^2 pixels,
    # each image cropped to its nearest aspect ratio's); every global batch is one bucket's
    # (common/data/webdataset/stream.py).
    # Sample grids, the eval and the export stay square at data.image_size.
    buckets: bool = False
    # The most images prepare_captions may have skipped (meta.json `skipped`: undecodable, no or empty caption);
    # null: no limit. The builder's --max-bad-samples stops a build the same way.
    max_bad_samples: Optional[int] = None  # noqa: UP045 (OmegaConf's structured configs read Optional)


# parallel.cp_method (its spec's cp_methods, the default first): Ulysses (common/ulysses.py), named as the LLM names
# the same exchange of heads for tokens. One method, so the default and the only choice.
CP_METHODS = ("alltoall",)
# finetune=lora (common/lora.py): the joint attention's linears, image and text streams (diffusers' names), all by
# default, as diffusers' examples/dreambooth/train_dreambooth_lora_sd3.py adapts them (and _flux.py, with its MLPs
# besides; Flux's single-stream blocks have to_q, to_k, to_v only). A name matches in every block
# that has it (the last block has no to_add_out; SD3.5's dual-attention blocks' attn2 has to_q, to_k, to_v, to_out.0).
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")

# The diffusion core's section, the class-conditional DiT's schema (one section for both families: recipes/registry.py).
SECTIONS = {"diffusion": DiffusionConfig}


# The schemas of this family's config groups (its spec's `config.SCHEMAS`): (group, name, dataclass), stored in
# Hydra's ConfigStore by common/compose.py; the group files name them in their defaults (`- t2i_schema`).
SCHEMAS = [
    ("data", "t2i_schema", T2IDataConfig),
    ("model", "t2i_schema", T2IModelConfig),
    ("diffusion", "dit_schema", DiffusionConfig),
]


def complete(cfg: TrainConfig, command_line: set[str]) -> None:
    """With model.init_from: the folder checked (a pipeline Kiln trains, one line otherwise) and the flow schedule's
    keys (diffusion.num_train_timesteps, diffusion.flow_shift) read from its scheduler; a key given on the command
    line that disagrees stops the run."""
    from recipes.t2i.weights import SCHEDULER_KEYS, pipeline_folder, scheduler_config

    refuse_dit_only(command_line, "text-to-image")
    m = cfg.model
    if not isinstance(m, T2IModelConfig) or not m.init_from:
        return
    if not Path(m.init_from).expanduser().exists():
        # Reported when training starts (as the DiT's diffusion.vae): sizing a run with run.dry_run or scripts/plan.py
        # takes a released pipeline's shape from recipes/t2i/sizing.py instead.
        return
    folder = pipeline_folder(m.init_from)
    m.init_from = str(folder)
    scheduler = scheduler_config(folder)
    take_schedule(cfg, command_line, folder, {key: (name, scheduler[name]) for key, name in SCHEDULER_KEYS.items()})


def validate(cfg: TrainConfig) -> None:
    m, d = cfg.model, cfg.diffusion
    if not isinstance(m, T2IModelConfig) or not isinstance(d, DiffusionConfig):
        raise ConfigError("recipe.family=t2i needs model=t2i_* and diffusion=flow config groups")
    check_family_sections(
        cfg,
        "text-to-image",
        parallel=ZeroParallelConfig,
        layouts=f"DeepSpeed ZeRO ({ZERO_LAYOUTS})",
        data=T2IDataConfig,
        datasets="captions (captioned image shards)",
    )
    check_text_diffusion(cfg, "text-to-image")
    if cfg.data.image_size <= 0 or m.max_sequence_length <= 0:
        raise ConfigError("data.image_size and model.max_sequence_length must be > 0")
    if cfg.data.buckets and cfg.data.latents:
        raise ConfigError(
            "data.buckets=true with data.latents: a latent cache holds square images only; train on the bucketed "
            "shards without data.latents"
        )
    if m.init_from:
        from recipes.t2i.sizing import check_image_size

        check_image_size(m.init_from, cfg.data.image_size)
    check_context_parallel(cfg)


def check_context_parallel(cfg: TrainConfig) -> None:
    """parallel.cp (Ulysses over SD3's image tokens, common/ulysses.py; the text tokens stay whole on every cp rank):
    what it cannot split, read from model.init_from's transformer (its folder, or a release Kiln knows the shape of).
    Not yet: Flux (its RoPE runs over the joint token ids) and bucketed shards (a token count per bucket)."""
    from common import ulysses  # torch: here, so that the registry (which serving reads) imports light
    from recipes.t2i.sizing import architecture
    from recipes.t2i.weights import FLUX_TRANSFORMER

    cp, m = cfg.parallel.cp, cfg.model
    if cp == 1 or not m.init_from:
        return
    arch = architecture(m.init_from)
    t = arch.transformer
    if t.get("_class_name") == FLUX_TRANSFORMER:
        raise ConfigError(
            f"parallel.cp={cp}: model.init_from={m.init_from} is a FluxPipeline; context parallelism in the "
            "text-to-image recipe splits StableDiffusion3Pipeline transformers only (yet)"
        )
    if cfg.data.buckets:
        raise ConfigError(
            f"parallel.cp={cp} with data.buckets=true: each bucket has its own token count; train square images "
            "(data.buckets=false) under context parallelism"
        )
    side = cfg.data.image_size // (arch.vae_factor * t["patch_size"])
    ulysses.check_layout(
        cfg,
        heads=t["num_attention_heads"],
        tokens=side * side,
        heads_from="model.init_from's transformer",
        tokens_from=f"data.image_size={cfg.data.image_size} / the VAE's {arch.vae_factor} / patch {t['patch_size']}",
    )
