"""Reading shards: one shard's raw samples (webdataset's tar parsing), the in-order reader, the seeded RNGs."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterable, Iterator

import webdataset as wds
from webdataset.tariterators import group_by_keys, tar_file_expander


def _rng(seed: int, epoch: int, rank: int, worker: int) -> random.Random:
    # A str seed is hashed with SHA-512 by `random` (independent of PYTHONHASHSEED), so
    # nearby integer tuples still give unrelated streams.
    return random.Random(f"kiln.webdataset/{seed}/{epoch}/{rank}/{worker}")


def _is_local(url: str) -> bool:
    return "://" not in url and not url.startswith("pipe:")


def _brief(exc: BaseException) -> str:
    # webdataset appends the stream and url to exception args; the url is logged separately.
    message = str(exc.args[0]) if exc.args else str(exc)
    return f"{type(exc).__name__}: {message.split(' @ ')[0]}"


def _read_shard(url: str) -> Iterator[dict]:
    """Raw samples of one shard, using webdataset's own tar parsing and key grouping."""
    stream = wds.gopen(url)
    with contextlib.closing(stream):
        # reraise handler: the caller decides what a broken shard means (skip + count).
        yield from group_by_keys(tar_file_expander([{"url": url, "stream": stream}]))


def iter_samples(urls: Iterable[str]) -> Iterator[dict]:
    """Every raw sample of ``urls``, shard after shard in file order, read in this process.

    For reads that every rank makes in full, e.g. evaluation on the held-out split (generation
    under ZeRO-3 is collective: all ranks must run the same batches). ``wds.WebDataset`` does not
    fit there: once torch.distributed is initialised with more than one rank it refuses to run
    without a nodesplitter, i.e. it insists on giving each rank a part of the shards.
    """
    for url in urls:
        yield from _read_shard(str(url))
