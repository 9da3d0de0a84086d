"""Qwen2.5-VL and Qwen3-VL inputs at native resolution, packed on both sides of the merger (what differs between the
two is a row of recipes/vlm/archs.py's QWEN_ARCHS: classes, patch size, DeepStack).

Each image keeps its aspect ratio: the image processor's own smart_resize fits it within its
min_pixels..max_pixels to a multiple of patch x merge (28 px; Qwen3-VL's 16-px patches: 32), then cuts it into
patches (two frames each: temporal_patch_size 2), returned as one [patches, 3*2*p*p] sequence and a (t, h, w) grid
per image. An image is (t*h*w) / merge^2 tokens: the number varies per image, and one `<|image_pad|>` in the chat
template's rendering stands for all of them (`image_pad_repeats`: transformers' Qwen2_5_VLProcessor rule, applied
here because the processor itself needs a torchvision video processor, and PyPI's torchvision, built against CUDA
torch, does not import under the training env's CPU torch). A video
is frames sampled and resized as the folder's video processor does (its own budget, rate and frame bounds;
data.video_fps / data.max_frames where set) and paired into temporal patches (recipes/vlm/video.py:
Qwen2VLVideoProcessor's / Qwen3VLVideoProcessor's output, made without them); for Qwen2.5-VL
one `<|video_pad|>` stands for its (t*h*w) / merge^2 tokens, for Qwen3-VL each temporal patch is its own
`<t seconds><|vision_start|><|video_pad|><|vision_end|>` (Qwen3VLProcessor's timestamps) whose pad stands for its
(h*w) / merge^2 tokens: QWEN_ARCHS' VideoRule says which.

Packing, language side: the samples' tokens go into rows exactly as LLaVA's do (common/data/packing.py's
PackedBatch: one cu_seqlens structure for the CPU's block-diagonal 4D mask and the GPU's varlen kernel), with
Qwen's 3D mRoPE positions computed per sample by transformers' own `get_rope_index` and laid out by the same
segments. Vision side: the images of all rows, in the order of their pads in the row-major flattened batch,
go to the tower as one patch sequence with their grids; the tower's own per-image cu_seqlens keep its attention
(full and windowed) within each image, so no image is padded to another's size. Qwen3-VL's DeepStack features follow
the merged features: transformers adds them at the image tokens of the flattened rows (visual_pos_masks), in the
same row-major order, so a packed sample gets its own images' features in the first language layers too. The videos
go the same way, as the model's forward takes them (pixel_values_videos, video_grid_thw: a second tower call, each
temporal patch its own attention block), and each video's mRoPE time positions follow its second_per_grid_ts
(temporal patch / sampled fps, as Qwen2_5_VLProcessor computes it; Qwen3-VL's get_rope_index ignores it and lays
each temporal patch out as a one-frame grid after its timestamp text).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from common.data.packing import IGNORE_INDEX, PackedBatch, pack_samples, pad_samples
from common.errors import ConfigError
from recipes.vlm.archs import QWEN_ARCHS, qwen_arch
from recipes.vlm.data import IMAGE_TOKEN, batch_counts, read_llava_sample, render_turns, whole_images_cut
from recipes.vlm.schema import check_pixel_budget
from recipes.vlm.video import Video, VideoConfig, read_llava_video, read_video_config, video_patches

IMAGE_PAD = "<|image_pad|>"  # the one token the chat template writes per image; expanded to the image's tokens
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_SLOT = VISION_START + IMAGE_PAD + VISION_END  # an image in Qwen's chat format
VIDEO_PAD = "<|video_pad|>"  # the same for a video
VIDEO_SLOT = VISION_START + VIDEO_PAD + VISION_END
VIDEO_TOKEN = "<video>"  # where a LLaVA-format conversation's video goes (as `<image>` for an image)
# mm_token_type_ids, as transformers' Qwen2.5-VL processor and get_rope_index number the modalities
TEXT, IMAGE, VIDEO = 0, 1, 2

# transformers' Qwen2_5_VLModel / Qwen3VLModel.get_rope_index, bound to a model of the run's config (`rope_index_for`)
RopeIndex = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def rope_index_for(config) -> RopeIndex:
    """transformers' own get_rope_index for a Qwen2.5-VL or Qwen3-VL config, without weights: bound to a meta-device
    Qwen2_5_VLModel / Qwen3VLModel (QWEN_ARCHS' `base`; built in a fraction of a second even at 7B shapes), so the
    loader workers lay out the mRoPE positions while they pack, as the model itself would for each sample. Both take
    (input_ids, mm_token_type_ids, image_grid_thw) and give [3, B, T] positions."""
    import transformers

    with torch.device("meta"):
        return getattr(transformers, QWEN_ARCHS[config.model_type].base)(config).get_rope_index


class QwenProcessing(NamedTuple):
    """A Qwen-VL folder's tokenizer (its chat template), image processor and video processor's values: what the
    trainer holds in place of a LlavaProcessor, and saves into the export as transformers' processor would
    (tokenizer files, chat template, preprocessor_config.json with the run's pixel budget,
    video_preprocessor_config.json with the run's video budget, rate and frame bounds)."""

    tokenizer: object
    image_processor: object
    video: VideoConfig | None  # None: a generation whose videos Kiln does not encode (QWEN_ARCHS' video)

    def save_pretrained(self, folder) -> None:
        self.tokenizer.save_pretrained(folder)
        self.image_processor.save_pretrained(folder)
        if self.video is not None:
            self.video.save(folder)


def load_processing(
    folder,
    image_token_id: int,
    *,
    min_pixels: int = 0,
    max_pixels: int = 0,
    video_fps: float | None = None,
    max_frames: int | None = None,
) -> QwenProcessing:
    """(tokenizer, image processor, video processor's values) of a Qwen-VL folder, offline, with the image pixel
    budget ``min_pixels`` / ``max_pixels`` (data.min_pixels / data.max_pixels; 0 keeps the folder's) in place of the
    folder's, and the video rate and frame cap ``video_fps`` / ``max_frames`` (data.video_fps / data.max_frames;
    None keeps the folder's). One line when the budget is inverted (transformers would resize silently outside it) or
    smaller than one merged patch, when the tokenizer's <|image_pad|> is not the model's ``image_token_id``, and
    when the video processor patches or scales pixels otherwise than the image processor (Kiln patches video frames
    with it)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    arch = qwen_arch(folder)
    check_pixel_budget(min_pixels, max_pixels, arch.unit)
    budget = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v}
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    image_processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True, **budget)
    low, high = image_processor.size["shortest_edge"], image_processor.size["longest_edge"]
    if low > high:  # one given, the folder's other one on the wrong side of it
        raise ConfigError(f"the pixel budget {low}..{high} is inverted (data.min_pixels / data.max_pixels)")
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    if pad != image_token_id:
        raise ConfigError(
            f"{folder}: the tokenizer's {IMAGE_PAD} is id {pad}, the model's image_token_id is {image_token_id}"
        )
    if arch.video is None:  # a generation whose videos Kiln does not encode (its runs refuse video data)
        return QwenProcessing(tokenizer, image_processor, None)
    video = read_video_config(folder, arch.video, fps=video_fps, max_frames=max_frames)
    for key in ("patch_size", "temporal_patch_size", "merge_size", "do_rescale", "rescale_factor", "do_normalize"):
        if video.settings[key] != getattr(image_processor, key):
            raise ConfigError(
                f"{folder}: its video processor's {key} is {video.settings[key]}, its image processor's "
                f"{getattr(image_processor, key)}: Kiln patches video frames with the image processor"
            )
    return QwenProcessing(tokenizer, image_processor, video)


def load_qwen(folder, attention: str):
    """A Qwen2_5_VLForConditionalGeneration / Qwen3VLForConditionalGeneration folder (QWEN_ARCHS' `model`), in fp32
    (its own config: the recipe's `model.*` are read from it). The language model takes `toggles.attention`'s kernel;
    the tower runs SDPA (eager under eager) over its per-image cu_seqlens."""
    import transformers

    from recipes.vlm.attention import attn_implementation, register_varlen_attention
    from recipes.vlm.llava import quiet_loading

    if attention == "flash":
        register_varlen_attention()
    with quiet_loading():
        return getattr(transformers, qwen_arch(folder).model).from_pretrained(
            folder, dtype=torch.float32, local_files_only=True, attn_implementation=attn_implementation(attention)
        )


def image_tokens(image_grid_thw: torch.Tensor, merge_size: int) -> list[int]:
    """Language-model tokens per image: its (t, h, w) patch grid over the merger's merge x merge units."""
    return (image_grid_thw.prod(-1) // merge_size**2).tolist()


def image_pad_repeats(
    input_ids: torch.Tensor, image_pad_id: int, counts: Sequence[int], kind: str = "image"
) -> torch.Tensor:
    """[T] repeat counts that expand one `<|image_pad|>` per image into image i's counts[i] tokens
    (``input_ids.repeat_interleave(repeats)``; the same for aligned labels). This is what Qwen2_5_VLProcessor does
    to the text before tokenizing; the pad is a special token, so expanding ids instead gives the same tokens.
    ``kind="video"``: the same for `<|video_pad|>` and videos. ValueError (one line) when the pads and the images
    (videos) disagree in number."""
    ids = input_ids.reshape(-1)
    at = torch.nonzero(ids == image_pad_id).flatten()
    if at.numel() != len(counts):
        placeholder = VIDEO_TOKEN if kind == "video" else IMAGE_TOKEN
        raise ValueError(
            f"the conversation has {at.numel()} {kind} placeholder(s) but {len(counts)} {kind}(s); "
            f"each {kind} needs exactly one {placeholder} where it goes"
        )
    repeats = torch.ones_like(ids)
    repeats[at] = torch.as_tensor(list(counts), dtype=ids.dtype)
    return repeats


def modality_types(input_ids: torch.Tensor, image_pad_id: int, video_pad_id: int) -> torch.Tensor:
    """mm_token_type_ids for `input_ids`: 0 text, 1 image, 2 video (the processor's output, get_rope_index's input)."""
    types = torch.full_like(input_ids, TEXT, dtype=torch.int32)
    types[input_ids == image_pad_id] = IMAGE
    types[input_ids == video_pad_id] = VIDEO
    return types


def sample_positions(
    rope_index: RopeIndex,
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    image_pad_id: int,
    video_pad_id: int,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
) -> torch.Tensor:
    """[3, T] mRoPE positions (temporal, height, width) of one sample, from transformers' get_rope_index on it
    alone: text advances all three by one, an image's tokens share a start and spread over its merged grid, a
    video's also over time (its temporal patches tokens_per_second x second_per_grid_ts apart)."""
    ids = input_ids.reshape(1, -1)
    videos = _present(video_grid_thw)
    positions, _ = rope_index(
        ids,
        mm_token_type_ids=modality_types(ids, image_pad_id, video_pad_id),
        image_grid_thw=_present(image_grid_thw),
        video_grid_thw=videos,
        second_per_grid_ts=second_per_grid_ts if videos is not None else None,
    )
    return positions[:, 0]


def _present(grid: torch.Tensor | None) -> torch.Tensor | None:
    return grid if grid is not None and grid.numel() else None


@dataclass
class QwenPackedBatch:
    """A packed (or padded) Qwen2.5-VL micro-batch: the language rows and their segments (``packed``: the same
    PackedBatch, cu_seqlens and 4D mask as LLaVA's), the rows' mRoPE positions, and every image of the batch as one
    patch sequence for the tower, in the order of their pads in the row-major flattened rows."""

    packed: PackedBatch
    position_ids: torch.Tensor  # [3, R, L] long: each sample's get_rope_index positions in its slots; 0 on padding
    pixel_values: torch.Tensor | None  # [patches, 3*2*p*p] float32 (p: 14 or 16 px): all images' patches, concatenated
    image_grid_thw: torch.Tensor | None  # [images, 3] long
    pixel_values_videos: torch.Tensor | None = None  # [patches, 3*2*14*14] float32: all videos' patches
    video_grid_thw: torch.Tensor | None = None  # [videos, 3] long

    def model_inputs(self, attention: str, device: torch.device | str | None = None) -> dict:
        """Keyword arguments for the Qwen-VL model's forward under ``toggles.attention``.

        ``sdpa``/``eager``: the rows with the block-diagonal 4D mask and [3, R, L] positions. ``flash``: one
        flattened row with cu_seq_lens, and positions as transformers' packed layout [4, 1, R*L] (per-sample text
        positions first, then the three mRoPE rows), which the Qwen2.5-VL and Qwen3-VL text models split off."""
        inputs = self.packed.model_inputs(attention)
        if attention == "flash":
            text = self.packed.position_ids.reshape(1, 1, -1)
            inputs["position_ids"] = torch.cat([text, self.position_ids.reshape(3, 1, -1)])
        else:
            inputs["position_ids"] = self.position_ids
        if self.pixel_values is not None:
            inputs["pixel_values"] = self.pixel_values
            inputs["image_grid_thw"] = self.image_grid_thw
        if self.pixel_values_videos is not None:
            inputs["pixel_values_videos"] = self.pixel_values_videos
            inputs["video_grid_thw"] = self.video_grid_thw
        if device is not None:
            inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        return inputs


def pack_qwen(
    samples: list[dict],
    rope_index: RopeIndex,
    *,
    max_seq_len: int,
    pad_id: int,
    image_pad_id: int,
    video_pad_id: int,
    packing: bool = True,
    fit_rows: bool = True,
) -> QwenPackedBatch:
    """Samples (``input_ids``, ``labels`` [T] with the pads expanded; ``pixel_values`` [patches, D] and
    ``image_grid_thw`` [images, 3], both absent or empty for a text-only sample; the same for videos:
    ``pixel_values_videos``, ``video_grid_thw`` and ``second_per_grid_ts`` [videos]) -> one micro-batch.

    The rows and segments are `pack_samples`' (packing) or `pad_samples`' (one sample per row); each sample's
    positions are get_rope_index's on that sample alone, so a packed sample sees the positions, the mask and the
    image features it would see on its own."""
    packed = pack_samples(samples, max_seq_len, pad_id, fit_rows=fit_rows) if packing else pad_samples(samples, pad_id)
    position_ids = torch.zeros((3, *packed.input_ids.shape), dtype=torch.long)
    order = iter(packed.order)
    for r, lens in enumerate(packed.seq_lens):
        start = 0
        for n in lens:
            s = samples[next(order)]
            position_ids[:, r, start : start + n] = sample_positions(
                rope_index,
                torch.as_tensor(s["input_ids"]),
                s.get("image_grid_thw"),
                image_pad_id,
                video_pad_id,
                s.get("video_grid_thw"),
                s.get("second_per_grid_ts"),
            )
            start += n
    with_images = [samples[i] for i in packed.order if _num_images(samples[i])]
    with_videos = [samples[i] for i in packed.order if _num_videos(samples[i])]
    return QwenPackedBatch(
        packed=packed,
        position_ids=position_ids,
        pixel_values=torch.cat([s["pixel_values"] for s in with_images]).float() if with_images else None,
        image_grid_thw=torch.cat([s["image_grid_thw"] for s in with_images]) if with_images else None,
        pixel_values_videos=torch.cat([s["pixel_values_videos"] for s in with_videos]).float() if with_videos else None,
        video_grid_thw=torch.cat([s["video_grid_thw"] for s in with_videos]) if with_videos else None,
    )


def _num_images(sample: dict) -> int:
    grid = sample.get("image_grid_thw")
    return 0 if grid is None else int(grid.shape[0])


def _num_videos(sample: dict) -> int:
    grid = sample.get("video_grid_thw")
    return 0 if grid is None else int(grid.shape[0])


def _num_visuals(sample: dict) -> int:
    return _num_images(sample) + _num_videos(sample)


class ImageTokensExceed(ValueError):
    """A sample whose image tokens alone do not fit in data.max_seq_len: skipped and counted, never cut mid-image."""


def encode_qwen(
    messages: list[dict],
    images: list,
    tokenizer,
    image_processor,
    *,
    videos: Sequence[Video] = (),
    max_seq_len: int | None = None,
    video_config: VideoConfig | None = None,
) -> dict:
    """A LLaVA-format conversation -> one Qwen2.5-VL / Qwen3-VL training sequence at native resolution.

    ``messages``: [{"role", "content": str}] with `<image>` where each image goes and `<video>` where each video
    goes, ``images`` in that order (PIL), ``videos`` too (recipes/vlm/video.py: sampled frames and their rate,
    patched as ``video_config`` says: the folder's video processor's values, needed with videos). Each `<image>`
    becomes Qwen's <|vision_start|><|image_pad|><|vision_end|> (as Qwen's own fine-tuning code writes it), each
    `<video>` the same with <|video_pad|> (``video_config.rule.timestamps``, Qwen3-VL: inside it, per temporal
    patch, its `<t seconds>` and its own <|vision_start|><|video_pad|><|vision_end|>: `video_slot`), the chat
    template renders the conversation (`render_turns`: labels on the assistant turns, their end of turn included;
    prompts, system text and image and video tokens -100), the image processor resizes each image within its
    min_pixels..max_pixels (each video's frames: within the video budget, recipes/vlm/video.py) and patches it, and
    each pad becomes its image's (video's) tokens.

    Over ``max_seq_len`` tokens the sequence is cut there, never inside an image or a video (it is dropped with
    the ones after it: ``truncated``); a sample whose image and video tokens alone exceed it raises
    ImageTokensExceed. Returns ``input_ids``, ``labels`` [T] long, ``pixel_values`` [patches, 3*2*p*p] float32
    and ``image_grid_thw`` [images, 3] long (both empty without images), ``pixel_values_videos``,
    ``video_grid_thw`` and ``second_per_grid_ts`` [videos] float32 (Qwen2_5_VLProcessor's temporal patch / fps;
    all empty without videos), ``truncated``.
    """
    image_pad_id, video_pad_id = tokenizer.convert_tokens_to_ids([IMAGE_PAD, VIDEO_PAD])
    video_values, video_grid = _videos_patched(videos, image_processor, video_config)
    T = image_processor.temporal_patch_size
    slots = [video_slot(v.times, video_config) for v in videos]
    text, spans = render_turns(qwen_messages(messages, slots), tokenizer)
    ids, labels = _ids_and_labels(text, spans, tokenizer, (image_pad_id, video_pad_id))
    pixel_values, grid = _images_patched(images, image_processor)
    seconds = torch.tensor([T / v.fps for v in videos], dtype=torch.float32)
    counts = image_tokens(grid, image_processor.merge_size)
    video_counts = image_tokens(video_grid, image_processor.merge_size)
    # A video's pads: one, or one per temporal patch (timestamps), each its share of the video's tokens.
    groups = [int(g[0]) if video_config.rule.timestamps else 1 for g in video_grid]
    pad_counts = [c // n for c, n in zip(video_counts, groups, strict=True) for _ in range(n)]
    repeats = image_pad_repeats(ids, image_pad_id, counts) * image_pad_repeats(
        ids, video_pad_id, pad_counts, kind="video"
    )
    kinds = _visual_kinds(ids, image_pad_id, video_pad_id, groups)
    ids, labels = ids.repeat_interleave(repeats), labels.repeat_interleave(repeats)
    truncated = max_seq_len is not None and len(ids) > max_seq_len
    if truncated:
        if sum(counts) + sum(video_counts) > max_seq_len:
            what = f"{len(counts)} image(s)" + (f" and {len(video_counts)} video(s)" if videos else "")
            raise ImageTokensExceed(
                f"its {what} take {sum(counts) + sum(video_counts)} tokens, more than data.max_seq_len {max_seq_len}"
            )
        cut, whole = max_seq_len, 0
        if kinds:
            sizes = iter(counts), iter(video_counts)
            in_order = [next(sizes[k]) for k in kinds]
            vision = ((ids == image_pad_id) | (ids == video_pad_id)).numpy()
            cut, whole = whole_images_cut(vision, True, in_order, max_seq_len)
        n_images, n_videos = kinds[:whole].count(0), kinds[:whole].count(1)
        ids, labels = ids[:cut], labels[:cut]
        pixel_values = pixel_values[: int(grid[:n_images].prod(-1).sum())] if n_images else torch.zeros(0)
        grid = grid[:n_images]
        video_values = video_values[: int(video_grid[:n_videos].prod(-1).sum())] if n_videos else torch.zeros(0)
        video_grid, seconds = video_grid[:n_videos], seconds[:n_videos]
    return {
        "input_ids": ids,
        "labels": labels,
        "pixel_values": pixel_values,
        "image_grid_thw": grid,
        "pixel_values_videos": video_values,
        "video_grid_thw": video_grid,
        "second_per_grid_ts": seconds,
        "truncated": truncated,
    }


def _videos_patched(videos: Sequence[Video], image_processor, video_config) -> tuple[torch.Tensor, torch.Tensor]:
    """The videos' patches, concatenated, and their grids [videos, 3] (both empty without videos)."""
    per_video = [video_patches(v.frames, image_processor, video_config) for v in videos]
    video_values = torch.cat([p for p, _ in per_video]) if videos else torch.zeros(0)
    video_grid = torch.cat([g for _, g in per_video]) if videos else torch.zeros((0, 3), dtype=torch.long)
    return video_values, video_grid


def _ids_and_labels(text: str, spans, tokenizer, pad_ids: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rendered text's token ids and labels: a token overlapping a labelled span is its own label unless it is
    an image or video pad; every other token -100."""
    image_pad_id, video_pad_id = pad_ids
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.long)
    offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long).reshape(-1, 2)
    is_label = torch.zeros(len(ids), dtype=torch.bool)
    for a, b in spans:
        is_label |= (offsets[:, 0] < b) & (offsets[:, 1] > a)
    labels = torch.where(is_label & (ids != image_pad_id) & (ids != video_pad_id), ids, IGNORE_INDEX)
    return ids, labels


def _images_patched(images: list, image_processor) -> tuple[torch.Tensor, torch.Tensor]:
    """The images' patches [patches, 3*2*p*p] float32 and grids [images, 3] long (both empty without images)."""
    if images:
        vision = image_processor(images=images, return_tensors="pt")
        return vision["pixel_values"].float(), vision["image_grid_thw"].long()
    return torch.zeros(0), torch.zeros((0, 3), dtype=torch.long)


def _visual_kinds(ids: torch.Tensor, image_pad_id: int, video_pad_id: int, groups: list[int]) -> list[int]:
    """Images (0) and videos (1) in the order of their pads (a video's ``groups`` pads counted once): what a cut
    keeps whole is a prefix."""
    kinds, pads, frames_left = [], (ids == image_pad_id) | (ids == video_pad_id), iter(groups)
    at = torch.nonzero(pads).flatten().tolist()
    while at:
        k = int(ids[at[0]] == video_pad_id)
        kinds.append(k)
        at = at[next(frames_left) if k else 1 :]
    return kinds


def qwen_messages(messages: list[dict], video_slots: Sequence[str] = ()) -> list[dict]:
    """LLaVA-format messages in Qwen's chat format: each `<image>` its IMAGE_SLOT, the i-th `<video>` (in the order
    of the text) ``video_slots[i]``. ValueError (one line) when the `<video>`s and the slots disagree in number."""
    n = sum(m["content"].count(VIDEO_TOKEN) for m in messages)
    if n != len(video_slots):
        raise ValueError(
            f"the conversation has {n} video placeholder(s) but {len(video_slots)} video(s); "
            f"each video needs exactly one {VIDEO_TOKEN} where it goes"
        )
    slots, out = iter(video_slots), []
    for m in messages:
        parts = m["content"].replace(IMAGE_TOKEN, IMAGE_SLOT).split(VIDEO_TOKEN)
        out.append({**m, "content": parts[0] + "".join(next(slots) + p for p in parts[1:])})
    return out


def video_slot(times: Sequence[float], video: VideoConfig) -> str:
    """A video's text in Qwen's chat format, its frames kept at ``times`` (seconds): VIDEO_SLOT; with
    ``video.rule.timestamps`` (Qwen3-VL) its temporal patches inside it, each `<t seconds>` (the mean of its first
    and last frame's time, an odd count's last frame repeated, one decimal) then
    <|vision_start|><|video_pad|><|vision_end|>: Qwen3VLProcessor.replace_video_token's text, one pad per temporal
    patch (expanded to its h*w/merge^2 tokens)."""
    if not video.rule.timestamps:
        return VIDEO_SLOT
    temporal_patch = video.temporal_patch
    times = [*times, *[times[-1]] * (-len(times) % temporal_patch)]
    stamps = [(times[i] + times[i + temporal_patch - 1]) / 2 for i in range(0, len(times), temporal_patch)]
    return VISION_START + "".join(f"<{t:.1f} seconds>" + VIDEO_SLOT for t in stamps) + VISION_END


def encode_llava_qwen(
    sample: dict,
    tokenizer,
    image_processor,
    max_seq_len: int | None = None,
    *,
    video_config: VideoConfig,
) -> dict:
    """Raw prepare_llava sample (any number of images, a video or none) -> one Qwen-VL training sequence
    (`encode_qwen`; the video's frames sampled as ``video_config`` says) with its ``key``; a sample
    whose image and video tokens alone exceed ``max_seq_len`` -> ``{"skipped": reason, "key"}``, which
    `collate_qwen` drops and counts (the loader's decode failures are corrupt data; this one is a budget)."""
    record, images = read_llava_sample(sample)
    video = read_llava_video(sample, video_config)
    try:
        enc = encode_qwen(
            record["messages"],
            images,
            tokenizer,
            image_processor,
            videos=[video] if video is not None else [],
            max_seq_len=max_seq_len,
            video_config=video_config,
        )
    except ImageTokensExceed as exc:
        return {"skipped": str(exc), "key": record["id"]}
    return {**enc, "key": record["id"]}


def blank_qwen_sample(
    image_processor, image_pad_id: int, video_pad_id: int | None = None, video: VideoConfig | None = None
) -> dict:
    """The smallest image the processor makes (a black min_pixels image) as its pads alone, no label: the stand-in
    `collate_qwen` adds to a micro-batch without images, so the tower and merger run in every step on every rank
    (ZeRO-3 gathers their weights collectively; see recipes/vlm/data.py's `collate`). With ``video_pad_id``: the
    smallest video instead (one temporal patch of two black min_pixels frames, patched as ``video`` says), the
    stand-in for a micro-batch without videos when the data has videos (the model's forward runs the tower once for
    images, once for videos: every rank must make both calls in every step)."""
    from PIL import Image

    side = int(image_processor.size["shortest_edge"] ** 0.5)
    black = Image.new("RGB", (side, side))
    if video_pad_id is not None:
        pixel_values, grid = video_patches(np.stack([np.asarray(black)] * 2), image_processor, video)
        ids = torch.full((image_tokens(grid, image_processor.merge_size)[0],), video_pad_id, dtype=torch.long)
        return {
            "input_ids": ids,
            "labels": torch.full_like(ids, IGNORE_INDEX),
            "pixel_values_videos": pixel_values,
            "video_grid_thw": grid,
            "second_per_grid_ts": torch.ones(1),
        }
    vision = image_processor(images=[black], return_tensors="pt")
    grid = vision["image_grid_thw"].long()
    ids = torch.full((image_tokens(grid, image_processor.merge_size)[0],), image_pad_id, dtype=torch.long)
    return {
        "input_ids": ids,
        "labels": torch.full_like(ids, IGNORE_INDEX),
        "pixel_values": vision["pixel_values"].float(),
        "image_grid_thw": grid,
    }


def collate_qwen(
    samples: list[dict],
    *,
    rope_index: RopeIndex,
    packing: bool,
    max_seq_len: int,
    pad_id: int,
    image_pad_id: int,
    video_pad_id: int,
    blank: dict | None = None,
    blank_video: dict | None = None,
) -> dict:
    """This rank's Qwen2.5-VL micro-batch (`pack_qwen`, run in the loader workers) and its accounting: LLaVA's
    (`batch_counts`: text-only means no image and no video) plus ``skipped``, the samples whose image and video
    tokens did not fit in ``max_seq_len``. A micro-batch without images gets ``blank``, one without videos
    ``blank_video`` (both unlabelled: the loss and the other samples' logits are unchanged)."""
    real = [s for s in samples if "skipped" not in s]
    packable = real if blank is None or any(_num_images(s) for s in real) else [*real, blank]
    if blank_video is not None and not any(_num_videos(s) for s in real):
        packable = [*packable, blank_video]
    batch = pack_qwen(
        packable,
        rope_index,
        max_seq_len=max_seq_len,
        pad_id=pad_id,
        image_pad_id=image_pad_id,
        video_pad_id=video_pad_id,
        packing=packing,
    )
    return {
        "batch": batch,
        **batch_counts(real, batch.packed, _num_visuals),
        "videos": sum(bool(_num_videos(s)) for s in real),
        "skipped": len(samples) - len(real),
    }
