"""DiT inputs: digit shards decoded to [-1, 1] images at `data.image_size` plus class labels; a whole split for evaluation."""

from __future__ import annotations

import functools
import io
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from common.config import TrainConfig
from common.data import prepare_dataset
from common.data.dataset import SPLITS, load_dataset_meta
from common.data.webdataset import build_webdataset_loader, iter_samples
from common.distributed import DistInfo
from common.errors import DataError


def to_model_space(images_u8: torch.Tensor, image_size: int) -> torch.Tensor:
    """uint8 [N, H, W] -> float [N, 1, S, S] in [-1, 1], bilinear upscaling (8x8 digits are coarse)."""
    x = images_u8.float().div(127.5).sub(1.0).unsqueeze(1)
    if x.shape[-1] != image_size:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    return x.clamp(-1.0, 1.0)


def decode_digit(sample: dict) -> tuple[np.ndarray, int]:
    """Raw shard sample -> (grayscale image as uint8 [H, W] in 0..255, class label)."""
    with Image.open(io.BytesIO(sample["png"])) as im:
        image = np.array(im.convert("L"), dtype=np.uint8)  # a writable copy: torch.from_numpy warns on PIL's read-only view
    return image, int(sample["cls"])  # int() takes the raw b"3" as well as 3


def decode_sample(sample: dict, image_size: int) -> dict:
    """The training loader's decode: {"image": float [1, S, S] in [-1, 1], "label": int}."""
    image, label = decode_digit(sample)
    return {"image": to_model_space(torch.from_numpy(image)[None], image_size)[0], "label": label}


def load_split_arrays(root: str | Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """One split of the dataset in ``root``, read whole in shard order (the same on every rank):
    uint8 images [N, H, W] (0..255) and int64 labels [N]."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    meta = load_dataset_meta(root)
    size, num_classes = meta["image_size"], meta["num_classes"]
    images, labels = [], []
    for sample in iter_samples(meta[f"{split}_urls"]):
        image, label = decode_digit(sample)
        if image.shape != (size, size) or not 0 <= label < num_classes:
            raise DataError(f"{sample['__url__']}: sample {sample['__key__']} is a {image.shape} image of class {label}; "
                            f"meta.json says {size}x{size} and classes 0..{num_classes - 1}")
        images.append(image)
        labels.append(label)
    if len(images) != meta["splits"][split]["samples"]:
        raise DataError(f"{root}: read {len(images)} {split} samples, meta.json says {meta['splits'][split]['samples']}")
    return np.stack(images), np.asarray(labels, dtype=np.int64)


def prepare_data(cfg: TrainConfig, dist: DistInfo) -> dict:
    """The digit shards' meta on every rank (built by the dataset's builder, data.build, if missing)."""
    return prepare_dataset(cfg.data, dist)


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
