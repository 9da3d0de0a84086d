"""Turn a folder of captioned video clips into text-to-video WebDataset shards (train / held-out val).

    python -m data.prepare_videos --input ~/data/clips --out data/clips --num-frames 81 --fps 16
                                  --height 480 --width 832 [--buckets [9:16,...]] [--bucket-multiple 16]
                                  [--train-shards 8] [--val-shards 2] [--val-fraction 0.05] [--seed 0]
                                  [--max-bad-samples N] [--force]
    python -m data.prepare_videos --moving-digits --out data/cache/moving_digits --num-frames 9 --height 32 --width 32
                                  [--clips 2000]     # the text-to-video demo's clips

A clip is a video file (.mp4 .webm .mkv .mov .avi, decoded with PyAV) or a frame folder (a folder holding only
images, the frames in name order, taken at --fps unless an ``fps.txt`` among them says at what rate), found
recursively. Its caption is ``name.txt`` beside it (``folder.txt`` beside a frame folder), or a line of one
``metadata.jsonl`` (``{"file_name": "clips/a.mp4", "text": "a caption"}``) or a row of one ``metadata.csv``
(columns ``file_name,text``) in --input, the layouts finetrainers and diffusers' video scripts read (then .txt files
are ignored).

Each clip gives --num-frames frames (4k+1: the video VAE keeps the first frame and compresses the rest 4x in time),
sampled at --fps from its start (frame i is the decoded frame nearest i/fps: common/data/video.py), each resized to
cover --height x --width and center-cropped to it, never squashed. A sample is ``{__key__, mkv: the frames as
lossless FFV1 in Matroska, txt: the caption, json: {fps, num_frames, height, width, source: the clip's path in
--input}}``: lossless so that the latent cache sees exactly the frames sampled (a test checks them bit for bit).

A clip that does not decode, has no caption or an empty one, or is too short for --num-frames at --fps is skipped and
counted (meta.json ``skipped``: names by reason, and the summary line); more than --max-bad-samples skips stop with one
line and nothing written. A caption file that is not UTF-8, a bad metadata line or no clip at all stop with one line
(exit 2). The rows are shuffled with the seed before the split (never file order: data/prepare_captions.py's
split_rows says why). Like the other builders, DIR appears at once with meta.json written last.

Aspect-ratio buckets (``--buckets``): a shape per ratio (width:height) of about --height x --width pixels, both sides
multiples of --bucket-multiple (16: the video VAE's 8x downsampling x the transformer's 2x2 patches), built as
prepare_captions' buckets (bucket_shapes, nearest_bucket); each clip is cropped to the bucket nearest its aspect ratio
and its sample gets a ``bucket`` field, ``WxH``. The default ratios run from 9:16 to 16:9, the shapes video is shot in.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from common.data import dataset as common_dataset
from common.data.captions import skip_summary
from common.data.moving_digits import SPRITE_FRACTION, moving_digit_clip
from common.data.video import (
    FPS_FILE,
    FRAME_EXTENSIONS,
    SKIP_REASONS,
    SOURCE,
    VIDEO_EXTENSIONS,
    ClipTooShort,
    check_num_frames,
    encode_frames,
    read_clip,
)
from data import cli, shards
from data.prepare_captions import (
    BUCKET_MULTIPLE,
    bucket_shapes,
    check_skipped,
    nearest_bucket,
    read_text,
    split_rows,
)

METADATA = ("metadata.jsonl", "metadata.csv")
ASPECT_RATIOS = ("9:16", "2:3", "3:4", "1:1", "4:3", "3:2", "16:9")  # --buckets' default: portrait 9:16 to 16:9
MOVING_DIGITS = "moving_digits"  # meta.json "input" of the demo's clips
DEFAULT_CLIPS = 2000  # --moving-digits: 50 clips per (digit, direction) pair


def is_frame_folder(folder: Path) -> bool:
    """A folder holding only images (and perhaps fps.txt; hidden files aside), at least one."""
    names = [p for p in folder.iterdir() if not p.name.startswith(".")]
    images = [p for p in names if p.is_file() and p.suffix.lower() in FRAME_EXTENSIONS]
    return bool(images) and all(p in images or p.name == FPS_FILE for p in names)


def find_clips(root: Path) -> list[Path]:
    """The video files and frame folders under `root` (not `root` itself), sorted by path. ValueError for none."""
    if not root.is_dir():
        raise ValueError(f"--input {root}: no such folder")
    found, folders = [], [root]
    while folders:
        for p in sorted(folders.pop().iterdir()):
            if p.name.startswith("."):
                continue
            if p.is_dir():
                (found.append if is_frame_folder(p) else folders.append)(p)
            elif p.suffix.lower() in VIDEO_EXTENSIONS:
                found.append(p)
    if not found:
        raise ValueError(
            f"--input {root} holds no clip: no video file ({' '.join(VIDEO_EXTENSIONS)}) and no folder of frame images"
        )
    return sorted(found)


def _metadata_rows(path: Path) -> list[tuple[str, str]]:
    """(file_name, text) per line of a metadata.jsonl or row of a metadata.csv; ValueError naming a bad line."""
    text = read_text(path)
    bad = f'not a {{"file_name", "text"}} {"JSON object" if path.suffix == ".jsonl" else "row"} with a text string'
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                    rows.append((row["file_name"], row["text"]))
                except (ValueError, KeyError, TypeError):
                    raise ValueError(f"{path}:{n}: {bad}") from None
                if not isinstance(rows[-1][0], str) or not isinstance(rows[-1][1], str):
                    raise ValueError(f"{path}:{n}: {bad}")
        return rows
    reader = csv.DictReader(text.splitlines())
    if not {"file_name", "text"} <= set(reader.fieldnames or ()):
        raise ValueError(f"{path}:1: a header with the columns file_name,text (got {reader.fieldnames})")
    rows = []
    for row in reader:
        if None in row or None in (row["file_name"], row["text"]):  # too many or too few fields
            raise ValueError(f"{path}:{reader.line_num}: {bad} (its fields do not match the header's)")
        rows.append((row["file_name"], row["text"]))
    return rows


def read_captions(root: Path, clips: list[Path]) -> list[str | None]:
    """Each clip's caption (None: it has none) from --input's metadata file, else from its .txt beside it."""
    present = [root / name for name in METADATA if (root / name).exists()]
    if len(present) > 1:
        raise ValueError(f"--input {root} holds both {' and '.join(METADATA)}: keep one")
    if present:
        captions = {(root / name).resolve(): text for name, text in _metadata_rows(present[0])}
        return [captions.get(p.resolve()) for p in clips]
    return [read_text(p.with_suffix(".txt")) if p.with_suffix(".txt").is_file() else None for p in clips]


def _captioned(root: Path, clips: list[Path], captions: list, max_bad_samples: int | None):
    """The clips with a caption, as (path, stripped caption), and the skipped ones' names per reason (the dict the
    shards' writing adds to). ValueError for fewer than two."""
    skipped: dict[str, list[str]] = {reason: [] for reason in SKIP_REASONS}
    usable = []
    for path, caption in zip(clips, captions):
        if caption is None:
            skipped["no_caption"].append(str(path.relative_to(root)))
        elif not caption.strip():
            skipped["empty_caption"].append(str(path.relative_to(root)))
        else:
            usable.append((path, caption.strip()))
    check_skipped(skipped, max_bad_samples, "--max-bad-samples")
    if len(usable) < 2:
        raise ValueError(
            f"--input {root}: {len(usable)} captioned clip(s); a caption per clip is name.txt beside name.mp4 (or "
            f"beside a frame folder), or a {' or '.join(METADATA)} of file_name/text rows"
        )
    return usable, skipped


def bucket_budget(height: int, width: int, multiple: int) -> int:
    """The square side (a multiple of `multiple`) whose area is nearest height x width: bucket_shapes' pixel budget."""
    return max(multiple, round(math.sqrt(height * width) / multiple) * multiple)


class _Clips:
    """Where a build's clips come from: a folder (paths and captions) or the moving digits (generated by row)."""

    def __init__(self, root: Path | None, usable: list | None, count: int, seed: int):
        self.root, self.usable, self.count, self.seed = root, usable, count, seed

    def __len__(self) -> int:
        return len(self.usable) if self.usable is not None else self.count

    def source(self, row: int) -> str:
        return str(self.usable[row][0].relative_to(self.root)) if self.usable is not None else f"{MOVING_DIGITS}/{row}"

    def read(self, row: int, num_frames: int, fps: float, size) -> tuple[np.ndarray, str]:
        if self.usable is None:
            clip, caption, _, _ = moving_digit_clip(row, num_frames, *size, self.seed)
            return clip, caption
        return read_clip(self.usable[row][0], num_frames, fps, size), self.usable[row][1]


def build_video_shards(
    out: str | Path,
    *,
    input: str | Path | None = None,
    moving_digits: int | None = None,
    num_frames: int,
    fps: float = 16.0,
    height: int,
    width: int,
    train_shards: int = 8,
    val_shards: int = 2,
    val_fraction: float = 0.05,
    seed: int = 0,
    force: bool = False,
    buckets: list[str] | tuple[str, ...] | None = None,
    bucket_multiple: int = BUCKET_MULTIPLE,
    max_bad_samples: int | None = None,
) -> tuple[dict, bool]:
    """Build the dataset in ``out`` unless a complete one is there. Returns (meta, built_now). The clips: the folder
    ``input`` or ``moving_digits`` generated ones (that many); ``buckets``: aspect ratios (``"16:9"``) to bucket by."""
    check_num_frames(num_frames)
    if not fps > 0:
        raise ValueError(f"--fps {fps}: must be > 0")
    if moving_digits is not None and buckets:
        raise ValueError("--buckets: the moving digits are all --height x --width; drop --buckets")
    shapes = bucket_shapes(bucket_budget(height, width, bucket_multiple), buckets, bucket_multiple) if buckets else None
    out = Path(out).absolute()
    if moving_digits is not None:
        root, files, skipped = None, moving_digits, {reason: [] for reason in SKIP_REASONS}
        clips = _Clips(None, None, moving_digits, seed)
    else:
        root = Path(input).expanduser().absolute()
        found = find_clips(root)
        usable, skipped = _captioned(root, found, read_captions(root, found), max_bad_samples)
        files, clips = len(found), _Clips(root, usable, len(usable), seed)
    settings = dict(num_frames=num_frames, fps=float(fps), height=height, width=width)
    meta_start = dict(
        source=SOURCE, input=str(root) if root else MOVING_DIGITS, clip_files=files, **settings, channels=3, splits={},
        seed=seed, val_fraction=val_fraction, skipped=skipped,
    )  # fmt: skip
    if shapes:
        meta_start["buckets"] = {
            "aspect_ratios": list(buckets),
            "multiple": bucket_multiple,
            "shapes": [list(s) for s in shapes],
            "samples": {},  # {split: {"WxH": samples}}, filled while the shards are written
        }
    if moving_digits is not None:  # the digit's size: shards drawn at another are refused, not read
        meta_start["sprite_fraction"] = SPRITE_FRACTION
    size = (lambda h, w: nearest_bucket(w, h, shapes)[::-1]) if shapes else (height, width)

    def write_shards(tmp: Path, split: str, rows: np.ndarray, _clips, _unused, num_shards: int) -> list[dict]:
        return _write_split(tmp, split, rows, num_shards, clips, settings, size, meta_start, max_bad_samples)

    return shards.build_atomically(
        out,
        train_shards=train_shards,
        val_shards=val_shards,
        val_fraction=val_fraction,
        force=force,
        dataset="video-caption",
        read_meta=common_dataset.read_meta,
        load=lambda: (None, None, split_rows(len(clips), val_fraction=val_fraction, seed=seed)),
        start_meta=lambda tmp: meta_start,
        write_shards=write_shards,
        fewer_shards_ok=True,
    )


def _write_split(tmp, split, rows, num_shards, clips: _Clips, settings, size, meta, max_bad_samples) -> list[dict]:
    """One split's shards: each clip read, sampled, cropped and stored losslessly; the ones that fail counted."""
    import webdataset as wds

    skipped, per_bucket = meta["skipped"], meta.get("buckets", {}).get("samples")
    written = []
    for shard_id, chunk in enumerate(np.array_split(rows, num_shards)):
        name, count = f"{split}-{shard_id:06d}.tar", 0
        with wds.TarWriter(str(tmp / name), mtime=0) as sink:
            for row in chunk.tolist():
                try:
                    frames, caption = clips.read(row, settings["num_frames"], settings["fps"], size)
                except ClipTooShort:
                    skipped["too_short"].append(clips.source(row))
                    continue
                except Exception:  # PyAV and PIL raise many kinds (InvalidDataError, OSError, ValueError, ...)
                    skipped["undecodable"].append(clips.source(row))
                    continue
                info = {**settings, "height": frames.shape[1], "width": frames.shape[2], "source": clips.source(row)}
                sample = {
                    "__key__": f"{split}_{row:07d}",
                    "mkv": encode_frames(frames, settings["fps"]),
                    "txt": caption,
                    "json": json.dumps(info, sort_keys=True).encode(),
                }
                if per_bucket is not None:
                    sample["bucket"] = f"{frames.shape[2]}x{frames.shape[1]}"
                    counts = per_bucket.setdefault(split, {f"{w}x{h}": 0 for w, h in meta["buckets"]["shapes"]})
                    counts[sample["bucket"]] += 1
                sink.write(sample)
                count += 1
        written.append({"name": name, "samples": count, "bytes": (tmp / name).stat().st_size})
    if split == "train" and not sum(w["samples"] for w in written):
        raise ValueError(f"--input {meta['input']}: no decodable training clip ({skip_summary(meta)})")
    check_skipped(skipped, max_bad_samples, "--max-bad-samples")
    return written


def _settings(meta: dict) -> dict:
    buckets = meta.get("buckets") or {}
    return {
        "input": meta.get("input"),
        "clips": meta.get("clip_files") if meta.get("input") == MOVING_DIGITS else None,
        "sprite_fraction": meta.get("sprite_fraction"),
        **{key: meta.get(key) for key in ("num_frames", "fps", "height", "width")},
        **shards.split_settings(meta),
        "buckets": buckets.get("aspect_ratios"),
        "bucket_multiple": buckets.get("multiple"),
    }


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    def extra(parser: argparse.ArgumentParser, positive_int) -> None:
        source = parser.add_mutually_exclusive_group(required=True)
        source.add_argument("--input", type=Path, help="a folder of clips with name.txt captions or a metadata file")
        source.add_argument("--moving-digits", action="store_true", help="generated moving digits (the demo)")
        parser.add_argument("--clips", type=positive_int, default=DEFAULT_CLIPS, help="--moving-digits: how many")
        parser.add_argument("--num-frames", required=True, type=positive_int, help="frames per clip: 4k+1 (9, 81)")
        parser.add_argument("--fps", type=float, default=16.0, help="the rate frames are sampled at (default 16)")
        parser.add_argument("--height", required=True, type=positive_int, help="frame height (pixels)")
        parser.add_argument("--width", required=True, type=positive_int, help="frame width (pixels)")
        cli.bucket_args(parser, ASPECT_RATIOS, BUCKET_MULTIPLE, "--height x --width", "clips")

    parser = cli.arg_parser(
        "python -m data.prepare_videos",
        __doc__.splitlines()[0],
        "output directory (created; must be empty or a previous build)",
        extra=extra,
    )
    parser.set_defaults(val_fraction=0.05)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    ratios = args.buckets.split(",") if args.buckets else None
    source: dict[str, Any] = (
        {"moving_digits": args.clips} if args.moving_digits else {"input": args.input.expanduser().absolute()}
    )
    extra = dict(
        num_frames=args.num_frames, fps=args.fps, height=args.height, width=args.width, buckets=ratios,
        bucket_multiple=args.bucket_multiple, max_bad_samples=args.max_bad_samples,
    )  # fmt: skip
    also = {
        "input": MOVING_DIGITS if args.moving_digits else str(source["input"]),
        "clips": args.clips if args.moving_digits else None,
        "sprite_fraction": SPRITE_FRACTION if args.moving_digits else None,
        **{key: extra[key] for key in ("num_frames", "fps", "height", "width")},
        "buckets": ratios,
        "bucket_multiple": args.bucket_multiple if ratios else None,
    }

    def describe(out: Path, meta: dict) -> str:
        shape = f"{meta['num_frames']} frames of {meta['height']}x{meta['width']} at {meta['fps']:g} fps"
        if meta.get("buckets"):
            train = meta["buckets"]["samples"].get("train", {})
            shape = f"{meta['num_frames']} frames at {meta['fps']:g} fps, buckets " + ", ".join(
                f"{k} ({n})" for k, n in train.items()
            )
        line = f"{cli.summary(out, meta)}; {shape}, with captions; {skip_summary(meta)}"
        if meta["splits"]["val"]["samples"]:
            return line
        return (
            f"{line}\nnote: {out}'s val split is empty (no held-out clip decoded): fix the skipped clips or change "
            "--seed"
        )

    return cli.run(
        lambda out, **kw: build_video_shards(out, **source, **extra, **kw), args, wanted=cli.split_wanted(args),
        describe=describe, settings=_settings, holds="video-caption shards", also_wanted=also,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
