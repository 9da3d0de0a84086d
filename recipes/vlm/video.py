"""Videos for a native-resolution VLM (Qwen2.5-VL, Qwen3-VL): frames sampled and patched as transformers'
Qwen2VLVideoProcessor / Qwen3VLVideoProcessor, loaded from the model's folder, sample and patch them, without them
(they need torchvision, and PyPI's torchvision, built against CUDA torch, does not import under the training env's CPU
torch). What differs
between the two is recipes/vlm/archs.py's VideoRule; the code path is one.

The values are the folder's video processor's (`VideoConfig`, read as transformers reads it: processor_config.json's
nested "video_processor", else video_preprocessor_config.json, else preprocessor_config.json, over the class's
defaults): its pixel budget (its own `size`, not the image processor's: a Qwen3-VL release gives videos 4096 ..
25165824 pixels over the clip, images 65536 .. 16777216 each), frame rate, min/max frames and per-frame cap;
data.video_fps / data.max_frames replace the rate and the frame cap where set. The export writes them back as its
video_preprocessor_config.json (`VideoConfig.save`), so transformers and vLLM tokenize its videos as training did.

A video is a container file (decoded with PyAV, as transformers' own `read_video_pyav` does: the stream's frame
count and average rate, then only the sampled frames kept) or a list of frame image files. Sampling is the video
processor's sample_frames: Qwen2.5-VL's ``duration x fps`` frames, at least ``min_frames``, at most ``max_frames``
and the video's own, floored to a multiple of the temporal patch (2), uniformly spaced; Qwen3-VL's the same count
unfloored, at np.linspace(0, total - 1, n) rounded. Frame files are a video already sampled at the run's rate unless
the record says at what rate they were taken (``video_fps``), in which case they are sampled like a container's
frames. The frames are resized to one size: Qwen2.5-VL's by smart_resize within the pixel budget per frame,
Qwen3-VL's by its video processor's smart_resize within the budget over all the clip's frames (either with
cap_pixels_per_frame's bound where the folder turns it on); consecutive pairs become one temporal patch, an odd count
padded by repeating the last frame (the processors' patchify). Each kept frame's time (its index over the source
rate) is kept for Qwen3-VL's `<t seconds>` texts.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from common.errors import ConfigError
from recipes.vlm.archs import VideoRule

VIDEO_CONFIG = "video_preprocessor_config.json"  # transformers' VIDEO_PROCESSOR_NAME
# The rate Qwen2.5-VL's videos are sampled at when its folder names none: Qwen2VLVideoProcessor has no rate of its own
# (it keeps every frame it is given unless asked to sample), and qwen-vl-utils samples at 2 frames per second before it.
QWEN2_FPS = 2.0


class VideoConfig(NamedTuple):
    """The video processor a run encodes its videos with: the folder's (`read_video_config`), data.video_fps /
    data.max_frames in place of its rate and frame cap where set. ``settings``: the same values as a video processor
    config dict (what the export writes back, every key explicit)."""

    rule: VideoRule
    min_pixels: int  # size["shortest_edge"]: per frame (Qwen2.5-VL) or over the clip (Qwen3-VL)
    max_pixels: int  # size["longest_edge"]
    fps: float
    min_frames: int
    max_frames: int
    cap_pixels_per_frame: bool
    max_video_tokens: int
    patch: int
    merge: int
    temporal_patch: int
    resample: int  # PIL's
    mean: tuple[float, ...]
    std: tuple[float, ...]
    settings: dict

    def save(self, folder) -> None:
        """video_preprocessor_config.json with the run's values, as transformers' save_pretrained would write it."""
        (Path(folder) / VIDEO_CONFIG).write_text(json.dumps(self.settings, indent=2, sort_keys=True) + "\n")


def folder_video_settings(folder) -> dict:
    """The dict transformers builds a folder's video processor from (video_processing_utils'
    get_video_processor_dict): processor_config.json's nested "video_processor", else video_preprocessor_config.json,
    else preprocessor_config.json (the image processor's: Qwen2.5-VL releases ship no video config). A Qwen3-VL
    folder without a video config is a corner where transformers builds Qwen2VLVideoProcessor (named after the image
    processor's class): Kiln keeps Qwen3-VL's rules with those values, and its export names Qwen3VLVideoProcessor."""
    folder = Path(folder)
    nested = folder / "processor_config.json"
    if nested.is_file() and "video_processor" in (processor := json.loads(nested.read_text())):
        return processor["video_processor"]
    for name in (VIDEO_CONFIG, "preprocessor_config.json"):
        if (folder / name).is_file():
            return json.loads((folder / name).read_text())
    return {}


def video_config(
    settings: dict, rule: VideoRule, *, fps: float | None = None, max_frames: int | None = None
) -> VideoConfig:
    """A VideoConfig from a video processor config dict (missing keys: the class's defaults, `rule.defaults`) and
    the run's data.video_fps / data.max_frames (None: the dict's). One line for a config that samples a fixed
    number of frames (num_frames; transformers then refuses its own fps), has no pixel budget or does not resize."""
    s = {**rule.defaults, **settings}
    size = dict(s["size"] or {})
    if rule.pixel_keys:  # Qwen2VLVideoProcessor.__init__: min_pixels / max_pixels replace size's edges
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if s.get(key) is not None:
                size[edge] = s[key]
    if not {"shortest_edge", "longest_edge"} <= size.keys():  # transformers' resize refuses it too
        raise ConfigError(f"its video processor's size {size} names no shortest_edge..longest_edge budget")
    if s.get("num_frames") is not None:
        raise ConfigError(
            f"its video processor samples a fixed num_frames={s['num_frames']}; Kiln samples videos by "
            "rate (data.video_fps)"
        )
    if not s["do_resize"]:
        raise ConfigError("its video processor does not resize (do_resize false); Kiln's videos are resized")
    fps = fps if fps is not None else s["fps"] if s["fps"] is not None else QWEN2_FPS
    max_frames = max_frames if max_frames is not None else s["max_frames"]
    written = {k: s[k] for k in rule.defaults} | {
        "video_processor_type": rule.processor,
        "size": {"shortest_edge": size["shortest_edge"], "longest_edge": size["longest_edge"]},
        "fps": fps,
        "max_frames": max_frames,
        # explicit: transformers warns on an unset one, and says its default will change
        "cap_pixels_per_frame": bool(s["cap_pixels_per_frame"]),
        "do_convert_rgb": s.get("do_convert_rgb", True),
    }
    if "processor_class" in s:
        written["processor_class"] = s["processor_class"]
    return VideoConfig(
        rule,
        size["shortest_edge"],
        size["longest_edge"],
        float(fps),
        int(s["min_frames"]),
        int(max_frames),
        bool(s["cap_pixels_per_frame"]),
        int(s["max_video_tokens"]),
        int(s["patch_size"]),
        int(s["merge_size"]),
        int(s["temporal_patch_size"]),
        int(s["resample"]),
        tuple(s["image_mean"]),
        tuple(s["image_std"]),
        written,
    )


def read_video_config(
    folder, rule: VideoRule, *, fps: float | None = None, max_frames: int | None = None
) -> VideoConfig:
    """The VideoConfig of a Qwen-VL folder's video processor (`folder_video_settings`), with the run's
    data.video_fps / data.max_frames where set. One line, naming the folder, for a config Kiln cannot follow."""
    try:
        return video_config(folder_video_settings(folder), rule, fps=fps, max_frames=max_frames)
    except ConfigError as exc:
        raise ConfigError(f"{folder}: {exc}") from None


class Video(NamedTuple):
    """Sampled frames [N, H, W, 3] uint8 RGB, the rate they were sampled at (frames per second of video time), and
    each one's time in the video in seconds (its frame index over the source rate, as transformers' VideoMetadata
    gives Qwen3VLProcessor its timestamps)."""

    frames: np.ndarray
    fps: float
    times: tuple[float, ...]


def sample_frame_indices(total: int, source_fps: float, video: VideoConfig):
    """Indices of the frames a video of ``total`` frames at ``source_fps`` keeps at ``video.fps`` within
    ``video.min_frames`` .. ``video.max_frames``: Qwen2VLVideoProcessor.sample_frames (do_sample_frames, fps given)
    or, ``rule.linspace``, Qwen3VLVideoProcessor.sample_frames, number for number. A video shorter than one temporal
    patch keeps its frames (transformers would ask for zero frames and fail); patching pads them."""
    T = video.temporal_patch
    if video.rule.linspace and total >= T:
        n = min(max(int(total / source_fps * video.fps), video.min_frames), video.max_frames, total)
        return torch.from_numpy(np.linspace(0, total - 1, n).round().astype(np.int64))
    if total < T:
        return torch.arange(total).int()
    cap = math.floor(min(video.max_frames, total) / T) * T
    n = min(max(total / source_fps * video.fps, video.min_frames), cap, total)
    n = math.floor(n / T) * T
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


def decode_video(data: bytes, video: VideoConfig) -> Video:
    """A video container's sampled frames (PyAV). ValueError when it holds no video stream or fewer frames than
    it says."""
    import av

    total, rate, _, _ = container_info(data)
    indices = sample_frame_indices(total, rate, video)
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


def frames_video(frames: list, video: VideoConfig, *, source_fps: float | None = None) -> Video:
    """A video given as its frames (PIL images or [H, W, 3] arrays). Without ``source_fps`` they are a video sampled
    at ``video.fps`` already: all are kept (the video processor without do_sample_frames) unless there are more
    than ``video.max_frames``; with it they are sampled as a container's frames. ValueError when they differ in
    size."""
    arrays = [np.asarray(f.convert("RGB") if hasattr(f, "convert") else f, dtype=np.uint8) for f in frames]
    if len({a.shape for a in arrays}) > 1:
        raise ValueError(f"its frames differ in size: {sorted({a.shape[:2] for a in arrays})}")
    rate = source_fps or video.fps
    if source_fps is None and len(arrays) <= video.max_frames:
        return Video(np.stack(arrays), video.fps, _kept(torch.arange(len(arrays)), video.fps))
    indices = sample_frame_indices(len(arrays), rate, video)
    frames = np.stack([arrays[i] for i in indices.tolist()])
    return Video(frames, rate * _sampled(len(arrays), indices), _kept(indices, rate))


def frame_size(n: int, height: int, width: int, video: VideoConfig) -> tuple[int, int]:
    """(height, width) px every frame of ``n`` sampled [height x width] frames is resized to: smart_resize of one
    frame within the video budget (Qwen2VLVideoProcessor.resize), or (``rule.clip_budget``) Qwen3VLVideoProcessor's
    smart_resize of the clip within the budget over its n frames; with cap_pixels_per_frame each class's own bound on
    the budget first (Qwen2.5-VL: an even share of 90% of max_video_tokens per frame; Qwen3-VL: at most
    max_video_tokens per frame), both floored at 1.05 x the smallest budget."""
    factor, T = video.patch * video.merge, video.temporal_patch
    low, high = video.min_pixels, video.max_pixels
    if video.rule.clip_budget:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        n = max(n, T)  # transformers refuses a clip under one temporal patch; patching pads it to one: size it as one
        if video.cap_pixels_per_frame:
            high = n * max(min(video.max_video_tokens * factor * factor, high // n), int(low * 1.05))
        return smart_resize(n, height, width, T, factor, min_pixels=low, max_pixels=high)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    if video.cap_pixels_per_frame:
        total = int(video.max_video_tokens * factor * factor * 0.9)
        high = max(min(high, total * T // n), int(low * 1.05))
    return smart_resize(height, width, factor=factor, min_pixels=low, max_pixels=high)


def video_grid(n: int, height: int, width: int, video: VideoConfig) -> list[int]:
    """video_grid_thw [t, h, w] of ``n`` sampled [height x width] frames, from their count and size alone (no
    pixel: what the loader's plan measures)."""
    h, w = frame_size(n, height, width, video)
    return [-(-n // video.temporal_patch), h // video.patch, w // video.patch]


def video_patches(frames: np.ndarray, image_processor, video: VideoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, H, W, 3] frames -> (pixel_values_videos [t*h*w, 3*T*p*p], video_grid_thw [1, 3]) as
    Qwen2VLVideoProcessor / Qwen3VLVideoProcessor make them: each frame resized to `frame_size` (PIL, with the video
    processor's resample, as the image processor's own PIL resize does), normalized by the image processor with the
    video processor's mean and std, an odd count padded with the last frame, frames 2i and 2i+1 one temporal patch.
    The image processor patches each frame as a still image (the frame repeated over the temporal patch); taking one
    copy per frame and pairing consecutive frames gives the video processor's layout."""
    from PIL import Image

    T, P = video.temporal_patch, video.patch
    frames = list(frames)
    height, width = frames[0].shape[:2]
    h, w = frame_size(len(frames), height, width, video)
    if (h, w) != (height, width):
        resample = Image.Resampling(video.resample)
        frames = [np.asarray(Image.fromarray(f).resize((w, h), resample)) for f in frames]
    frames += [frames[-1]] * (-len(frames) % T)
    out = image_processor(
        images=frames, return_tensors="pt", do_resize=False, image_mean=list(video.mean), image_std=list(video.std)
    )
    _, gh, gw = out["image_grid_thw"][0].tolist()
    t, hw = len(frames) // T, gh * gw
    patches = out["pixel_values"].float().reshape(len(frames), hw, 3, T, P, P)[:, :, :, 0]  # [frames, hw, C, P, P]
    patches = patches.reshape(t, T, hw, 3, P, P).permute(0, 2, 3, 1, 4, 5)  # [t, hw, C, T, P, P]
    return patches.reshape(t * hw, 3 * T * P * P), torch.tensor([[t, gh, gw]], dtype=torch.long)


def read_llava_video(sample: dict, video: VideoConfig) -> Video | None:
    """The video of a raw prepare_llava sample, sampled, or None: its record's ``video`` is
    ``{"container": ext}`` (the file's bytes under ``video``) or ``{"frames": N, "fps": rate or null}`` (the frame
    files' bytes under ``frame0`` .. ``frame{N-1}``)."""
    from recipes.vlm.data import decode_image

    record = json.loads(sample["json"]).get("video")
    if not record:
        return None
    if "container" in record:
        return decode_video(sample["video"], video)
    frames = [decode_image(sample[f"frame{i}"]) for i in range(record["frames"])]
    return frames_video(frames, video, source_fps=record.get("fps"))


def measure_llava_video(sample: dict, video: VideoConfig) -> tuple[list[int], tuple[float, ...]] | None:
    """The video_grid_thw and kept frame times `read_llava_video` + `video_patches` will give a raw prepare_llava
    sample's video, without decoding a frame: the count and rate from the container's stream metadata or the
    record, the size from the stream or the first frame file's header (frames of one video share a size). None
    without a video."""
    from PIL import Image

    record = json.loads(sample["json"]).get("video")
    if not record:
        return None
    if "container" in record:
        total, rate, height, width = container_info(sample["video"])
        indices = sample_frame_indices(total, rate, video)
    else:
        total, rate = record["frames"], record.get("fps")
        with Image.open(io.BytesIO(sample["frame0"])) as im:
            width, height = im.size
        if rate is None and total <= video.max_frames:
            indices, rate = torch.arange(total), video.fps
        else:
            rate = rate or video.fps
            indices = sample_frame_indices(total, rate, video)
    return video_grid(len(indices), height, width, video), _kept(indices, rate)
