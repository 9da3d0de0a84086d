"""Schemas of the VLM recipe's own config sections: `model` (architecture), `vlm` (training stage, sources,
eval) and `data` (image-conversation shards). A leaf in recipes/vlm: recipes/vlm/config.py registers and validates
them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from common.config import DataConfig
from common.errors import ConfigError


@dataclass
class VLMModelConfig:
    """A LLaVA: vision tower (SigLIP or CLIP) -> MLP projector -> Llama language model."""

    vision: str = "siglip"  # siglip | clip (qwen2_5_vl / qwen3_vl: set from a Qwen-VL model.init_from, its own tower)
    image_size: int = 16
    vision_patch_size: int = 4  # the tower's patch side in pixels (vision_config.patch_size)
    vision_hidden_size: int = 64
    vision_layers: int = 2
    vision_heads: int = 4
    vision_intermediate_size: int = 128
    # Which tower output feeds the projector. null / auto: LLaVA's default for the tower (TOWER_DEFAULTS):
    # CLIP the penultimate layer without its CLS token, SigLIP the last layer (it has no CLS token).
    vision_feature_layer: Optional[int] = None
    vision_feature_select_strategy: str = "auto"  # auto | full | default (default drops the first token: CLIP's CLS)
    text_hidden_size: int = 128
    text_layers: int = 2
    text_heads: int = 4
    text_kv_heads: int = 2
    text_intermediate_size: int = 256
    max_seq_len: int = 512  # the longest row the language model accepts (text_config.max_position_embeddings)
    vocab_size: int = 0  # 0: the size of the data's tokenizer
    rope_theta: float = 10000.0
    # A LLaVA to continue from (its config.json decides the architecture: `model.*` above are read from it, and one
    # given on the command line must agree): an align run (dir or export) or a llava-hf folder. Empty: built from
    # vlm.vision_from + vlm.language_from, or fresh weights shaped by `model.*` (recipes/vlm/weights.py).
    init_from: str = ""


# LLaVA's feature choice per tower: (vision_feature_layer, vision_feature_select_strategy).
TOWER_DEFAULTS = {"clip": (-2, "default"), "siglip": (-1, "full")}


@dataclass
class VLMConfig:
    stage: str = "finetune"  # align: projector only | finetune: projector + language model
    # Where the weights come from (with model.init_from; all empty: fresh weights shaped by `model.*`, the digits demo):
    vision_from: str = ""  # a CLIP / SigLIP folder (vision model or the whole dual encoder) + its image processor
    language_from: str = ""  # a *ForCausalLM folder (Llama family) + its tokenizer
    train_vision: bool = False  # finetune: train the vision tower too (LLaVA keeps it frozen)
    # finetune (full or LoRA): train the projector (Qwen2.5-VL's merger) too. false keeps the folder's: a full finetune
    # then trains the language model alone, and a finetune=lora adapter holds the language model's LoRA only, which
    # vLLM serves over the base (it takes no fully trained module in an adapter).
    train_projector: bool = True
    eval_samples: int = 200  # held-out images answered at the end
    max_new_tokens: int = 12


@dataclass
class VLMDataConfig(DataConfig):
    """Image-conversation shards (configs/data/vlm_digits|llava): rows of up to max_seq_len tokens."""

    packing: bool = True  # pack conversations into rows of max_seq_len (no attention across them)
    max_seq_len: int = 256
    # Native resolution (a Qwen2.5-VL / Qwen3-VL model.init_from): each image keeps its aspect ratio, resized by the
    # image processor to a multiple of 28 px (Qwen3-VL: 32) with min_pixels <= h*w <= max_pixels; 0 keeps the
    # folder's budget. Images only: videos keep the budget of the folder's video processor (recipes/vlm/video.py).
    min_pixels: int = 0
    max_pixels: int = 0
    # Videos (a Qwen2.5-VL or Qwen3-VL model.init_from): frames sampled at video_fps per second of video, at most
    # max_frames: the fps / max_frames of the folder's video processor (video_preprocessor_config.json, as
    # transformers loads it) when null, these values in their place when set; the export's video processor config
    # records what ran. (Qwen2.5-VL's video processor names no rate of its own: 2, qwen-vl-utils'.)
    video_fps: Optional[float] = None
    max_frames: Optional[int] = None
    # How many steps' samples the loader lays out together by their sizes (language tokens, tower patches: Qwen2.5-VL
    # conversations): each step's micro-batches (ranks x grad_accum) get samples that fill their rows and balance
    # their tower sequences; more than 1 also chooses which samples share a step. 0: by stream position.
    pack_buffer: int = 1


# ---- value checks that need no model (config validation, and the code that loads one) ----
VIDEO_TEMPORAL_PATCH = 2  # Qwen2.5-VL's tower takes frames in pairs (vision_config.temporal_patch_size)


def check_pixel_budget(min_pixels: int, max_pixels: int, unit: int) -> None:
    """One line for a pixel budget (data.min_pixels / data.max_pixels, 0 = the folder's) that is inverted or
    smaller than one merged patch, `unit` px square (a Qwen-VL's smallest image: 28 px for Qwen2.5-VL's 2x2 merge
    of 14-px patches, 32 for Qwen3-VL's 16-px ones; transformers would resize outside the budget without a word)."""
    for key, value in (("data.min_pixels", min_pixels), ("data.max_pixels", max_pixels)):
        if value < 0 or (value and value < unit * unit):
            raise ConfigError(f"{key}={value} is below one merged {unit}x{unit} patch ({unit * unit} pixels)")
    if min_pixels and max_pixels and min_pixels > max_pixels:
        raise ConfigError(f"data.min_pixels={min_pixels} is above data.max_pixels={max_pixels}")


def check_video_sampling(video_fps: float | None, max_frames: int | None) -> None:
    """One line for a video sampling rate that is not positive or a frame budget below one temporal patch (None:
    the folder's, checked by nothing here)."""
    if video_fps is not None and not video_fps > 0:
        raise ConfigError(f"data.video_fps={video_fps} must be above 0 (frames sampled per second of video)")
    if max_frames is not None and max_frames < VIDEO_TEMPORAL_PATCH:
        raise ConfigError(
            f"data.max_frames={max_frames} is below one temporal patch ({VIDEO_TEMPORAL_PATCH} frames) of the tower"
        )


def check_heads(cp: int, heads: int, kv_heads: int, where: str) -> None:
    """One line where cp cannot split the language model's heads: each rank attends with heads/cp whole query heads
    and kv_heads/cp whole key/value heads (a GQA group stays on one rank)."""
    if heads % cp or kv_heads % cp:
        raise ConfigError(
            f"parallel.cp={cp} must divide the language model's {heads} attention heads and {kv_heads} key/value "
            f"heads ({where}): Ulysses attention gives each cp rank heads/cp whole heads"
        )
