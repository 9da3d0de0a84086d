"""LLaVA-format conversations (LLaVA's pretrain and instruct JSON) -> WebDataset shards the VLM recipe streams.

    python -m data.prepare_llava --json FILE --images DIR --out DIR [--train-shards 64] [--val-shards 2]
                                 [--val-fraction 0.005] [--seed 0] [--workers N] [--force]

Input: a JSON list of ``{"id", "image": "path/under/DIR" (or a list of paths; no key = text only),
"conversations": [{"from": "human", "value": "<image>\\n..."}, {"from": "gpt", "value": ...}, ...]}``
(``human``/``user``, ``gpt``/``assistant``, an optional leading ``system``), the layout of
LLaVA-Pretrain-558K and llava_v1_5_mix665k. A sample is skipped, counted and named in the summary when
its image is missing or does not decode (every image is fully decoded here, in ``--workers``
processes), when its ``<image>`` placeholders do not match its images one to one, or when it is
malformed (not user/assistant turns in alternation starting with the user, no answer). All bad: one
``kiln: error:`` line, exit 2.

Output: ``{split}-NNNNNN.tar`` shards, each sample ``{__key__: "train_000000123", json: {"id",
"messages": [{"role", "content"}], "num_images"}, image0, image1, ...: the image files' bytes as they
are}``, split train/val at random (seeded), and ``meta.json`` (format ``llava-conversations``, counts,
what was skipped and why) written last; the directory appears at once (``data.shards``). The text is
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
from data import shards

FORMAT = "llava-conversations"  # meta.json "format"; recipes/vlm/data.py reads it
IMAGE_TOKEN = "<image>"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
REASONS = ("missing image", "undecodable image", "<image> count mismatch", "malformed")


class Rejected(ValueError):
    """Why one sample is skipped (the reason is one of REASONS)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def to_messages(record: Any) -> tuple[list[dict], list[str]]:
    """(messages, image paths) of one LLaVA record, or Rejected("malformed" / "<image> count mismatch")."""
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        raise Rejected("malformed", "no conversations list")
    image = record.get("image")
    images = [image] if isinstance(image, str) else image if image is not None else []
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        raise Rejected("malformed", f"image is {image!r}, not a path or a list of paths")
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
    count = sum(m["content"].count(IMAGE_TOKEN) for m in messages)
    if count != len(images) or any(IMAGE_TOKEN in m["content"] for m in messages if m["role"] != "user"):
        raise Rejected(
            "<image> count mismatch",
            f"{count} {IMAGE_TOKEN} in the text, {len(images)} image(s); "
            "placeholders belong in user turns, one per image",
        )
    return messages, images


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
            messages, images = to_messages(record)
        except Rejected as exc:
            reject(rid, exc.reason, str(exc))
            continue
        parsed.append({"id": rid, "messages": messages, "images": [images_dir / p for p in images]})
    # Full decodes dominate (LLaVA-Pretrain: 558K images): spread them over processes.
    paths = [p for r in parsed for p in r["images"]]
    chunks = [paths[i : i + 256] for i in range(0, len(paths), 256)]
    if workers > 1 and len(chunks) > 1:
        with ProcessPoolExecutor(workers) as pool:
            verdicts = [v for chunk in pool.map(_check_images, chunks) for v in chunk]
    else:
        verdicts = [v for chunk in chunks for v in _check_images(chunk)]
    verdict = dict(zip(paths, verdicts))
    usable = []
    for r in parsed:
        bad = next(((p, verdict[p]) for p in r["images"] if verdict[p]), None)
        if bad:
            reject(r["id"], bad[1], str(bad[0]))
        else:
            usable.append(r)
    return usable, {
        "total": len(records),
        "skipped": {k: skipped[k] for k in REASONS if skipped[k]},
        "examples": examples,
    }


def split_rows(n: int, *, val_fraction: float, val_shards: int, seed: int) -> dict[str, np.ndarray]:
    """A seeded random split: max(val_shards, round(val_fraction * n)) samples to val (one per val shard at least)."""
    order = np.random.default_rng(seed).permutation(n)
    n_val = max(val_shards, round(val_fraction * n))
    return {"train": np.sort(order[n_val:]), "val": np.sort(order[:n_val])}


def _write_shards(
    out: Path, split: str, rows: np.ndarray, records: list[dict], labels: None, num_shards: int
) -> list[dict]:
    """One split's shards (a data.shards.ShardWriter; `labels` unused: conversations carry their text)."""
    import webdataset as wds

    written = []
    for shard_id, chunk in enumerate(np.array_split(rows, num_shards)):
        name = f"{split}-{shard_id:06d}.tar"
        with wds.TarWriter(str(out / name), mtime=0) as sink:  # mtime fixed: same input, same bytes
            for row in chunk:
                r = records[row]
                sample = {
                    "__key__": f"{split}_{row:09d}",
                    "json": json.dumps({"id": r["id"], "messages": r["messages"], "num_images": len(r["images"])}),
                }
                sample.update({f"image{i}": path.read_bytes() for i, path in enumerate(r["images"])})
                sink.write(sample)
        written.append({"name": name, "samples": len(chunk), "bytes": (out / name).stat().st_size})
    return written


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
    train_shards: int = 64,
    val_shards: int = 2,
    val_fraction: float = 0.005,
    seed: int = 0,
    workers: int = 1,
    force: bool = False,
) -> tuple[dict, bool]:
    """Build the dataset in ``out`` unless a complete one is there. Returns (meta, built_now); callers compare
    settings of a dataset that was there (``_settings``). ValueError for unusable input."""
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
        needed = train_shards + max(val_shards, round(val_fraction * len(records)))
        if len(records) < needed:
            raise ValueError(
                f"{len(records)} usable samples cannot fill {train_shards} train + {val_shards} val shards; "
                "lower --train-shards / --val-shards"
            )
        found.update(report, records=records)
        return records, None, split_rows(len(records), val_fraction=val_fraction, val_shards=val_shards, seed=seed)

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
            "text_only": sum(not r["images"] for r in records),
            "multi_turn": sum(sum(m["role"] == "assistant" for m in r["messages"]) > 1 for r in records),
            "skipped": found["skipped"],
            "skipped_examples": found["examples"],
        }

    return shards.build_atomically(
        out,
        train_shards=train_shards,
        val_shards=val_shards,
        val_fraction=val_fraction,
        force=force,
        dataset="LLaVA conversations",
        read_meta=common_dataset.read_meta,
        load=load,
        start_meta=start_meta,
        write_shards=_write_shards,
    )


def summary(out: Path, meta: dict) -> str:
    skipped = meta["skipped"]
    lines = [
        f"{shards.summary(out, meta)}; {meta['usable']:,} of {meta['total']:,} samples usable "
        f"({meta['text_only']:,} text-only, {meta['multi_turn']:,} multi-turn)"
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
            "--images", required=True, type=Path, help="folder the samples' image paths are relative to"
        )
        parser.add_argument(
            "--workers",
            type=positive_int,
            default=min(8, os.cpu_count() or 1),
            help="processes decoding the images to check them",
        )

    parser = shards.arg_parser(
        "python -m data.prepare_llava",
        __doc__.splitlines()[0],
        "output directory (created; must be empty or a previous build)",
        extra=inputs,
        seed_help="seed of the train/val split",
    )
    parser.set_defaults(train_shards=64, val_fraction=0.005)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    out = args.out.absolute()
    wanted = {
        "train_shards": args.train_shards,
        "val_shards": args.val_shards,
        "val_fraction": args.val_fraction,
        "seed": args.seed,
    }
    try:
        meta, built = build_llava(
            out, json_path=args.json, images=args.images, workers=args.workers, force=args.force, **wanted
        )
    except ValueError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2
    if not built:
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
        print(f"{out}/{shards.META_NAME} exists; nothing to do (pass --force to rebuild)")
        return 0
    print(summary(out, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
