"""Data plumbing shared by the recipes: WebDataset loading, packing, dataset preparation."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from common.config import DataConfig
from common.distributed import DistInfo, barrier


def prepare_dataset(data: DataConfig, dist: DistInfo, ensure: Callable[[], dict], cli: str) -> dict:
    """Run `ensure()` (build the dataset if missing, return its meta) on rank 0 first, then on
    the other ranks, which find it built. With `data.prepare=false` a missing dataset is an
    error naming the command that builds it."""
    if dist.is_main:
        if not data.prepare and not (Path(data.root) / "meta.json").exists():
            raise FileNotFoundError(f"data.root={data.root}: no dataset there (build it: python -m {cli} --out {data.root})")
        meta = ensure()
    barrier()
    if not dist.is_main:
        meta = ensure()
    return meta
