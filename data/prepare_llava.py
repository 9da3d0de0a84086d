"""LLaVA-format conversations (LLaVA's pretrain and instruct JSON) -> WebDataset shards the VLM recipe streams.

    python -m data.prepare_llava --json FILE --images DIR --out DIR [--train-shards N] [--val-shards 2]
                                 [--val-fraction 0.005] [--seed 0] [--workers N] [--force]

Input: a JSON list of ``{"id", "image": "path/under/DIR" (or a list of paths, or ``"images": [...]``; no key =
text only), "conversations": [{"from": "human", "value": "<image>\\n..."}, {"from": "gpt", "value": ...}, ...]}``
(``human``/``user``, ``gpt``/``assistant``, an optional leading ``system``), the layout of
LLaVA-Pretrain-558K and llava_v1_5_mix665k. A sample may carry one video, ``"video": "clip.mp4"`` (a file PyAV
decodes: MP4, WebM, MKV, ...) or ``"video": ["f0.jpg", "f1.jpg", ...]`` (its frames, in order, all one size),
with ``<video>`` where it goes in a user turn (LLaVA-Video's and Qwen2.5-VL's fine-tuning layout); frame files
are a video sampled at training's rate (data.video_fps, else the model's video processor's) unless
``"video_fps"`` says the rate they were taken at.
A sample is skipped, counted and named in the summary when its image or video is missing or does not decode
(every image and video is fully decoded here, in ``--workers`` processes), when its ``<image>`` (``<video>``)
placeholders do not match its images (video) one to one, or when it is malformed (not user/assistant turns in
alternation starting with the user, no answer). All bad: one ``kiln: error:`` line, exit 2.

Output: ``{split}-NNNNNN.tar`` shards, each sample ``{__key__: "train_000000123", json: {"id",
"messages": [{"role", "content"}], "num_images"[, "video"]}, image0, image1, ...: the image files' bytes as they
are}``, a video as ``video`` (the file's bytes; json ``"video": {"container": "mp4"}``) or ``frame0``,
``frame1``, ... (json ``"video": {"frames": N, "fps": rate or null}``), split train/val at random (seeded), and
``meta.json`` (format ``llava-conversations``, counts, what was skipped and why) written last; the directory
appears at once (``data.shards``). ``--train-shards`` defaults to 64, or one per training sample for a set of
fewer (a given count more than the samples is refused). The text is
NOT tokenized here: training tokenizes it (recipes/vlm/data.py) with the processor of the model being
trained, so one set of shards serves any language model and vision tower, and the labels follow that
model's own chat template.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from common.data import dataset as common_dataset
from data import cli, shards

FORMAT = "llava-conversations"  # meta.json "format"; recipes/vlm/data.py reads it
TRAIN_SHARDS = 64  # --train-shards' default for a set of 64 training samples or more (auto_train_shards)
IMAGE_TOKEN = "<image>"
VIDEO_TOKEN = "<video>"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
REASONS = (
    "missing image",
    "undecodable image",
    "<image> count mismatch",
    "missing video",
    "undecodable video",
    "<video> count mismatch",
    "malformed",
)


class Rejected(ValueError):
    """Why one sample is skipped (the reason is one of REASONS)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def to_messages(record: Any) -> tuple[list[dict], list[str], dict | None]:
    """(messages, image paths, video) of one LLaVA record, or Rejected("malformed" / "<image> count mismatch" /
    "<video> count mismatch"). The video: None, ``{"container": path}`` or ``{"frames": [paths], "fps": rate}``."""
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        raise Rejected("malformed", "no conversations list")
    if "image" in record and "images" in record:
        raise Rejected("malformed", "both image and images; give the paths under one of them")
    key = "images" if "images" in record else "image"
    image = record.get(key)
    images = [image] if isinstance(image, str) else image if image is not None else []
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        raise Rejected("malformed", f"{key} is {image!r}, not a path or a list of paths")
    video = _video(record)
    messages = []
    for turn in record["conversations"]:
        role = ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
        if role is None or not isinstance(turn.get("value"), str):
            raise Rejected("malformed", f"turn {turn!r} is not {{'from': human|gpt|system, 'value': text}}")
        messages.append({"role": role, "content": turn["value"]})
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if not body or any(m["role"] != ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(body)):
        raise Rejected("malformed", "turns do not alternate user, assistant, ... starting with the user")
    if len(body) < 2 or not any(m["content"].strip() for m in body[1::2]):
        raise Rejected("malformed", "no assistant answer")
    for token, n, kind in ((IMAGE_TOKEN, len(images), "image"), (VIDEO_TOKEN, int(video is not None), "video")):
        count = sum(m["content"].count(token) for m in messages)
        if count != n or any(token in m["content"] for m in messages if m["role"] != "user"):
            raise Rejected(
                f"{token} count mismatch",
                f"{count} {token} in the text, {n} {kind}(s); placeholders belong in user turns, one per {kind}",
            )
    return messages, images, video


def _video(record: dict) -> dict | None:
    """A record's ``video`` (and ``video_fps``), checked for shape: Rejected("malformed") if it is neither a path
    nor a list of frame paths, or the rate is not a positive number."""
    video, fps = record.get("video"), record.get("video_fps")
    if video is None:
        if fps is not None:
            raise Rejected("malformed", "video_fps without a video")
        return None
    if isinstance(video, str) and video:
        if fps is not None:
            raise Rejected("malformed", "video_fps is for a video given as frame files; a video file has its rate")
        return {"container": video}
    if not isinstance(video, list) or not video or not all(isinstance(p, str) and p for p in video):
        raise Rejected("malformed", f"video is {video!r}, not a path or a list of frame paths")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
        raise Rejected("malformed", f"video_fps is {fps!r}, not a positive number of frames per second")
    return {"frames": video, "fps": fps}


def check_image(path: Path) -> str | None:
    """None if `path` is an image that decodes completely, else the reason it is skipped."""
    from PIL import Image

    if not path.is_file():
        return "missing image"
    try:
        with Image.open(path) as im:
            im.load()
    except Exception:  # PIL raises many types for truncated / foreign files
        return "undecodable image"
    return None


def _check_images(paths: list[Path]) -> list[str | None]:
    return [check_image(p) for p in paths]


def check_video(video: dict) -> tuple[str, str] | None:
    """None if `video` ({"container": Path} or {"frames": [Path], ...}) decodes completely (every frame; the frame
    files one size), else (the reason it is skipped, the file or what is wrong)."""
    if "frames" in video:
        sizes = set()
        for path in video["frames"]:
            if not path.is_file():
                return "missing video", f"frame {path}"
            try:
                from PIL import Image

                with Image.open(path) as im:
                    im.load()
                    sizes.add(im.size)
            except Exception:  # PIL raises many types for truncated / foreign files
                return "undecodable video", f"frame {path}"
        if len(sizes) > 1:
            return "undecodable video", f"frames of different sizes {sorted(sizes)}, from {video['frames'][0]}"
        return None
    path = video["container"]
    if not path.is_file():
        return "missing video", str(path)
    try:
        import av

        with av.open(str(path)) as container:
            frames = sum(1 for _ in container.decode(video=0)) if container.streams.video else 0
    except Exception:  # av.error.* (InvalidDataError, ...), and whatever a foreign file makes FFmpeg raise
        return "undecodable video", str(path)
    return None if frames else ("undecodable video", f"{path} (no video frames)")


def _check_videos(videos: list[dict]) -> list[tuple[str, str] | None]:
    return [check_video(v) for v in videos]


def load_records(json_path: Path, images_dir: Path, workers: int) -> tuple[list[dict], dict]:
    """The usable samples as {"id", "messages", "images": [Path]} and what was skipped:
    {"total", "skipped": {reason: count}, "examples": {reason: "id: detail"}}."""
    try:
        records = json.loads(json_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(
            f"--json {json_path}: not readable as JSON ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        ) from None
    if not isinstance(records, list):
        raise ValueError(f"--json {json_path}: a list of LLaVA samples is expected, found a {type(records).__name__}")
    skipped, examples, parsed = Counter(), {}, []

    def reject(rid: str, reason: str, detail: str) -> None:
        skipped[reason] += 1
        examples.setdefault(reason, f"{rid}: {detail}")

    for index, record in enumerate(records):
        rid = str(record.get("id", f"#{index}")) if isinstance(record, dict) else f"#{index}"
        try:
            messages, images, video = to_messages(record)
        except Rejected as exc:
            reject(rid, exc.reason, str(exc))
            continue
        if video is not None:
            if "frames" in video:
                video = {**video, "frames": [images_dir / p for p in video["frames"]]}
            else:
                video = {"container": images_dir / video["container"]}
        parsed.append({"id": rid, "messages": messages, "images": [images_dir / p for p in images], "video": video})
    verdict = image_verdicts([p for r in parsed for p in r["images"]], workers)
    videos = [r["video"] for r in parsed if r["video"] is not None]
    video_verdicts = iter(_in_chunks(_check_videos, videos, 8, workers))
    usable = []
    for r in parsed:
        bad = next(((p, verdict[p]) for p in r["images"] if verdict[p]), None)
        bad_video = next(video_verdicts) if r["video"] is not None else None
        if bad:
            reject(r["id"], bad[1], str(bad[0]))
        elif bad_video:
            reject(r["id"], *bad_video)
        else:
            usable.append(r)
    return usable, {
        "total": len(records),
        "skipped": {k: skipped[k] for k in REASONS if skipped[k]},
        "examples": examples,
    }


def image_verdicts(paths: list[Path], workers: int) -> dict[Path, str | None]:
    """``check_image`` of every path (None: it decodes). Full decodes dominate (LLaVA-Pretrain: 558K images): they
    are spread over ``workers`` processes."""
    return dict(zip(paths, _in_chunks(_check_images, paths, 256, workers)))


def _in_chunks(check, items: list, size: int, workers: int) -> list:
    """``check`` over ``items`` in chunks of ``size``, on ``workers`` processes when there is more than one chunk."""
    chunks = [items[i : i + size] for i in range(0, len(items), size)]
    if workers > 1 and len(chunks) > 1:
        with ProcessPoolExecutor(workers) as pool:
            return [v for chunk in pool.map(check, chunks) for v in chunk]
    return [v for chunk in chunks for v in check(chunk)]


def split_rows(n: int, *, val_fraction: float, val_shards: int, seed: int) -> dict[str, np.ndarray]:
    """A seeded random split: max(val_shards, round(val_fraction * n)) samples to val (one per val shard at least)."""
    order = np.random.default_rng(seed).permutation(n)
    n_val = max(val_shards, round(val_fraction * n))
    return {"train": np.sort(order[n_val:]), "val": np.sort(order[:n_val])}


def split_filled(
    n: int, *, train_shards: int | None, val_shards: int, val_fraction: float, seed: int
) -> dict[str, np.ndarray]:
    """``split_rows`` of ``n`` usable samples, or ValueError when they cannot fill the shards asked for
    (``train_shards`` None: as many as there are training samples, at least one)."""
    needed = (train_shards or 1) + max(val_shards, round(val_fraction * n))
    if n < needed:
        raise ValueError(
            f"{n} usable samples cannot fill {train_shards or 1} train + {val_shards} val shards; "
            "lower --train-shards / --val-shards"
        )
    return split_rows(n, val_fraction=val_fraction, val_shards=val_shards, seed=seed)


def image_members(paths: list[Path]) -> dict[str, bytes]:
    """A sample's ``image0``, ``image1``, ...: the image files' bytes as they are, in order."""
    return {f"image{i}": path.read_bytes() for i, path in enumerate(paths)}


def _write_shards(
    out: Path, split: str, rows: np.ndarray, records: list[dict], labels: None, num_shards: int
) -> list[dict]:
    """One split's shards (a data.shards.ShardWriter; `labels` unused: conversations carry their text)."""

    def sample(row: int) -> dict:
        r = records[row]
        record = {"id": r["id"], "messages": r["messages"], "num_images": len(r["images"])}
        sample = image_members(r["images"])
        video = r.get("video")
        if video is not None and "frames" in video:
            record["video"] = {"frames": len(video["frames"]), "fps": video["fps"]}
            sample.update({f"frame{i}": path.read_bytes() for i, path in enumerate(video["frames"])})
        elif video is not None:
            record["video"] = {"container": video["container"].suffix.lstrip(".").lower()}
            sample["video"] = video["container"].read_bytes()
        return {"__key__": sample_key(split, row), "json": json.dumps(record), **sample}

    return shards.write_split(out, split, rows, sample, num_shards)


def sample_key(split: str, row: int) -> str:
    return f"{split}_{row:09d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _settings(meta: dict) -> dict:
    return {"json_sha256": meta.get("json_sha256"), "images": meta.get("images"), **shards.split_settings(meta)}


def build_llava(
    out: str | Path,
    *,
    json_path: str | Path,
    images: str | Path,
    train_shards: int | None = None,
    val_shards: int = 2,
    val_fraction: float = 0.005,
    seed: int = 0,
    workers: int = 1,
    force: bool = False,
) -> tuple[dict, bool]:
    """Build the dataset in ``out`` unless a complete one is there. Returns (meta, built_now); callers compare
    settings of a dataset that was there (``_settings``). ValueError for unusable input. ``train_shards`` None:
    ``auto_train_shards``."""
    out, json_path, images = Path(out).absolute(), Path(json_path).absolute(), Path(images).absolute()
    if not json_path.is_file():
        raise ValueError(f"--json {json_path}: no such file")
    if not images.is_dir():
        raise ValueError(f"--images {images}: no such folder")
    found: dict[str, Any] = {}

    def load():
        records, report = load_records(json_path, images, workers)
        if not records:
            counts = ", ".join(f"{k} {v}" for k, v in report["skipped"].items()) or "the list is empty"
            first = next(iter(report["examples"].values()), "")
            raise ValueError(
                f"--json {json_path}: none of its {report['total']} samples is usable ({counts})"
                + (f"; first: {first}" if first else "")
            )
        rows = split_filled(
            len(records), train_shards=train_shards, val_shards=val_shards, val_fraction=val_fraction, seed=seed
        )
        found.update(report, records=records)
        return records, None, rows

    def start_meta(tmp: Path) -> dict[str, Any]:
        records = found["records"]
        return {
            "format": FORMAT,
            "source": str(json_path),
            "json_sha256": _sha256(json_path),
            "images": str(images),
            "splits": {},
            "seed": seed,
            "val_fraction": val_fraction,
            "total": found["total"],
            "usable": len(records),
            "text_only": sum(not r["images"] and r["video"] is None for r in records),
            "videos": sum(r["video"] is not None for r in records),
            "multi_turn": sum(sum(m["role"] == "assistant" for m in r["messages"]) > 1 for r in records),
            "skipped": found["skipped"],
            "skipped_examples": found["examples"],
        }

    return shards.build_atomically(
        out,
        train_shards=train_shards or TRAIN_SHARDS,
        val_shards=val_shards,
        val_fraction=val_fraction,
        force=force,
        dataset="LLaVA conversations",
        read_meta=common_dataset.read_meta,
        load=load,
        start_meta=start_meta,
        write_shards=_write_shards,
        fewer_shards_ok=train_shards is None,  # auto: a shard per training sample when there are fewer than 64
    )


def auto_train_shards(train_samples: int) -> int:
    """--train-shards' default: TRAIN_SHARDS, or one per training sample when there are fewer."""
    return min(TRAIN_SHARDS, train_samples)


def summary(out: Path, meta: dict) -> str:
    skipped = meta["skipped"]
    lines = [
        f"{cli.summary(out, meta)}; {meta['usable']:,} of {meta['total']:,} samples usable "
        f"({meta['text_only']:,} text-only, {meta['multi_turn']:,} multi-turn"
        + (f", {meta['videos']:,} with a video)" if meta.get("videos") else ")")
    ]
    if skipped:
        lines.append(f"skipped {sum(skipped.values()):,}: " + ", ".join(f"{k} {v:,}" for k, v in skipped.items()))
        lines += [f"  first {k}: {v}" for k, v in meta["skipped_examples"].items()]
    return "\n".join(lines)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    def inputs(parser: argparse.ArgumentParser, positive_int) -> None:
        parser.add_argument(
            "--json", required=True, type=Path, help="LLaVA-format JSON: a list of {id, image, conversations}"
        )
        parser.add_argument(
            "--images", required=True, type=Path, help="folder the samples' image and video paths are relative to"
        )
        parser.add_argument(
            "--workers",
            type=positive_int,
            default=min(8, os.cpu_count() or 1),
            help="processes decoding the images and videos to check them",
        )

    parser = cli.arg_parser(
        "python -m data.prepare_llava",
        __doc__.splitlines()[0],
        "output directory (created; must be empty or a previous build)",
        extra=inputs,
        seed_help="seed of the train/val split",
    )
    parser.set_defaults(train_shards=None, val_fraction=0.005)  # None: auto_train_shards
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    out = args.out.absolute()
    wanted = cli.split_wanted(args)
    # Not cli.run: with --train-shards auto, what a dataset already there should hold is known from its meta only.
    try:
        meta, built = build_llava(
            out, json_path=args.json, images=args.images, workers=args.workers, force=args.force, **wanted
        )
    except ValueError as exc:
        return cli.error(exc, "kiln: error")
    if not built:
        if args.train_shards is None:  # auto: what a build of that input makes
            wanted["train_shards"] = auto_train_shards(meta["splits"]["train"]["samples"])
        have, want = (
            _settings(meta),
            {"json_sha256": _sha256(args.json.absolute()), "images": str(args.images.absolute()), **wanted},
        )
        if have != want:
            print(
                f"kiln: error: {out} already holds LLaVA conversations built with other input or settings "
                f"({shards.mismatch(have, want)}); pass --force to rebuild",
                file=sys.stderr,
            )
            return 1
        return cli.nothing_to_do(out)
    print(summary(out, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
