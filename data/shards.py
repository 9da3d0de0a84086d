"""What the train/val WebDataset shard builders in ``data`` share: meta.json bookkeeping and the atomic
build (their command line is data/cli.py).

A dataset directory holds ``{split}-NNNNNN.tar`` shards for each split in :data:`SPLITS` and a
``meta.json`` that records every shard's name, sample count and byte size. The directory is
built next to its final place, ``meta.json`` is written last and the whole directory is then
renamed into place, so a directory whose meta.json validates is always complete. The format
and its validation (``read_meta``, ``with_urls``) live in ``common.data.dataset``, which training
reads datasets with. Used by every ``data.prepare_*`` builder; ``dataset`` arguments only name
the dataset in error messages.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# The format training reads (meta.json's completeness rules, shard urls) is defined in common;
# the builders write datasets that satisfy it and reuse its checks (common.data.dataset).
from common.data.dataset import META_NAME, SPLITS

# (tmp dir, split, rows, images, labels, num_shards) -> [{"name", "samples", "bytes"}, ...]
ShardWriter = Callable[[Path, str, np.ndarray, np.ndarray, np.ndarray, int], list[dict]]


def split_settings(meta: dict) -> dict:
    """The split settings a dataset was built with (compare with what a caller wants)."""
    return {
        "train_shards": len(meta["splits"]["train"]["shards"]),
        "val_shards": len(meta["splits"]["val"]["shards"]),
        "val_fraction": meta.get("val_fraction"),
        "seed": meta.get("seed"),
    }


def mismatch(have: dict, wanted: dict, *, show_wanted: bool = True) -> str:
    """``"seed=0 (wanted 1), ..."`` for the keys of ``wanted`` whose value in ``have`` differs."""
    return ", ".join(
        f"{k}={have[k]}" + (f" (wanted {wanted[k]})" if show_wanted else "") for k in wanted if have[k] != wanted[k]
    )


def require_settings(root: Path, have: dict, wanted: dict, *, holds: str, rebuild: str) -> None:
    """ValueError unless a dataset's settings ``have`` equal ``wanted``; the message names ``rebuild`` (a command)."""
    if have != wanted:
        raise ValueError(
            f"{root} holds {holds} built with {mismatch(have, wanted)}; delete it or rebuild with {rebuild}"
        )


def file_sizes(folder: Path) -> dict[str, int]:
    """Name -> size of the files in a side folder, recorded in meta.json as ``{asset}_files``."""
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}


def npy_bytes(array: np.ndarray) -> bytes:
    """An array as the bytes of an ``.npy`` file (a sample's ``ids.npy``; training decodes it with ``np.load``)."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def write_split(
    out: Path, split: str, rows: np.ndarray, sample_of: Callable[[int], dict], num_shards: int
) -> list[dict]:
    """One split's ``{split}-NNNNNN.tar`` shards in ``out``: ``rows`` spread evenly over ``num_shards``, each
    written as ``sample_of(row)`` (a WebDataset sample dict). Returns the shard bookkeeping of a ShardWriter."""
    import webdataset as wds

    written = []
    # array_split: consecutive chunks whose sizes differ by at most one ("spread evenly").
    for shard_id, chunk in enumerate(np.array_split(rows, num_shards)):
        name = f"{split}-{shard_id:06d}.tar"
        # mtime fixed (an int: a float adds a PAX header per member) so the same seed gives the same bytes.
        with wds.TarWriter(str(out / name), mtime=0) as sink:
            for row in chunk:
                sink.write(sample_of(int(row)))
        written.append({"name": name, "samples": len(chunk), "bytes": (out / name).stat().st_size})
    return written


def build_atomically(
    out: Path,
    *,
    train_shards: int,
    val_shards: int,
    val_fraction: float,
    force: bool,
    dataset: str,
    read_meta: Callable[[Path], dict | None],
    load: Callable[[], tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]],
    start_meta: Callable[[Path], dict[str, Any]],
    write_shards: ShardWriter,
    fewer_shards_ok: bool = False,
) -> tuple[dict, bool]:
    """Build a dataset in ``out`` unless a complete one (per ``read_meta``) is there. Returns (meta, built_now).

    ``load()`` gives (images, labels, {split: rows}); it is only called when building.
    ``start_meta(tmp)`` writes whatever goes beside the shards into the temp dir and returns the
    meta dict, with a ``"splits"`` key where the shard bookkeeping goes (its place sets the key
    order in meta.json). ``write_shards`` writes one split's shards into the temp dir.
    ``fewer_shards_ok``: a split with fewer samples than shards gets one shard per sample (datasets of
    any size, e.g. the user's own files) instead of an error.
    """
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
        raise ValueError(
            f"{out} is not empty and holds no complete {dataset} dataset; choose an empty directory or pass --force"
        )

    images, labels, rows = load()
    counts = {"train": train_shards, "val": val_shards}
    if fewer_shards_ok:
        counts = {split: min(counts[split], len(rows[split])) for split in SPLITS}
    for split in SPLITS:
        if len(rows[split]) < counts[split]:
            raise ValueError(f"{len(rows[split])} {split} samples cannot fill {counts[split]} shards")

    out.parent.mkdir(parents=True, exist_ok=True)
    # Build next to `out` (same filesystem) so the final rename is atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        meta = start_meta(tmp)
        for split in SPLITS:
            shards = write_shards(tmp, split, rows[split], images, labels, counts[split])
            meta["splits"][split] = {
                "shards": [s["name"] for s in shards],
                "samples": sum(s["samples"] for s in shards),
                "shard_samples": [s["samples"] for s in shards],
                "shard_bytes": [s["bytes"] for s in shards],
            }
        (tmp / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a shared data dir should be readable by others
        move_into_place(tmp, out, force=force, dataset=dataset, read_meta=read_meta)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    final = read_meta(out)
    if final is None:
        raise RuntimeError(f"{out}: dataset written but {META_NAME} does not validate")
    return final, True


def move_into_place(
    tmp: Path, out: Path, *, force: bool, dataset: str, read_meta: Callable[[Path], dict | None]
) -> None:
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
        raise ValueError(f"{out} appeared while building and holds no complete {dataset} dataset; not replacing it")
    trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rename(out, trash / "old")
    os.rename(tmp, out)
    shutil.rmtree(trash, ignore_errors=True)
