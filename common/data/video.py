"""Video-caption clips as both sides see them: reading a clip's frames (a video file, decoded with PyAV, or a folder of
frame images), the lossless FFV1-in-Matroska encoding a shard stores them in, and the decode of a shard's sample into
what a text-to-video loader trains on. data.prepare_videos writes the shards; the text-to-video family reads them.

A clip is sampled at a frame rate from its start: frame i is the decoded frame whose time is nearest i / fps (the
earlier of two equally near), so a 30 fps source gives the frames a 16 fps camera would have taken, and a clip shorter
than the frames asked (its last frame more than half a frame period before the last wanted time) is `ClipTooShort`.
Each frame is resized to cover the wanted shape and center-cropped to it (common/data/resize.py), never squashed.

FFV1 in bgr0 is lossless for RGB (its encoder takes no gbrp at 8 bits in this build): decoding gives the sampled
frames back bit for bit, so a latent cache sees exactly what was sampled, in less room than raw uint8 frames wherever
neighbouring pixels are alike (random noise does not compress). The Matroska muxer runs bitexact (no random segment
id, no library version), so the same frames give the same bytes.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from common.data.captions import SKIP_REASONS as CAPTION_SKIP_REASONS

SOURCE = "video_captions"  # meta.json "source" of data.prepare_videos' shards
SKIP_REASONS = (*CAPTION_SKIP_REASONS, "too_short")  # meta.json "skipped": {reason: file names}
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mkv", ".mov", ".avi")
FRAME_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")
FPS_FILE = "fps.txt"  # in a frame folder: the rate its frames were taken at (else the rate asked for)
TEMPORAL_STRIDE = 4  # the video VAE keeps the first frame and compresses the rest 4x in time: 4k+1 frames

# (height, width) wanted, or a function of the source's (height, width) giving it (aspect-ratio buckets)
Size = tuple[int, int] | Callable[[int, int], tuple[int, int]]


class ClipTooShort(ValueError):
    """A clip that ends before the last frame asked for (data.prepare_videos counts it as ``too_short``)."""


def check_num_frames(num_frames: int) -> None:
    """ValueError unless num_frames is 4k+1 (1, 5, 9, ..., 81)."""
    if num_frames < 1 or (num_frames - 1) % TEMPORAL_STRIDE:
        raise ValueError(
            f"--num-frames {num_frames} is not 4k+1 (e.g. 9, 17, 33, 81): the video VAE keeps the first frame and "
            "compresses the others 4x in time"
        )


def sample_times(num_frames: int, fps: float) -> list[float]:
    """The wanted frames' times in seconds from the clip's start: i / fps."""
    return [i / fps for i in range(num_frames)]


def pick_nearest(
    frames: Iterable[tuple[float, Any]], times: list[float], period: float, take: Callable[[Any], Any] = lambda f: f
) -> list:
    """For each wanted time, ``take(frame)`` of the frame whose time is nearest (the earlier of two equally near).
    `frames` yields (time, frame) in time order and is read only up to the first frame past the last wanted time;
    `take` runs once per distinct frame picked, while that frame is the current or the previous one (a decoder's
    frame can be converted before the next is decoded). ClipTooShort when the frames end more than half a `period`
    (one source frame) before a wanted time."""
    picked: list = []
    taken: dict[int, Any] = {}
    prev = current = None  # (index, time, frame)

    def pick(item) -> None:
        if item[0] not in taken:
            taken[item[0]] = take(item[2])
        picked.append(taken[item[0]])

    for n, (t, frame) in enumerate(frames):
        prev, current = current, (n, t, frame)
        while len(picked) < len(times) and times[len(picked)] <= t:
            want = times[len(picked)]
            pick(prev if prev is not None and want - prev[1] <= t - want else current)
        if len(picked) == len(times):
            return picked
    if current is None:
        raise ValueError("no frame decoded")
    if times[-1] - current[1] > period / 2 + 1e-9:
        raise ClipTooShort(
            f"{current[0] + 1} frames, the last at {current[1]:.3f} s; {len(times)} frames need one at "
            f"{times[-1]:.3f} s"
        )
    while len(picked) < len(times):
        pick(current)
    return picked


def _fit(array: np.ndarray, height: int, width: int) -> np.ndarray:
    from PIL import Image

    from common.data.resize import cover_crop

    if array.shape[:2] == (height, width):
        return array
    return np.asarray(cover_crop(Image.fromarray(array), width, height), dtype=np.uint8)


def _fitter(size: Size) -> Callable[[np.ndarray], np.ndarray]:
    """An RGB frame -> the frame fitted to `size` (its shape decided by the first frame; ValueError for a frame whose
    size differs from the first's)."""
    first: list = []

    def fit(array: np.ndarray) -> np.ndarray:
        if not first:
            first.append(array.shape)
            first.append(size(*array.shape[:2]) if callable(size) else tuple(size))
        elif array.shape != first[0]:
            raise ValueError(f"its frames differ in size: {first[0][:2]} and {array.shape[:2]}")
        return _fit(array, *first[1])

    return fit


def _video_frames(container) -> tuple[Iterator[tuple[float, Any]], float]:
    """A container's decoded frames as (time from the first frame, frame), and its frame period in seconds (0 when
    the stream names no rate)."""
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"  # frame and slice threads: the same frames, decoded sooner
    rate = stream.average_rate or stream.guessed_rate
    period = float(1 / rate) if rate else 0.0

    def frames():
        start = None
        for n, frame in enumerate(container.decode(stream)):
            if frame.time is None and not period:
                raise ValueError("frames without time stamps and no frame rate")
            t = frame.time if frame.time is not None else n * period
            start = t if start is None else start
            yield t - start, frame

    return frames(), period


def _frame_files(folder: Path, fps: float) -> tuple[list[Path], float]:
    """A frame folder's images in name order and its frame rate (fps.txt's, else `fps`)."""
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in FRAME_EXTENSIONS and not p.name.startswith("."))
    rate_file = folder / FPS_FILE
    if rate_file.exists():
        try:
            fps = float(rate_file.read_text().strip())
        except ValueError:
            fps = 0.0
        if not fps > 0:
            raise ValueError(f"{rate_file}: not a frame rate")
    if not files:
        raise ValueError(f"{folder}: no frame images")
    return files, fps


def read_clip(path: str | Path, num_frames: int, fps: float, size: Size) -> np.ndarray:
    """uint8 [num_frames, H, W, 3]: a video file's (PyAV) or a frame folder's frames sampled at `fps` from its start
    (the module docstring), each resized to cover (height, width) = `size` and center-cropped (`size` may be a
    function of the source's (height, width) giving the shape). ClipTooShort for a clip too short; what PyAV or PIL
    raise for a file they cannot decode; ValueError for frames that differ in size."""
    path, fit = Path(path), _fitter(size)
    times = sample_times(num_frames, fps)
    if path.is_dir():
        from PIL import Image

        def load(file: Path) -> np.ndarray:
            with Image.open(file) as im:
                return fit(np.asarray(im.convert("RGB"), dtype=np.uint8))

        files, rate = _frame_files(path, fps)
        return np.stack(pick_nearest(((n / rate, f) for n, f in enumerate(files)), times, 1 / rate, take=load))
    import av

    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        frames, period = _video_frames(container)
        picked = pick_nearest(frames, times, period or 1 / fps, take=lambda f: fit(f.to_ndarray(format="rgb24")))
    return np.stack(picked)


def encode_frames(frames: np.ndarray, fps: float = 16) -> bytes:
    """uint8 [F, H, W, 3] RGB frames as a Matroska file of lossless FFV1 (bgr0), its rate `fps`; bitexact bytes."""
    import av

    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 [F, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska", options={"fflags": "+bitexact"}) as out:
        stream = out.add_stream("ffv1", rate=Fraction(fps).limit_denominator(1001))
        stream.height, stream.width, stream.pix_fmt = frames.shape[1], frames.shape[2], "bgr0"
        stream.codec_context.flags |= av.codec.context.Flags.bitexact
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def decode_frames(data: bytes) -> np.ndarray:
    """A stored sample's video bytes (encode_frames') -> uint8 [F, H, W, 3], every frame."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def decode_video_sample(sample: dict) -> dict:
    """A shard's sample -> {"video": float [3, F, H, W] in [-1, 1], "caption": str} (the training loader's decode)."""
    import torch

    frames = torch.from_numpy(decode_frames(sample["mkv"]))
    caption = sample["txt"]
    return {
        "video": frames.permute(3, 0, 1, 2).float().div(127.5).sub(1.0),
        "caption": caption.decode("utf-8") if isinstance(caption, bytes) else caption,
    }
