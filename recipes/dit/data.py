"""DiT inputs: digit shards decoded to [-1, 1] images at `data.image_size`, plus class labels."""

from __future__ import annotations

import functools
import io

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from common.config import TrainConfig
from common.data import prepare_dataset
from common.data.webdataset import build_webdataset_loader
from common.distributed import DistInfo


def to_model_space(images_u8: torch.Tensor, image_size: int) -> torch.Tensor:
    """uint8 [N, H, W] -> float [N, 1, S, S] in [-1, 1], bilinear upscaling (8x8 digits are coarse)."""
    x = images_u8.float().div(127.5).sub(1.0).unsqueeze(1)
    if x.shape[-1] != image_size:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    return x.clamp(-1.0, 1.0)


def decode_sample(sample: dict, image_size: int) -> dict:
    image = np.array(Image.open(io.BytesIO(sample["png"])).convert("L"))
    return {
        "image": to_model_space(torch.from_numpy(image)[None], image_size)[0],
        "label": int(sample["cls"].decode() if isinstance(sample["cls"], bytes) else sample["cls"]),
    }


def prepare_data(cfg: TrainConfig, dist: DistInfo) -> dict:
    """The digit shards' meta on every rank (rank 0 builds them if missing)."""
    from data.prepare_digits import ensure_digits_shards

    return prepare_dataset(cfg.data, dist, lambda: ensure_digits_shards(cfg.data.root), "data.prepare_digits")


def build_train_loader(cfg: TrainConfig, dist: DistInfo, urls: list[str]):
    return build_webdataset_loader(
        urls,
        decode=functools.partial(decode_sample, image_size=cfg.data.image_size),
        batch_size=cfg.trainer.micro_batch_size,
        rank=dist.rank,
        world_size=dist.world_size,
        num_workers=cfg.data.num_workers,
        seed=cfg.trainer.seed,
        shuffle_buffer=cfg.data.shuffle_buffer,
        max_corrupt_shards=cfg.data.max_corrupt_shards,
    )
