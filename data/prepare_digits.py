"""Write scikit-learn's 8x8 handwritten digits as WebDataset tar shards (train / held-out val).

    python -m data.prepare_digits --out data/digits [--train-shards 8] [--val-shards 2]
                                  [--val-fraction 0.15] [--seed 0] [--force]

Each sample is ``{__key__: "train_000123", png: 8x8 grayscale PNG, cls: b"3"}``; the number
in the key is the row of ``sklearn.datasets.load_digits()``, so keys are unique across
splits and every sample can be traced back to its source. ``DIR/meta.json`` is written
last and the whole directory appears at once (built next to DIR, then renamed), so a
directory that has a valid meta.json is always a complete dataset.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

SOURCE = "sklearn.datasets.load_digits"
IMAGE_SIZE = 8
NUM_CLASSES = 10
SPLITS = ("train", "val")
META_NAME = "meta.json"
# load_digits pixels are 0..16 (4x4 blocks counted over a 32x32 bitmap); PNG wants 0..255.
_MAX_PIXEL = 16


def load_source_digits() -> tuple[np.ndarray, np.ndarray]:
    """The raw digits as shipped by scikit-learn: uint8 images [N, 8, 8] scaled to 0..255, int64 labels [N]."""
    from sklearn.datasets import load_digits  # local import: sklearn is slow to import

    digits = load_digits()
    images = np.rint(digits.images * (255.0 / _MAX_PIXEL)).astype(np.uint8)
    return images, digits.target.astype(np.int64)


def split_indices(labels: np.ndarray, *, val_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """Stratified, seeded train/val split of row indices (each class keeps its share in both)."""
    from sklearn.model_selection import train_test_split

    rows = np.arange(len(labels))
    train, val = train_test_split(rows, test_size=val_fraction, random_state=seed, stratify=labels)
    return {"train": np.asarray(train, dtype=np.int64), "val": np.asarray(val, dtype=np.int64)}


def encode_png(image: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image, mode="L").save(buf, format="PNG")
    return buf.getvalue()


def decode_digit_sample(sample: dict) -> dict:
    """Raw WebDataset sample -> {"image": uint8 tensor [1, 8, 8] (0..255), "label": int}.

    Module-level (hence picklable) so that it can be handed to DataLoader workers as the
    ``decode`` of ``common.data.webdataset.build_webdataset_loader``.
    """
    import torch
    from PIL import Image

    with Image.open(io.BytesIO(sample["png"])) as im:
        image = np.asarray(im.convert("L"), dtype=np.uint8)
    if image.shape != (IMAGE_SIZE, IMAGE_SIZE):
        raise ValueError(f"{sample.get('__key__')}: expected an {IMAGE_SIZE}x{IMAGE_SIZE} image, got {image.shape}")
    label = int(sample["cls"])
    if not 0 <= label < NUM_CLASSES:
        raise ValueError(f"{sample.get('__key__')}: label {label} outside 0..{NUM_CLASSES - 1}")
    return {"image": torch.from_numpy(image.copy()).unsqueeze(0), "label": label}


def _write_shards(out: Path, split: str, rows: np.ndarray, images: np.ndarray, labels: np.ndarray, num_shards: int) -> list[dict]:
    import webdataset as wds

    shards = []
    # array_split: consecutive chunks whose sizes differ by at most one ("spread evenly").
    for shard_id, chunk in enumerate(np.array_split(rows, num_shards)):
        name = f"{split}-{shard_id:06d}.tar"
        # mtime fixed so that the same seed gives byte-identical shards; an int, because a
        # float mtime makes tarfile add a 1 KiB PAX header to every member.
        with wds.TarWriter(str(out / name), mtime=0) as sink:
            for row in chunk:
                sink.write({"__key__": f"{split}_{row:06d}", "png": encode_png(images[row]), "cls": int(labels[row])})
        shards.append({"name": name, "samples": len(chunk), "bytes": (out / name).stat().st_size})
    return shards


def read_meta(root: str | Path) -> dict[str, Any] | None:
    """Parsed meta.json of a complete dataset in ``root``, or None if there is none / it is incomplete."""
    root = Path(root)
    try:
        meta = json.loads((root / META_NAME).read_text())
        for split in SPLITS:
            info = meta["splits"][split]
            for name, size in zip(info["shards"], info["shard_bytes"], strict=True):
                if (root / name).stat().st_size != size:
                    return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta


def _settings(meta: dict) -> dict:
    return {
        "train_shards": len(meta["splits"]["train"]["shards"]),
        "val_shards": len(meta["splits"]["val"]["shards"]),
        "val_fraction": meta.get("val_fraction"),
        "seed": meta.get("seed"),
    }


def _with_urls(root: Path, meta: dict) -> dict:
    meta = dict(meta)
    for split in SPLITS:
        meta[f"{split}_urls"] = [str((root / name).resolve()) for name in meta["splits"][split]["shards"]]
    return meta


def build_digits_shards(
    out: str | Path, *, train_shards: int = 8, val_shards: int = 2, val_fraction: float = 0.15, seed: int = 0, force: bool = False
) -> tuple[dict, bool]:
    """Build the dataset in ``out`` unless a complete one is there. Returns (meta, built_now).

    A complete dataset with other settings is left alone (``built_now`` False); callers compare.
    """
    out = Path(out).absolute()
    if train_shards < 1 or val_shards < 1:
        raise ValueError(f"train_shards and val_shards must be >= 1 (got {train_shards}, {val_shards})")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1) (got {val_fraction})")
    existing = read_meta(out)
    if existing is not None and not force:
        return existing, False
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    if existing is None and out.is_dir() and any(out.iterdir()) and not force:
        # Never delete files we did not write: a non-empty dir without our meta.json is the user's.
        raise ValueError(f"{out} is not empty and holds no complete digits dataset; choose an empty directory or pass --force")

    images, labels = load_source_digits()
    rows = split_indices(labels, val_fraction=val_fraction, seed=seed)
    counts = {"train": train_shards, "val": val_shards}
    for split in SPLITS:
        if len(rows[split]) < counts[split]:
            raise ValueError(f"{len(rows[split])} {split} samples cannot fill {counts[split]} shards")

    out.parent.mkdir(parents=True, exist_ok=True)
    # Build next to `out` (same filesystem) so the final rename is atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        meta: dict[str, Any] = {
            "source": SOURCE,
            "image_size": IMAGE_SIZE,
            "num_classes": NUM_CLASSES,
            "pixel_scale": f"round(value * 255 / {_MAX_PIXEL}) as uint8 grayscale PNG",
            "splits": {},
            "seed": seed,
            "val_fraction": val_fraction,
        }
        for split in SPLITS:
            shards = _write_shards(tmp, split, rows[split], images, labels, counts[split])
            meta["splits"][split] = {
                "shards": [s["name"] for s in shards],
                "samples": sum(s["samples"] for s in shards),
                "shard_samples": [s["samples"] for s in shards],
                "shard_bytes": [s["bytes"] for s in shards],
            }
        (tmp / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a shared data dir should be readable by others
        _move_into_place(tmp, out, force=force)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    final = read_meta(out)
    if final is None:
        raise RuntimeError(f"{out}: dataset written but {META_NAME} does not validate")
    return final, True


def _move_into_place(tmp: Path, out: Path, *, force: bool) -> None:
    try:
        os.rename(tmp, out)  # atomic; also replaces an empty directory
        return
    except OSError:
        if not out.exists():
            raise
    # `out` is non-empty: either another process finished the same build first, or --force.
    if not force:
        if read_meta(out) is not None:
            return  # another process won the race with a complete dataset; ours is discarded
        raise ValueError(f"{out} appeared while building and holds no complete digits dataset; not replacing it")
    trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rename(out, trash / "old")
    os.rename(tmp, out)
    shutil.rmtree(trash, ignore_errors=True)


def ensure_digits_shards(root: str | Path, *, train_shards: int = 8, val_shards: int = 2, seed: int = 0, val_fraction: float = 0.15) -> dict:
    """Parsed meta.json of the digits shards under ``root``, building them first if missing.

    Adds ``train_urls`` / ``val_urls`` (absolute shard paths). Not rank-aware: call it on
    rank 0 and barrier before other ranks read. A complete dataset built with other
    settings raises ValueError rather than being silently reused or overwritten.
    """
    root = Path(root).absolute()
    meta, _ = build_digits_shards(root, train_shards=train_shards, val_shards=val_shards, val_fraction=val_fraction, seed=seed)
    wanted = {"train_shards": train_shards, "val_shards": val_shards, "val_fraction": val_fraction, "seed": seed}
    have = _settings(meta)
    if have != wanted:
        diff = ", ".join(f"{k}={have[k]} (wanted {wanted[k]})" for k in wanted if have[k] != wanted[k])
        raise ValueError(f"{root} holds digits shards built with {diff}; delete it or rebuild with `python -m data.prepare_digits --out {root} --force`")
    return _with_urls(root, meta)


def load_split_arrays(root: str | Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Read one split back from its shards: uint8 images [N, 8, 8] (0..255) and int64 labels [N], in shard order."""
    import webdataset as wds

    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = Path(root).absolute()
    meta = read_meta(root)
    if meta is None:
        raise FileNotFoundError(f"no complete digits dataset in {root} (run `python -m data.prepare_digits --out {root}`)")
    urls = _with_urls(root, meta)[f"{split}_urls"]
    images, labels = [], []
    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
        decoded = decode_digit_sample(sample)
        images.append(decoded["image"][0].numpy())
        labels.append(decoded["label"])
    if len(images) != meta["splits"][split]["samples"]:
        raise RuntimeError(f"{root}: read {len(images)} {split} samples, meta.json says {meta['splits'][split]['samples']}")
    return np.stack(images).astype(np.uint8), np.asarray(labels, dtype=np.int64)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    def positive_int(text: str) -> int:
        value = int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
        return value

    def fraction(text: str) -> float:
        value = float(text)
        if not 0.0 < value < 1.0:
            raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
        return value

    parser = argparse.ArgumentParser(prog="python -m data.prepare_digits", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="output directory (created; must be empty or a previous digits build)")
    parser.add_argument("--train-shards", type=positive_int, default=8)
    parser.add_argument("--val-shards", type=positive_int, default=2)
    parser.add_argument("--val-fraction", type=fraction, default=0.15, help="share of samples held out for val (stratified)")
    parser.add_argument("--seed", type=int, default=0, help="split seed")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete dataset is there (replaces DIR)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    out = args.out.absolute()
    wanted = {"train_shards": args.train_shards, "val_shards": args.val_shards, "val_fraction": args.val_fraction, "seed": args.seed}
    try:
        meta, built = build_digits_shards(out, **wanted, force=args.force)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not built:
        have = _settings(meta)
        if have != wanted:
            diff = ", ".join(f"{k}={have[k]}" for k in wanted if have[k] != wanted[k])
            print(f"error: {out} already holds digits shards built with {diff}; pass --force to rebuild", file=sys.stderr)
            return 1
        print(f"{out}/{META_NAME} exists; nothing to do (pass --force to rebuild)")
        return 0
    splits = meta["splits"]
    print(
        f"wrote {out}: train {splits['train']['samples']} samples in {len(splits['train']['shards'])} shards, "
        f"val {splits['val']['samples']} samples in {len(splits['val']['shards'])} shards (seed {meta['seed']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
