"""Text-to-image inputs: captioned image shards (python -m data.prepare_captions) decoded to RGB images in [-1, 1]
at `data.image_size` with their captions."""

from __future__ import annotations

import functools

import torch

from common.config import TrainConfig
from common.data import prepare_dataset
from common.data.webdataset import global_train_loader, iter_samples
from common.diffusion.images import decode_png, to_model_space
from common.distributed import DistInfo
from common.errors import DataError

CAPTIONED = "captioned_images"  # meta.json "source" of data.prepare_captions' shards


def prepare_data(cfg: TrainConfig, dist: DistInfo) -> dict:
    """The caption shards' meta on every rank (built by data.build if missing), checked against this run."""
    meta = prepare_dataset(cfg.data, dist)
    if meta.get("source") != CAPTIONED:
        raise DataError(
            f"data.root={cfg.data.root} holds no captioned images (meta.json source {meta.get('source')!r}); build "
            "them with python -m data.prepare_captions --input <images with captions> --out <data.root>"
        )
    if meta["image_size"] != cfg.data.image_size:
        raise DataError(
            f"data.root={cfg.data.root} holds {meta['image_size']}x{meta['image_size']} images but "
            f"data.image_size={cfg.data.image_size}: set data.image_size={meta['image_size']} or rebuild the shards "
            f"with prepare_captions --image-size {cfg.data.image_size}"
        )
    return meta


def decode_captioned(sample: dict, image_size: int) -> dict:
    """The training loader's decode: {"image": float [3, S, S] in [-1, 1], "caption": str}."""
    image = decode_png(sample["png"], channels=3)
    caption = sample["txt"]
    return {
        "image": to_model_space(torch.from_numpy(image)[None], image_size)[0],
        "caption": caption.decode("utf-8") if isinstance(caption, bytes) else caption,
    }


def build_train_loader(cfg: TrainConfig, dist: DistInfo, meta: dict):
    """The resumable loader over the caption shards: one global sample stream, this rank's share of each step."""
    decode = functools.partial(decode_captioned, image_size=cfg.data.image_size)
    return global_train_loader(cfg, meta["train_urls"], decode=decode, rank=dist.rank, dp=dist.world_size)


def val_captions(meta: dict, n: int) -> list[str]:
    """The first `n` held-out captions (in shard order, the same on every rank): the prompts of sample grids."""
    out = []
    for sample in iter_samples(meta["val_urls"]):
        text = sample["txt"]
        out.append(text.decode("utf-8") if isinstance(text, bytes) else text)
        if len(out) == n:
            break
    return out
