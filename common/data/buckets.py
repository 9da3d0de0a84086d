"""Aspect-ratio buckets in a dataset's shards (data.prepare_captions --buckets, data.prepare_videos --buckets): each
sample's ``bucket`` field ("WxH") groups the training loader's global batches (common/data/webdataset/stream.py: every
global batch one bucket's), and meta.json ``buckets`` counts each split's samples per shape."""

from __future__ import annotations

from common.errors import DataError


def bucket_of(sample: dict) -> bytes:
    """The training loader's group under data.buckets: the sample's bucket ("WxH"), read undecoded."""
    return sample["bucket"]


def check_batch_fits(cfg, buckets: dict, dp: int, what: str) -> None:
    """One DataError line unless some bucket holds a global batch of training samples (`what`: "images", "clips")."""
    t = cfg.trainer
    need, counts = t.micro_batch_size * t.grad_accum * dp, buckets["samples"].get("train", {})
    if max(counts.values(), default=0) < need:
        raise DataError(
            f"data.buckets: no bucket of data.root={cfg.data.root} holds a global batch of {need} training {what} "
            f"(trainer.micro_batch_size x trainer.grad_accum x {dp} ranks; per bucket: "
            f"{', '.join(f'{k} {n}' for k, n in counts.items())}): lower the batch or build fewer buckets"
        )
