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
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from common.data import dataset as common_dataset
from data import cli, shards
from data.shards import META_NAME, SPLITS  # noqa: F401  (re-exported: part of this module's API)

SOURCE = "sklearn.datasets.load_digits"
IMAGE_SIZE = 8
NUM_CLASSES = 10
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


def _write_shards(
    out: Path,
    split: str,
    rows: np.ndarray,
    images: np.ndarray,
    labels: np.ndarray,
    num_shards: int,
    extra_fields: Callable[[str, int], dict] | None = None,
) -> list[dict]:
    """One split's shards; ``extra_fields(key, label)`` adds fields to each sample after png and cls."""
    import webdataset as wds

    written = []
    # array_split: consecutive chunks whose sizes differ by at most one ("spread evenly").
    for shard_id, chunk in enumerate(np.array_split(rows, num_shards)):
        name = f"{split}-{shard_id:06d}.tar"
        # mtime fixed so that the same seed gives byte-identical shards; an int, because a
        # float mtime makes tarfile add a 1 KiB PAX header to every member.
        with wds.TarWriter(str(out / name), mtime=0) as sink:
            for row in chunk:
                key, label = f"{split}_{row:06d}", int(labels[row])
                sample = {"__key__": key, "png": encode_png(images[row]), "cls": label}
                if extra_fields is not None:
                    sample.update(extra_fields(key, label))
                sink.write(sample)
        written.append({"name": name, "samples": len(chunk), "bytes": (out / name).stat().st_size})
    return written


def load_split(*, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """:func:`load_source_digits` and its :func:`split_indices`: (images, labels, {split: rows})."""
    images, labels = load_source_digits()
    return images, labels, split_indices(labels, val_fraction=val_fraction, seed=seed)


def read_meta(root: str | Path) -> dict[str, Any] | None:
    """Parsed meta.json of a complete dataset in ``root``, or None if there is none / it is incomplete."""
    return common_dataset.read_meta(root)


def build_digits_shards(
    out: str | Path,
    *,
    train_shards: int = 8,
    val_shards: int = 2,
    val_fraction: float = 0.15,
    seed: int = 0,
    force: bool = False,
) -> tuple[dict, bool]:
    """Build the dataset in ``out`` unless a complete one is there. Returns (meta, built_now).

    A complete dataset with other settings is left alone (``built_now`` False); callers compare.
    """
    out = Path(out).absolute()

    def start_meta(tmp: Path) -> dict[str, Any]:
        return {
            "source": SOURCE,
            "image_size": IMAGE_SIZE,
            "num_classes": NUM_CLASSES,
            "pixel_scale": f"round(value * 255 / {_MAX_PIXEL}) as uint8 grayscale PNG",
            "splits": {},
            "seed": seed,
            "val_fraction": val_fraction,
        }

    return shards.build_atomically(
        out,
        train_shards=train_shards,
        val_shards=val_shards,
        val_fraction=val_fraction,
        force=force,
        dataset="digits",
        read_meta=read_meta,
        load=lambda: load_split(val_fraction=val_fraction, seed=seed),
        start_meta=start_meta,
        write_shards=_write_shards,
    )


def ensure_digits_shards(
    root: str | Path, *, train_shards: int = 8, val_shards: int = 2, seed: int = 0, val_fraction: float = 0.15
) -> dict:
    """Parsed meta.json of the digits shards under ``root``, building them first if missing.

    Adds ``train_urls`` / ``val_urls`` (absolute shard paths). For scripts and tests
    (training runs the CLI instead: ``data.build``). A complete dataset built with other
    settings raises ValueError rather than being silently reused or overwritten.
    """
    root = Path(root).absolute()
    meta, _ = build_digits_shards(
        root, train_shards=train_shards, val_shards=val_shards, val_fraction=val_fraction, seed=seed
    )
    wanted = {"train_shards": train_shards, "val_shards": val_shards, "val_fraction": val_fraction, "seed": seed}
    shards.require_settings(
        root,
        shards.split_settings(meta),
        wanted,
        holds="digits shards",
        rebuild=f"`python -m data.prepare_digits --out {root} --force`",
    )
    return common_dataset.with_urls(root, meta)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.arg_parser(
        "python -m data.prepare_digits",
        __doc__.splitlines()[0],
        "output directory (created; must be empty or a previous digits build)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    return cli.run(
        build_digits_shards,
        args,
        wanted=cli.split_wanted(args),
        describe=cli.summary,
        settings=shards.split_settings,
        holds="digits shards",
        show_wanted=False,
    )


if __name__ == "__main__":
    sys.exit(main())
