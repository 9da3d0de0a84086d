"""Videos for a native-resolution VLM (Qwen2.5-VL): frames sampled at data.video_fps within data.max_frames, then
patched as transformers' Qwen2VLVideoProcessor patches them, without it (it needs torchvision, which does not import
under the training env's CPU torch: PITFALLS.md).

A video is a container file (decoded with PyAV, as transformers' own `read_video_pyav` does: the stream's frame
count and average rate, then only the sampled frames kept) or a list of frame image files. Sampling is
Qwen2VLVideoProcessor.sample_frames' rule: ``duration x fps`` frames, at least ``MIN_FRAMES``, at most
``max_frames`` and the video's own, floored to a multiple of the temporal patch (2), uniformly spaced. Frame files
are a video already sampled at data.video_fps unless the record says at what rate they were taken
(``video_fps``), in which case they are sampled like a container's frames. The frames are resized by the image
processor's own smart_resize within the pixel budget (every frame the same size), and consecutive pairs become one
temporal patch, an odd count padded by repeating the last frame (Qwen2VLVideoProcessor.patchify).
"""

from __future__ import annotations

import io
import math
from typing import NamedTuple

import numpy as np
import torch

MIN_FRAMES = 4  # Qwen2VLVideoProcessor.min_frames (and qwen-vl-utils' FPS_MIN_FRAMES)


class Video(NamedTuple):
    """Sampled frames [N, H, W, 3] uint8 RGB and the rate they were sampled at (frames per second of video time)."""

    frames: np.ndarray
    fps: float


def sample_frame_indices(total: int, source_fps: float, fps: float, max_frames: int, temporal_patch: int = 2):
    """Indices of the frames a video of ``total`` frames at ``source_fps`` keeps at ``fps`` within ``max_frames``:
    Qwen2VLVideoProcessor.sample_frames (do_sample_frames, fps given), number for number. A video shorter than one
    temporal patch keeps its frames (transformers would ask for zero frames and fail); patching pads them."""
    if total < temporal_patch:
        return torch.arange(total).int()
    cap = math.floor(min(max_frames, total) / temporal_patch) * temporal_patch
    n = min(max(total / source_fps * fps, MIN_FRAMES), cap, total)
    n = math.floor(n / temporal_patch) * temporal_patch
    return torch.arange(0, total, total / n).int()  # torch's float arange, as transformers computes it


def _sampled(total: int, indices) -> float:
    return len(indices) / total  # the share of frames kept: times the source rate, the sampled rate


def decode_video(data: bytes, fps: float, max_frames: int, temporal_patch: int = 2) -> Video:
    """A video container's sampled frames (PyAV). ValueError when it holds no video stream or fewer frames than
    it says."""
    import av

    with av.open(io.BytesIO(data)) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.guessed_rate or 0)
        total = stream.frames
    if not total:  # containers that keep no frame count (WebM, MKV): count the packets
        with av.open(io.BytesIO(data)) as container:
            total = sum(1 for p in container.demux(video=0) if p.size)
    if not total or not rate:
        raise ValueError(f"{total} frames at {rate} frames per second")
    indices = sample_frame_indices(total, rate, fps, max_frames, temporal_patch)
    keep, last, frames = set(indices.tolist()), int(indices[-1]), []
    with av.open(io.BytesIO(data)) as container:
        for i, frame in enumerate(container.decode(video=0)):
            if i in keep:
                frames.append(frame.to_ndarray(format="rgb24"))
            if i >= last:
                break
    if len(frames) != len(keep):
        raise ValueError(f"decoded {len(frames)} of the {len(keep)} sampled frames")
    return Video(np.stack(frames), rate * _sampled(total, indices))


def frames_video(
    frames: list, fps: float, max_frames: int, temporal_patch: int = 2, *, source_fps: float | None = None
) -> Video:
    """A video given as its frames (PIL images or [H, W, 3] arrays). Without ``source_fps`` they are a video sampled
    at ``fps`` already: all are kept (Qwen2VLVideoProcessor without do_sample_frames) unless there are more than
    ``max_frames``; with it they are sampled as a container's frames. ValueError when they differ in size."""
    arrays = [np.asarray(f.convert("RGB") if hasattr(f, "convert") else f, dtype=np.uint8) for f in frames]
    if len({a.shape for a in arrays}) > 1:
        raise ValueError(f"its frames differ in size: {sorted({a.shape[:2] for a in arrays})}")
    rate = source_fps or fps
    if source_fps is None and len(arrays) <= max_frames:
        return Video(np.stack(arrays), fps)
    indices = sample_frame_indices(len(arrays), rate, fps, max_frames, temporal_patch)
    return Video(np.stack([arrays[i] for i in indices.tolist()]), rate * _sampled(len(arrays), indices))


def video_patches(frames: np.ndarray, image_processor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, H, W, 3] frames -> (pixel_values_videos [t*h*w, 3*T*14*14], video_grid_thw [1, 3]) as
    Qwen2VLVideoProcessor makes them: each frame resized and normalized by the image processor (the same
    smart_resize within its pixel budget), an odd count padded with the last frame, frames 2i and 2i+1 one temporal
    patch. The image processor patches each frame as a still image (the frame repeated over the temporal patch);
    taking one copy per frame and pairing consecutive frames gives the video processor's layout."""
    T, P = image_processor.temporal_patch_size, image_processor.patch_size
    frames = list(frames)
    frames += [frames[-1]] * (-len(frames) % T)
    out = image_processor(images=frames, return_tensors="pt")
    _, gh, gw = out["image_grid_thw"][0].tolist()
    t, hw = len(frames) // T, gh * gw
    patches = out["pixel_values"].float().reshape(len(frames), hw, 3, T, P, P)[:, :, :, 0]  # [frames, hw, C, P, P]
    patches = patches.reshape(t, T, hw, 3, P, P).permute(0, 2, 3, 1, 4, 5)  # [t, hw, C, T, P, P]
    return patches.reshape(t * hw, 3 * T * P * P), torch.tensor([[t, gh, gw]], dtype=torch.long)


def read_llava_video(sample: dict, fps: float, max_frames: int, temporal_patch: int = 2) -> Video | None:
    """The video of a raw prepare_llava sample, sampled, or None: its record's ``video`` is
    ``{"container": ext}`` (the file's bytes under ``video``) or ``{"frames": N, "fps": rate or null}`` (the frame
    files' bytes under ``frame0`` .. ``frame{N-1}``)."""
    import json

    from recipes.vlm.data import decode_image

    video = json.loads(sample["json"]).get("video")
    if not video:
        return None
    if "container" in video:
        return decode_video(sample["video"], fps, max_frames, temporal_patch)
    frames = [decode_image(sample[f"frame{i}"]) for i in range(video["frames"])]
    return frames_video(frames, fps, max_frames, temporal_patch, source_fps=video.get("fps"))
