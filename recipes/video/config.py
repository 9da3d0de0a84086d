"""Schemas of the video recipe's config sections: `model` (a released WanPipeline folder to train), `data` (video-
caption shards) and, shared with the other diffusion families, `diffusion` (common/diffusion/config.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from common.config import ZERO_LAYOUTS, DataConfig, TrainConfig, ZeroParallelConfig, check_family_sections
from common.diffusion.config import DiffusionConfig, check_text_diffusion, refuse_dit_only, take_schedule
from common.errors import ConfigError


@dataclass
class VideoModelConfig:
    """The pipeline to train: its folder's model_index.json names the transformer, the video VAE, UMT5 and the
    scheduler (recipes/video/weights.py); nothing about the architecture is a key here."""

    # A diffusers WanPipeline folder (save_pretrained, or a downloaded Wan-AI/Wan2.1-T2V-1.3B-Diffusers or -14B-).
    init_from: str = ""
    # UMT5 tokens per prompt: WanPipeline's max_sequence_length (512). The transformer's cross-attention reads all of
    # them (padding is zeros), so a short-caption dataset trains faster with fewer; sample the export with the same.
    max_sequence_length: int = 512


@dataclass
class VideoDataConfig(DataConfig):
    """Video-caption shards (python -m data.prepare_videos): every clip num_frames x height x width."""

    num_frames: int = 81  # 4k + 1: Wan's VAE keeps the first frame and compresses the rest 4 to 1
    height: int = 480
    width: int = 832
    caption_dropout: float = 0.1  # share of samples trained on the empty prompt: classifier-free guidance
    # A cache of the frozen VAE's and UMT5's outputs on data.root (python -m data.cache_latents): the run then reads
    # the latents' moments and prompt embeddings from it and loads neither encoder for training.
    latents: str = ""
    # Aspect-ratio buckets: data.root built with prepare_videos --buckets (shapes of about data.height x data.width
    # pixels, each clip cropped to its nearest aspect ratio's); every global batch is one bucket's. Sample clips, the
    # export's kiln.json and the server stay at data.height x data.width.
    buckets: bool = False
    # The most clips prepare_videos may have skipped (meta.json `skipped`); null: no limit.
    max_bad_samples: Optional[int] = None  # noqa: UP045 (OmegaConf's structured configs read Optional)


# parallel.cp_method (its spec's cp_methods): Ulysses over the video tokens (common/ulysses.py).
CP_METHODS = ("alltoall",)
# finetune=lora (common/lora.py): the self- and cross-attention's linears of every block (diffusers' names), as
# diffusers' Wan LoRA training (finetrainers' default targets) adapts them.
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")

SECTIONS = {"diffusion": DiffusionConfig}

SCHEMAS = [
    ("data", "video_schema", VideoDataConfig),
    ("model", "video_schema", VideoModelConfig),
    ("diffusion", "dit_schema", DiffusionConfig),
]


def complete(cfg: TrainConfig, command_line: set[str]) -> None:
    """With model.init_from: the folder checked (a WanPipeline Kiln trains, one line otherwise) and the flow schedule's
    keys (diffusion.num_train_timesteps, diffusion.flow_shift) read from its scheduler; a key given on the command
    line that disagrees stops the run."""
    from recipes.video.weights import pipeline_folder, schedule

    refuse_dit_only(command_line, "video")
    m = cfg.model
    if not isinstance(m, VideoModelConfig) or not m.init_from or not Path(m.init_from).expanduser().exists():
        return  # a missing folder is reported when training starts; sizing reads a release's shape (sizing.py)
    folder = pipeline_folder(m.init_from)
    m.init_from = str(folder)
    take_schedule(cfg, command_line, folder, schedule(folder))


def validate(cfg: TrainConfig) -> None:
    m, d, data = cfg.model, cfg.diffusion, cfg.data
    if not isinstance(m, VideoModelConfig) or not isinstance(d, DiffusionConfig):
        raise ConfigError("recipe.family=video needs model=video_* (or wan_*) and diffusion=flow config groups")
    check_family_sections(
        cfg,
        "video",
        parallel=ZeroParallelConfig,
        layouts=f"DeepSpeed ZeRO ({ZERO_LAYOUTS})",
        data=VideoDataConfig,
        datasets="moving_digits or clips (video-caption shards)",
    )
    check_text_diffusion(cfg, "video")
    if min(data.num_frames, data.height, data.width, m.max_sequence_length) <= 0:
        raise ConfigError("data.num_frames, data.height, data.width and model.max_sequence_length must be > 0")
    if data.buckets and data.latents:
        raise ConfigError(
            "data.buckets=true with data.latents: a latent cache holds one clip shape; train on the bucketed shards "
            "without data.latents"
        )
    if data.buckets and cfg.parallel.cp > 1:
        raise ConfigError(
            f"parallel.cp={cfg.parallel.cp} with data.buckets=true: each bucket has its own token count; train one "
            "clip shape (data.buckets=false) under context parallelism"
        )
    from recipes.video.sizing import architecture

    arch = architecture(m.init_from) if m.init_from else None
    if arch is not None:
        arch.check_clip(data.num_frames, data.height, data.width)
        arch.check_cp(cfg)
