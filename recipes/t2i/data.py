"""Text-to-image inputs: captioned image shards (python -m data.prepare_captions) decoded to RGB images in [-1, 1]
at `data.image_size` with their captions, or the cache of the frozen encoders' outputs on them (data.latents:
python -m data.cache_latents): per sample the VAE posterior's moments, the caption and its prompt embedding; the
empty prompt's embedding once, beside them."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from common.config import TrainConfig
from common.data import prepare_dataset
from common.data.buckets import bucket_of, check_batch_fits
from common.data.captions import SOURCE, skip_summary
from common.data.dataset import load_dataset_meta
from common.data.webdataset import global_train_loader
from common.diffusion import prompts
from common.diffusion.images import decode_png, to_model_space
from common.diffusion.prompts import EMPTY_PROMPT, decode_cached
from common.diffusion.vae import LATENT_SOURCE
from common.distributed import DistInfo
from common.errors import DataError

CAPTIONED = SOURCE  # meta.json "source" of data.prepare_captions' shards (common/data/captions.py)
# A cache sample's prompt embedding (float32 arrays of the values the encoders gave in the compute dtype, so casting
# back is exact), by the transformer's argument names; the empty prompt's, once per cache, in
# EMPTY_PROMPT (common/diffusion/prompts.py).
TEXT_FIELDS = {"encoder_hidden_states": "context.npy", "pooled_projections": "pooled.npy"}


def prepare_data(cfg: TrainConfig, dist: DistInfo) -> dict:
    """The caption shards' meta on every rank (built by data.build if missing), checked against this run."""
    return check_captions(cfg, prepare_dataset(cfg.data, dist), dp=dist.world_size)


def check_captions(cfg: TrainConfig, meta: dict, dp: int | None = None) -> dict:
    """`meta` if it is data.prepare_captions' shards at data.image_size, bucketed as data.buckets says, with no more
    skipped images than data.max_bad_samples; one DataError line otherwise. `dp`: a training run's data-parallel
    ranks (None: the latent cache's build, which takes square images only)."""
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
    limit, skipped = cfg.data.max_bad_samples, sum(map(len, meta.get("skipped", {}).values()))
    if limit is not None and skipped > limit:
        raise DataError(
            f"data.root={cfg.data.root}: {skip_summary(meta)} when it was built, more than data.max_bad_samples="
            f"{limit}: fix or remove those images and rebuild, or raise data.max_bad_samples"
        )
    check_buckets(cfg, meta, dp)
    return meta


def check_buckets(cfg: TrainConfig, meta: dict, dp: int | None) -> None:
    """One DataError / ConfigError line unless the shards are bucketed exactly when data.buckets says so, a global
    batch fits in some bucket's training samples and every bucket's shape fits model.init_from's VAE and patching."""
    buckets = meta.get("buckets")
    if buckets and dp is None:
        raise DataError(
            f"data.root={cfg.data.root} holds aspect-ratio buckets; a latent cache (data.cache_latents) takes square "
            "images only: train on the buckets without data.latents"
        )
    if dp is None:
        return
    if cfg.data.buckets and not buckets:
        raise DataError(
            f"data.buckets=true but data.root={cfg.data.root} holds square images: rebuild it with python -m "
            f"data.prepare_captions --input <images> --image-size {cfg.data.image_size} --buckets --out <data.root>"
        )
    if buckets and not cfg.data.buckets:
        raise DataError(
            f"data.root={cfg.data.root} holds aspect-ratio buckets ({', '.join(buckets['samples']['train'])}): set "
            "data.buckets=true, or rebuild it without --buckets"
        )
    if not buckets:
        return
    check_batch_fits(cfg, buckets, dp, "images")
    folder = Path(cfg.model.init_from).expanduser()
    if cfg.model.init_from and folder.exists():
        from recipes.t2i.weights import check_patches, pipeline_folder, transformer_config, vae_factor

        folder = pipeline_folder(folder)
        for w, h in buckets["shapes"]:
            for side in (w, h):
                check_patches(
                    transformer_config(folder),
                    vae_factor(folder),
                    side,
                    f"model.init_from={folder}",
                    what=f"data.buckets: data.root={cfg.data.root}'s bucket {w}x{h}",
                )


def decode_captioned(sample: dict, image_size: int | None) -> dict:
    """The training loader's decode: {"image": float [3, S, S] in [-1, 1], "caption": str}; image_size None: as
    stored (a bucket's [3, H, W])."""
    image = decode_png(sample["png"], channels=3)
    caption = sample["txt"]
    return {
        "image": to_model_space(torch.from_numpy(image)[None], image_size or image.shape[1])[0],
        "caption": caption.decode("utf-8") if isinstance(caption, bytes) else caption,
    }


def build_train_loader(cfg: TrainConfig, meta: dict, *, rank: int, dp: int):
    """The resumable loader over the caption shards, or over their cache (meta from load_cache_meta): one global
    sample stream, data-parallel rank `rank`'s share of each step of `dp` (world / parallel.cp: the cp ranks of a
    group read the same samples)."""
    if meta.get("source") == LATENT_SOURCE:
        decode = functools.partial(decode_cached, fields=TEXT_FIELDS)
    else:  # data.buckets: the images as stored, each global batch one bucket's (bucket_of)
        decode = functools.partial(decode_captioned, image_size=None if cfg.data.buckets else cfg.data.image_size)
    group = bucket_of if cfg.data.buckets else None
    return global_train_loader(cfg, meta["train_urls"], decode=decode, rank=rank, dp=dp, group=group)


# What a cache records of the run that may read it and that run checks, besides the pipeline's frozen encoders
# (recipes/t2i/weights.py encoders_identity): the T5 length, the image size and the encoders' compute dtype.
CACHE_KEYS = ("model.max_sequence_length", "data.image_size", "toggles.precision")


def load_cache_meta(cfg: TrainConfig, identity: dict) -> dict:
    """meta.json of the cache at data.latents, checked against this run (common/diffusion/prompts.py)."""
    return prompts.load_cache_meta(cfg, identity, CACHE_KEYS, "text-to-image")


def latent_cache(cfg: TrainConfig, device: str):
    """The text-to-image latent cache (data/cache_latents.py; the spec's latent_cache_module): model.init_from's VAE
    posterior moments of every image, its caption and the caption's prompt embedding, the text encoders run in the
    compute dtype of toggles.precision (what training on the fly would give); the empty prompt's embedding once."""
    from common.diffusion.latents import CachePlan
    from common.diffusion.vae import MOMENTS, load_vae, moments_record, posterior, vae_geometry
    from recipes.t2i.weights import COMPUTE_DTYPES, adapter, encoders_identity, pipeline_folder

    if not cfg.model.init_from:
        raise ValueError(
            "a text-to-image cache needs model.init_from=<a StableDiffusion3Pipeline or FluxPipeline folder>"
        )
    if cfg.toggles.precision not in COMPUTE_DTYPES:
        raise ValueError(
            f"toggles.precision={cfg.toggles.precision}: a cache is made in one of {', '.join(COMPUTE_DTYPES)}"
        )
    base = pipeline_folder(cfg.model.init_from)
    images = check_captions(cfg, load_dataset_meta(Path(cfg.data.root).absolute()))
    geometry = vae_geometry(base / "vae", cfg.data.image_size)
    fields = {
        "vae_path": str(geometry.path),
        "latent_channels": geometry.latent_channels,
        "latent_size": geometry.latent_size,
    }

    def encoders():
        vae = load_vae(geometry, torch.device(device))
        prompts = adapter(base).prompt_encoder(
            device=torch.device(device),
            dtype=COMPUTE_DTYPES[cfg.toggles.precision],
            max_sequence_length=cfg.model.max_sequence_length,
        )

        def encode(batch: list[dict]) -> list[dict]:
            mean, std = posterior(vae, torch.stack([b["image"] for b in batch]).to(device))
            captions = [b["caption"] for b in batch]
            text = {TEXT_FIELDS[k]: v.float().cpu().numpy() for k, v in prompts(captions).items()}
            return [
                {MOMENTS: m, "txt": c, **{name: np.ascontiguousarray(a[i]) for name, a in text.items()}}
                for i, (c, m) in enumerate(zip(captions, moments_record(mean, std)))
            ]

        empty = {k: v[0].float().cpu().numpy() for k, v in prompts([""]).items()}  # caption dropout's prompt
        decode = functools.partial(decode_captioned, image_size=cfg.data.image_size)
        return decode, encode, {EMPTY_PROMPT: empty}

    settings = prompts.cache_settings(cfg, encoders_identity(base), CACHE_KEYS)
    return CachePlan(images, settings, fields, encoders, holds=", prompt embeddings")
