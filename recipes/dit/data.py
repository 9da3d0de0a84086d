"""DiT inputs: image shards (the digits, or an ImageFolder turned into shards by prepare_images) decoded to [-1, 1]
images at `data.image_size`, or a latent cache's posterior moments (data.cache_latents); a split read whole for
evaluation."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from common.config import TrainConfig
from common.data import prepare_dataset
from common.data.dataset import SPLITS, load_dataset_meta
from common.data.webdataset import global_train_loader, iter_samples
from common.diffusion.images import decode_png, to_model_space
from common.diffusion.vae import LATENT_SOURCE, read_moments
from common.distributed import DistInfo
from common.errors import DataError

IMAGE_FOLDER = "image_folder"  # meta.json "source" of an ImageFolder's shards (the prepare_images builder)


def channels_of(meta: dict) -> int:
    """Image channels of a dataset (the digits' meta predates the key: grayscale)."""
    return int(meta.get("channels", 1))


def class_names(meta: dict) -> list[str]:
    return list(meta.get("classes") or [str(c) for c in range(meta["num_classes"])])


def decode_image(sample: dict, channels: int = 1) -> tuple[np.ndarray, int]:
    """Raw shard sample -> (uint8 image [H, W] (channels=1) or [H, W, 3], class label)."""
    return decode_png(sample["png"], channels), int(sample["cls"])  # int() takes the raw b"3" as well as 3


def decode_sample(sample: dict, image_size: int, channels: int = 1) -> dict:
    """The training loader's decode: {"image": float [C, S, S] in [-1, 1], "label": int}."""
    image, label = decode_image(sample, channels)
    return {"image": to_model_space(torch.from_numpy(image)[None], image_size)[0], "label": label}


def decode_latent_sample(sample: dict) -> dict:
    """A latent cache sample: {"mean", "std": float [C, h, w], "label": int}."""
    mean, std = read_moments(sample)
    return {"mean": mean, "std": std, "label": int(sample["cls"])}


def load_split_arrays(root: str | Path, split: str, max_per_class: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One split of the image dataset in ``root``, read in shard order (the same on every rank):
    uint8 images [N, H, W] or [N, H, W, 3] and int64 labels [N]; at most ``max_per_class`` per class."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    meta = load_dataset_meta(root)
    size, num_classes, channels = meta["image_size"], meta["num_classes"], channels_of(meta)
    images, labels, counts = [], [], np.zeros(num_classes, dtype=np.int64)
    for sample in iter_samples(meta[f"{split}_urls"]):
        image, label = decode_image(sample, channels)
        if image.shape[:2] != (size, size) or not 0 <= label < num_classes:
            raise DataError(
                f"{sample['__url__']}: sample {sample['__key__']} is a {image.shape} image of class {label}; "
                f"meta.json says {size}x{size} and classes 0..{num_classes - 1}"
            )
        if max_per_class is not None and counts[label] >= max_per_class:
            if counts.min() >= max_per_class:
                break
            continue
        counts[label] += 1
        images.append(image)
        labels.append(label)
    if max_per_class is None and len(images) != meta["splits"][split]["samples"]:
        raise DataError(
            f"{root}: read {len(images)} {split} samples, meta.json says {meta['splits'][split]['samples']}"
        )
    return np.stack(images), np.asarray(labels, dtype=np.int64)


def prepare_data(cfg: TrainConfig, dist: DistInfo) -> dict:
    """The image dataset's meta on every rank (built by its builder, data.build, if missing)."""
    return check_image_size(cfg, prepare_dataset(cfg.data, dist))


def check_image_size(cfg: TrainConfig, meta: dict) -> dict:
    """`meta` if its images suit data.image_size: the digits are upscaled from 8x8 by design, an image
    folder's shards must have been built at that size (no silent resampling of a user's images)."""
    if meta.get("source") == IMAGE_FOLDER and meta["image_size"] != cfg.data.image_size:
        raise DataError(
            f"data.root={cfg.data.root} holds {meta['image_size']}x{meta['image_size']} images but "
            f"data.image_size={cfg.data.image_size}: set data.image_size={meta['image_size']} or rebuild the "
            f"shards with prepare_images --image-size {cfg.data.image_size}"
        )
    return meta


def load_latent_meta(cfg: TrainConfig, vae: dict, images: dict) -> dict:
    """meta.json of the latent cache at data.latents, checked against this run: the same VAE, image
    size and class count as the images at data.root (`vae`: vae_identity of diffusion.vae). One
    DataError line naming the rebuild otherwise."""
    root = Path(cfg.data.latents).expanduser()
    meta = load_dataset_meta(root)
    rebuild = (
        f"rebuild it: python -m data.cache_latents recipe={cfg.recipe.name} data.root={cfg.data.root} "
        f"diffusion.vae={cfg.diffusion.vae} data.image_size={cfg.data.image_size} --out {cfg.data.latents}"
    )
    if meta.get("source") != LATENT_SOURCE:
        raise DataError(
            f"data.latents={cfg.data.latents} is not a latent cache (meta.json source "
            f"{meta.get('source')!r}); build one with python -m data.cache_latents"
        )
    differs = [
        what
        for what, have, want in (
            ("VAE", meta.get("vae"), vae),
            ("image size", meta.get("image_size"), cfg.data.image_size),
            ("classes", meta.get("num_classes"), images["num_classes"]),
        )
        if have != want
    ]
    if differs:
        raise DataError(
            f"data.latents={cfg.data.latents} was encoded with another {' and '.join(differs)} than this "
            f"run's (diffusion.vae={cfg.diffusion.vae}, data.image_size={cfg.data.image_size}); {rebuild}"
        )
    return meta


def build_train_loader(cfg: TrainConfig, urls: list[str], meta: dict, *, rank: int, dp: int):
    """The resumable loader over image shards, or over a latent cache's shards (meta from load_latent_meta): one
    global sample stream, data-parallel rank `rank`'s share of each step of `dp` (common/data/webdataset/:
    GlobalBatches; ZeRO's dp is the world size / parallel.cp: the cp ranks of a group read the same samples)."""
    if meta.get("source") == LATENT_SOURCE:
        decode = decode_latent_sample
    else:
        decode = functools.partial(decode_sample, image_size=cfg.data.image_size, channels=channels_of(meta))
    return global_train_loader(cfg, urls, decode=decode, rank=rank, dp=dp)


def latent_cache(cfg: TrainConfig, device: str):
    """The DiT's latent cache (data/cache_latents.py; the spec's latent_cache_module): diffusion.vae's posterior
    moments of every image, with its class."""
    from common.diffusion.latents import CachePlan
    from common.diffusion.vae import MOMENTS, load_vae, moments_record, posterior, vae_geometry, vae_identity

    if not cfg.diffusion.vae:
        raise ValueError("a DiT's latent cache needs diffusion.vae=<an AutoencoderKL folder>")
    images = check_image_size(cfg, load_dataset_meta(Path(cfg.data.root).absolute()))
    geometry = vae_geometry(cfg.diffusion.vae, cfg.data.image_size)
    if geometry.image_channels != channels_of(images):
        raise ValueError(
            f"data.root={cfg.data.root} holds {channels_of(images)}-channel images; the VAE in "
            f"diffusion.vae={cfg.diffusion.vae} encodes {geometry.image_channels}-channel ones"
        )
    fields = {
        "vae_path": str(geometry.path),
        "latent_channels": geometry.latent_channels,
        "latent_size": geometry.latent_size,
        "scaling_factor": geometry.scaling_factor,
        "shift_factor": geometry.shift_factor,
        "num_classes": images["num_classes"],
        "classes": class_names(images),
    }

    def encoders():
        vae = load_vae(geometry, torch.device(device))

        def encode(batch: list[dict]) -> list[dict]:
            mean, std = posterior(vae, torch.stack([b["image"] for b in batch]).to(device))
            return [{MOMENTS: m, "cls": b["label"]} for b, m in zip(batch, moments_record(mean, std))]

        decode = functools.partial(decode_sample, image_size=cfg.data.image_size, channels=channels_of(images))
        return decode, encode, {}

    settings = {"image_size": cfg.data.image_size, "vae": vae_identity(cfg.diffusion.vae)}
    return CachePlan(images, settings, fields, encoders)
