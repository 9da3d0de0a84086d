"""The Qwen-VL generations the VLM recipe trains through one code path (recipes/vlm/qwen.py), one QwenArch each,
keyed by the model_type of their folders. json only, no torch: config validation (recipes/vlm/weights.py) and the
packing code (recipes/vlm/qwen.py) both read it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class VideoRule:
    """How a Qwen-VL generation's processor turns a video into tokens (recipes/vlm/video.py, qwen.py): Qwen2.5-VL's
    Qwen2VLVideoProcessor or Qwen3-VL's Qwen3VLVideoProcessor + Qwen3VLProcessor, rule for rule."""

    # Frame sampling: Qwen3VLVideoProcessor's int(duration x fps) frames (at least 4, at most max_frames and the
    # video's) at np.linspace(0, total - 1, n).round(); else Qwen2VLVideoProcessor's, floored to whole temporal
    # patches at torch.arange(0, total, total / n).
    linspace: bool
    # The video pixel budget (the video processor's size) bounds the sampled clip's frames together
    # (Qwen3VLVideoProcessor's smart_resize over t x h x w) rather than each frame (Qwen2VLVideoProcessor's resize).
    clip_budget: bool
    # A `<t seconds>` text (the temporal patch's mean frame time) and its own <|vision_start|>..<|vision_end|> before
    # each temporal patch's pads (Qwen3VLProcessor.replace_video_token; get_rope_index lays each group out as a
    # one-frame grid after its text), where Qwen2.5-VL spaces the time positions by second_per_grid_ts instead.
    timestamps: bool
    # transformers' video processor class of the generation: what the export's video_preprocessor_config.json names.
    processor: str
    # min_pixels / max_pixels keys of its config replace size's edges (Qwen2VLVideoProcessor.__init__'s backward
    # compatibility; Qwen3VLVideoProcessor reads `size` alone).
    pixel_keys: bool
    # The class's own values, where a folder's video processor config says nothing (transformers' class attributes
    # as installed; tests/unit/test_vlm_qwen.py checks Qwen3-VL's against them, the integration test both).
    defaults: dict = field(compare=False)


_VIDEO_DEFAULTS = dict(
    min_frames=4,
    max_frames=768,
    temporal_patch_size=2,
    merge_size=2,
    resample=3,  # bicubic
    do_resize=True,
    do_rescale=True,
    rescale_factor=1 / 255,
    do_normalize=True,
    cap_pixels_per_frame=None,  # unset: transformers keeps the uncapped resize (with a warning)
)
_CLIP_MEAN, _CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
QWEN2_VIDEO = VideoRule(
    linspace=False,
    clip_budget=False,
    timestamps=False,
    processor="Qwen2VLVideoProcessor",
    pixel_keys=True,
    defaults={
        **_VIDEO_DEFAULTS,
        "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
        "fps": None,  # it samples no frames unless asked and given a rate (qwen-vl-utils samples before it)
        "do_sample_frames": False,
        "max_video_tokens": 128000,  # the context length its cap_pixels_per_frame budgets 90% of
        "patch_size": 14,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
    },
)
QWEN3_VIDEO = VideoRule(
    linspace=True,
    clip_budget=True,
    timestamps=True,
    processor="Qwen3VLVideoProcessor",
    pixel_keys=False,
    defaults={
        **_VIDEO_DEFAULTS,
        "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
        "fps": 2,
        "do_sample_frames": True,
        "max_video_tokens": 768,  # tokens per frame under cap_pixels_per_frame
        "patch_size": 16,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    },
)


@dataclass(frozen=True)
class QwenArch:
    """What differs between the Qwen-VL generations that train through one code path (recipes/vlm/qwen.py): the
    rest (native-resolution image processor, <|image_pad|> expansion, the tower over one patch sequence with per-image
    cu_seqlens, 3-row mRoPE positions from get_rope_index, the packed language rows) is the same."""

    name: str  # in words
    model: str  # transformers' class of the folder (weights, forward, generate; the export loads as it)
    base: str  # its inner model, whose get_rope_index lays out a sample's mRoPE positions
    tower: str  # vision_config.model_type
    patch: int  # px side of a patch; an image token merges 2x2 of them (`unit`)
    # The tower also merges intermediate blocks' features and adds them to the first language layers' hidden states
    # at the image tokens (DeepStack): those mergers are projectors too (recipes/vlm/parallelize.py's vlm_parts).
    deepstack: bool
    # How its videos become tokens (recipes/vlm/video.py, qwen.py: one code path, these rules the difference); None:
    # a generation whose videos Kiln does not encode (its runs would refuse data with videos and the video keys).
    video: VideoRule | None
    # The tower's norms (its blocks' and its mergers') and its blocks' MLP, in the memory model's words
    # (common/memory.py Block: rmsnorm | layernorm, swiglu | gelu), for recipes/vlm/sizing.py. The rest of the tower
    # its config says: windows (window_size, fullatt_block_indexes), DeepStack (deepstack_visual_indexes), learned
    # position embeddings (num_position_embeddings).
    tower_norm: str
    tower_mlp: str

    @property
    def unit(self) -> int:
        """px side of one image token: the image processor resizes to multiples of it (2x2 merge, both releases)."""
        return 2 * self.patch


# model_type of a Qwen-VL folder -> its architecture; the model_type is also its model.vision (its own tower, set
# from the folder by recipes/vlm/config.py). Qwen3-VL's language model is Qwen3 (q/k norms) with interleaved mRoPE
# sections: transformers' classes carry that, and the positions' layout ([3, R, L], or [4, 1, R*L] packed) is shared.
QWEN_ARCHS = {
    "qwen2_5_vl": QwenArch(
        "Qwen2.5-VL",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5_VLModel",
        "qwen2_5_vl_vision",
        14,
        False,
        QWEN2_VIDEO,
        tower_norm="rmsnorm",
        tower_mlp="swiglu",
    ),
    "qwen3_vl": QwenArch(
        "Qwen3-VL",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLModel",
        "qwen3_vl_vision",
        16,
        True,
        QWEN3_VIDEO,
        tower_norm="layernorm",
        tower_mlp="gelu",
    ),
}
QWEN_NAMES = " or ".join(a.name for a in QWEN_ARCHS.values())
VIDEO_NAMES = " or ".join(a.name for a in QWEN_ARCHS.values() if a.video)


def qwen_arch(folder) -> QwenArch:
    """The QwenArch of a Qwen-VL folder, from its config.json's model_type."""
    return QWEN_ARCHS[json.loads((Path(folder) / "config.json").read_text())["model_type"]]
