"""Videos for a native-resolution VLM (Qwen2.5-VL, Qwen3-VL): frames sampled at data.video_fps within
data.max_frames, then patched as transformers' Qwen2VLVideoProcessor / Qwen3VLVideoProcessor patch them, without
them (they need torchvision, which does not import under the training env's CPU torch: PITFALLS.md). What differs
between the two is recipes/vlm/archs.py's VideoRule; the code path is one.

A video is a container file (decoded with PyAV, as transformers' own `read_video_pyav` does: the stream's frame
count and average rate, then only the sampled frames kept) or a list of frame image files. Sampling is the video
processor's sample_frames: Qwen2.5-VL's ``duration x fps`` frames, at least ``MIN_FRAMES``, at most ``max_frames``
and the video's own, floored to a multiple of the temporal patch (2), uniformly spaced; Qwen3-VL's the same count
unfloored, at np.linspace(0, total - 1, n) rounded. Frame files are a video already sampled at data.video_fps unless
the record says at what rate they were taken (``video_fps``), in which case they are sampled like a container's
frames. The frames are resized to one size: Qwen2.5-VL's by the image processor's own smart_resize within the pixel
budget per frame, Qwen3-VL's by its video processor's smart_resize within the budget over all the clip's frames;
consecutive pairs become one temporal patch, an odd count padded by repeating the last frame (the processors'
patchify). Each kept frame's time (its index over the source rate) is kept for Qwen3-VL's `<t seconds>` texts.
"""

from __future__ import annotations

import io
import math
from typing import NamedTuple

import numpy as np
import torch

from recipes.vlm.archs import QWEN2_VIDEO, VideoRule

MIN_FRAMES = 4  # Qwen2VLVideoProcessor.min_frames (and qwen-vl-utils' FPS_MIN_FRAMES)


class Video(NamedTuple):
    """Sampled frames [N, H, W, 3] uint8 RGB, the rate they were sampled at (frames per second of video time), and
    each one's time in the video in seconds (its frame index over the source rate, as transformers' VideoMetadata
    gives Qwen3VLProcessor its timestamps)."""

    frames: np.ndarray
    fps: float
    times: tuple[float, ...]


def sample_frame_indices(
    total: int, source_fps: float, fps: float, max_frames: int, temporal_patch: int = 2, rule: VideoRule = QWEN2_VIDEO
):
    """Indices of the frames a video of ``total`` frames at ``source_fps`` keeps at ``fps`` within ``max_frames``:
    Qwen2VLVideoProcessor.sample_frames (do_sample_frames, fps given) or, ``rule.linspace``,
    Qwen3VLVideoProcessor.sample_frames, number for number. A video shorter than one temporal patch keeps its frames
    (transformers would ask for zero frames and fail); patching pads them."""
    if rule.linspace and total >= temporal_patch:
        n = min(max(int(total / source_fps * fps), MIN_FRAMES), max_frames, total)
        return torch.from_numpy(np.linspace(0, total - 1, n).round().astype(np.int64))
    if total < temporal_patch:
        return torch.arange(total).int()
    cap = math.floor(min(max_frames, total) / temporal_patch) * temporal_patch
    n = min(max(total / source_fps * fps, MIN_FRAMES), cap, total)
    n = math.floor(n / temporal_patch) * temporal_patch
    return torch.arange(0, total, total / n).int()  # torch's float arange, as transformers computes it


def _sampled(total: int, indices) -> float:
    return len(indices) / total  # the share of frames kept: times the source rate, the sampled rate


def _kept(indices, rate: float) -> tuple[float, ...]:
    return tuple(i / rate for i in indices.tolist())  # the frames' times, as VideoMetadata.timestamps computes them


def container_info(data: bytes) -> tuple[int, float, int, int]:
    """A video container's (frames, frames per second, height, width) from its stream's metadata (PyAV), no frame
    decoded. ValueError when it holds no video stream or no frame count and rate."""
    import av

    with av.open(io.BytesIO(data)) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.guessed_rate or 0)
        total, height, width = stream.frames, stream.codec_context.height, stream.codec_context.width
    if not total:  # containers that keep no frame count (WebM, MKV): count the packets
        with av.open(io.BytesIO(data)) as container:
            total = sum(1 for p in container.demux(video=0) if p.size)
    if not total or not rate:
        raise ValueError(f"{total} frames at {rate} frames per second")
    return total, rate, height, width


def decode_video(
    data: bytes, fps: float, max_frames: int, temporal_patch: int = 2, rule: VideoRule = QWEN2_VIDEO
) -> Video:
    """A video container's sampled frames (PyAV). ValueError when it holds no video stream or fewer frames than
    it says."""
    import av

    total, rate, _, _ = container_info(data)
    indices = sample_frame_indices(total, rate, fps, max_frames, temporal_patch, rule)
    keep, last, frames = set(indices.tolist()), int(indices[-1]), []
    with av.open(io.BytesIO(data)) as container:
        for i, frame in enumerate(container.decode(video=0)):
            if i in keep:
                frames.append(frame.to_ndarray(format="rgb24"))
            if i >= last:
                break
    if len(frames) != len(keep):
        raise ValueError(f"decoded {len(frames)} of the {len(keep)} sampled frames")
    return Video(np.stack(frames), rate * _sampled(total, indices), _kept(indices, rate))


def frames_video(
    frames: list,
    fps: float,
    max_frames: int,
    temporal_patch: int = 2,
    *,
    source_fps: float | None = None,
    rule: VideoRule = QWEN2_VIDEO,
) -> Video:
    """A video given as its frames (PIL images or [H, W, 3] arrays). Without ``source_fps`` they are a video sampled
    at ``fps`` already: all are kept (Qwen2VLVideoProcessor without do_sample_frames) unless there are more than
    ``max_frames``; with it they are sampled as a container's frames. ValueError when they differ in size."""
    arrays = [np.asarray(f.convert("RGB") if hasattr(f, "convert") else f, dtype=np.uint8) for f in frames]
    if len({a.shape for a in arrays}) > 1:
        raise ValueError(f"its frames differ in size: {sorted({a.shape[:2] for a in arrays})}")
    rate = source_fps or fps
    if source_fps is None and len(arrays) <= max_frames:
        return Video(np.stack(arrays), fps, _kept(torch.arange(len(arrays)), fps))
    indices = sample_frame_indices(len(arrays), rate, fps, max_frames, temporal_patch, rule)
    frames = np.stack([arrays[i] for i in indices.tolist()])
    return Video(frames, rate * _sampled(len(arrays), indices), _kept(indices, rate))


def frame_size(n: int, height: int, width: int, image_processor, rule: VideoRule = QWEN2_VIDEO) -> tuple[int, int]:
    """(height, width) px every frame of ``n`` sampled [height x width] frames is resized to: the image processor's
    smart_resize of one frame within its budget, or (``rule.clip_budget``) Qwen3VLVideoProcessor's smart_resize of
    the clip within the same budget over its n frames."""
    factor, size = image_processor.patch_size * image_processor.merge_size, image_processor.size
    low, high = size["shortest_edge"], size["longest_edge"]
    if rule.clip_budget:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        T = image_processor.temporal_patch_size
        # transformers refuses a clip under one temporal patch; patching pads it to one, so size it as one
        return smart_resize(max(n, T), height, width, T, factor, min_pixels=low, max_pixels=high)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize(height, width, factor=factor, min_pixels=low, max_pixels=high)


def video_grid(n: int, height: int, width: int, image_processor, rule: VideoRule = QWEN2_VIDEO) -> list[int]:
    """video_grid_thw [t, h, w] of ``n`` sampled [height x width] frames, from their count and size alone (no
    pixel: what the loader's plan measures)."""
    h, w = frame_size(n, height, width, image_processor, rule)
    T, P = image_processor.temporal_patch_size, image_processor.patch_size
    return [-(-n // T), h // P, w // P]


def video_patches(
    frames: np.ndarray, image_processor, rule: VideoRule = QWEN2_VIDEO
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, H, W, 3] frames -> (pixel_values_videos [t*h*w, 3*T*p*p], video_grid_thw [1, 3]) as
    Qwen2VLVideoProcessor / Qwen3VLVideoProcessor make them: each frame resized to `frame_size` and normalized by
    the image processor, an odd count padded with the last frame, frames 2i and 2i+1 one temporal patch. The image
    processor patches each frame as a still image (the frame repeated over the temporal patch); taking one copy per
    frame and pairing consecutive frames gives the video processor's layout. A clip-wide budget's size is not the
    image processor's own per-frame choice: the frames are resized to it first (PIL, with the image processor's
    resample, as its own resize does) and the image processor only rescales, normalizes and patches them."""
    from PIL import Image

    T, P = image_processor.temporal_patch_size, image_processor.patch_size
    frames = list(frames)
    resize = {}
    if rule.clip_budget:
        height, width = frames[0].shape[:2]
        h, w = frame_size(len(frames), height, width, image_processor, rule)
        if (h, w) != (height, width):
            resample = Image.Resampling(image_processor.resample)  # the image processor's own PIL resize
            frames = [np.asarray(Image.fromarray(f).resize((w, h), resample)) for f in frames]
        resize = {"do_resize": False}
    frames += [frames[-1]] * (-len(frames) % T)
    out = image_processor(images=frames, return_tensors="pt", **resize)
    _, gh, gw = out["image_grid_thw"][0].tolist()
    t, hw = len(frames) // T, gh * gw
    patches = out["pixel_values"].float().reshape(len(frames), hw, 3, T, P, P)[:, :, :, 0]  # [frames, hw, C, P, P]
    patches = patches.reshape(t, T, hw, 3, P, P).permute(0, 2, 3, 1, 4, 5)  # [t, hw, C, T, P, P]
    return patches.reshape(t * hw, 3 * T * P * P), torch.tensor([[t, gh, gw]], dtype=torch.long)


def read_llava_video(
    sample: dict, fps: float, max_frames: int, temporal_patch: int = 2, rule: VideoRule = QWEN2_VIDEO
) -> Video | None:
    """The video of a raw prepare_llava sample, sampled, or None: its record's ``video`` is
    ``{"container": ext}`` (the file's bytes under ``video``) or ``{"frames": N, "fps": rate or null}`` (the frame
    files' bytes under ``frame0`` .. ``frame{N-1}``)."""
    import json

    from recipes.vlm.data import decode_image

    video = json.loads(sample["json"]).get("video")
    if not video:
        return None
    if "container" in video:
        return decode_video(sample["video"], fps, max_frames, temporal_patch, rule)
    frames = [decode_image(sample[f"frame{i}"]) for i in range(video["frames"])]
    return frames_video(frames, fps, max_frames, temporal_patch, source_fps=video.get("fps"), rule=rule)


def measure_llava_video(
    sample: dict, fps: float, max_frames: int, image_processor, rule: VideoRule = QWEN2_VIDEO
) -> tuple[list[int], tuple[float, ...]] | None:
    """The video_grid_thw and kept frame times `read_llava_video` + `video_patches` will give a raw prepare_llava
    sample's video, without decoding a frame: the count and rate from the container's stream metadata or the
    record, the size from the stream or the first frame file's header (frames of one video share a size). None
    without a video."""
    import json

    from PIL import Image

    video = json.loads(sample["json"]).get("video")
    if not video:
        return None
    T = image_processor.temporal_patch_size
    if "container" in video:
        total, rate, height, width = container_info(sample["video"])
        indices = sample_frame_indices(total, rate, fps, max_frames, T, rule)
    else:
        total, rate = video["frames"], video.get("fps")
        with Image.open(io.BytesIO(sample["frame0"])) as im:
            width, height = im.size
        if rate is None and total <= max_frames:
            indices, rate = torch.arange(total), fps
        else:
            rate = rate or fps
            indices = sample_frame_indices(total, rate, fps, max_frames, T, rule)
    return video_grid(len(indices), height, width, image_processor, rule), _kept(indices, rate)
