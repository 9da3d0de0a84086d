"""Video inputs: video-caption shards (python -m data.prepare_videos) decoded to clips [3, F, H, W] in [-1, 1] with
their captions, or the cache of the frozen encoders' outputs on them (data.latents: python -m data.cache_latents): per
clip the VAE posterior's moments [2, C, f, h, w], the caption and its UMT5 embedding; the empty prompt's once."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from common.config import TrainConfig
from common.data import prepare_dataset
from common.data.buckets import bucket_of, check_batch_fits
from common.data.captions import skip_summary
from common.data.dataset import load_dataset_meta
from common.data.video import SOURCE, decode_video_sample
from common.data.webdataset import global_train_loader
from common.diffusion import prompts
from common.diffusion.prompts import EMPTY_PROMPT, decode_cached
from common.diffusion.vae import LATENT_SOURCE
from common.distributed import DistInfo
from common.errors import DataError

TEXT_FIELDS = {
    "encoder_hidden_states": "context.npy"
}  # a cache sample's UMT5 embedding (float32 of the dtype's values)
# What a cache records of the run that may read it and that run checks, besides the VAE's and UMT5's identity
# (recipes/video/weights.py encoders_identity).
CACHE_KEYS = (
    "model.max_sequence_length",
    "data.num_frames",
    "data.height",
    "data.width",
    "toggles.precision",
)


def prepare_data(cfg: TrainConfig, dist: DistInfo, dp: int) -> dict:
    """The clip shards' meta on every rank (built by data.build if missing), checked against this run (`dp`: its
    data-parallel ranks)."""
    meta = check_clips(cfg, prepare_dataset(cfg.data, dist))
    check_buckets(cfg, meta, dp)
    return meta


def check_buckets(cfg: TrainConfig, meta: dict, dp: int) -> None:
    """One line unless the shards are bucketed exactly when data.buckets says so, a global batch fits in some bucket
    and every bucket's shape fits model.init_from's VAE and patches."""
    buckets, d = meta.get("buckets"), cfg.data
    if d.buckets and not buckets:
        raise DataError(
            f"data.buckets=true but data.root={d.root} holds one clip shape: rebuild it with python -m "
            "data.prepare_videos ... --buckets, or set data.buckets=false"
        )
    if buckets and not d.buckets:
        raise DataError(
            f"data.root={d.root} holds aspect-ratio buckets ({', '.join(buckets['samples']['train'])}): set "
            "data.buckets=true, or rebuild it without --buckets"
        )
    if not buckets:
        return
    check_batch_fits(cfg, buckets, dp, "clips")
    from recipes.video.sizing import architecture

    arch = architecture(cfg.model.init_from)
    for w, h in buckets["shapes"]:
        arch.check_clip(d.num_frames, h, w)


def check_clips(cfg: TrainConfig, meta: dict) -> dict:
    """`meta` if it is data.prepare_videos' shards of data.num_frames x data.height x data.width clips (of about that
    many pixels when bucketed) with no more skipped clips than data.max_bad_samples; one DataError line otherwise."""
    d = cfg.data
    if meta.get("source") != SOURCE:
        raise DataError(
            f"data.root={d.root} holds no video clips (meta.json source {meta.get('source')!r}); build them with "
            "python -m data.prepare_videos --input <clips with captions> --out <data.root>"
        )
    have = tuple(meta.get(k) for k in ("num_frames", "height", "width"))
    if have != (d.num_frames, d.height, d.width):
        raise DataError(
            f"data.root={d.root} holds clips of {have[0]} frames x {have[1]} x {have[2]} but the run reads "
            f"data.num_frames={d.num_frames} data.height={d.height} data.width={d.width}: set those or rebuild the "
            "shards with prepare_videos --num-frames/--height/--width"
        )
    limit, skipped = d.max_bad_samples, sum(map(len, meta.get("skipped", {}).values()))
    if limit is not None and skipped > limit:
        raise DataError(
            f"data.root={d.root}: {skip_summary(meta)} when it was built, more than data.max_bad_samples={limit}: "
            "fix or remove those clips and rebuild, or raise data.max_bad_samples"
        )
    return meta


def build_train_loader(cfg: TrainConfig, meta: dict, *, rank: int, dp: int):
    """The resumable loader over the clip shards, or over their cache (meta from load_cache_meta): one global sample
    stream, data-parallel rank `rank`'s share of each step of `dp` (world / parallel.cp: the cp ranks of a group read
    the same samples)."""
    if meta.get("source") == LATENT_SOURCE:
        decode = functools.partial(decode_cached, fields=TEXT_FIELDS)
    else:  # data.buckets: the clips as stored, each global batch one bucket's (bucket_of)
        decode = decode_video_sample
    group = bucket_of if cfg.data.buckets else None
    return global_train_loader(cfg, meta["train_urls"], decode=decode, rank=rank, dp=dp, group=group)


def load_cache_meta(cfg: TrainConfig, identity: dict) -> dict:
    """meta.json of the cache at data.latents, checked against this run (common/diffusion/prompts.py)."""
    return prompts.load_cache_meta(cfg, identity, CACHE_KEYS, "video")


def latent_cache(cfg: TrainConfig, device: str):
    """The video latent cache (data/cache_latents.py; the spec's latent_cache_module): model.init_from's VAE posterior
    moments of every clip, its caption and the caption's UMT5 embedding in the compute dtype of toggles.precision
    (what training on the fly gives); the empty prompt's embedding once."""
    from common.diffusion.latents import CachePlan
    from common.diffusion.vae import MOMENTS, moments_record
    from common.errors import ConfigError
    from recipes.video.weights import (
        COMPUTE_DTYPES,
        PromptEncoder,
        VideoVae,
        encoders_identity,
        load_vae,
        pipeline_folder,
        posterior,
    )

    if not cfg.model.init_from:
        raise ConfigError("a video cache needs model.init_from=<a WanPipeline folder>")
    if cfg.toggles.precision not in COMPUTE_DTYPES:
        raise ConfigError(
            f"toggles.precision={cfg.toggles.precision}: a cache is made in one of {', '.join(COMPUTE_DTYPES)}"
        )
    base = pipeline_folder(cfg.model.init_from)
    clips = check_clips(cfg, load_dataset_meta(Path(cfg.data.root).absolute()))
    if clips.get("buckets"):
        raise ConfigError(
            f"data.root={cfg.data.root} holds aspect-ratio buckets; a latent cache holds one clip shape: train on the "
            "buckets without data.latents"
        )
    geometry = VideoVae.of(base)
    fields = {"latent_shape": list(geometry.latent_shape(cfg.data.num_frames, cfg.data.height, cfg.data.width))}

    def encoders():
        vae = load_vae(base, torch.device(device))
        encode_prompts = PromptEncoder(
            base,
            device=torch.device(device),
            dtype=COMPUTE_DTYPES[cfg.toggles.precision],
            max_sequence_length=cfg.model.max_sequence_length,
        )

        def encode(batch: list[dict]) -> list[dict]:
            mean, std = posterior(vae, torch.stack([b["video"] for b in batch]).to(device))
            captions = [b["caption"] for b in batch]
            text = {TEXT_FIELDS[k]: v.float().cpu().numpy() for k, v in encode_prompts(captions).items()}
            return [
                {MOMENTS: m, "txt": c, **{name: np.ascontiguousarray(a[i]) for name, a in text.items()}}
                for i, (c, m) in enumerate(zip(captions, moments_record(mean, std)))
            ]

        empty = {k: v[0].float().cpu().numpy() for k, v in encode_prompts([""]).items()}  # caption dropout's prompt
        return decode_video_sample, encode, {EMPTY_PROMPT: empty}

    settings = prompts.cache_settings(cfg, encoders_identity(base), CACHE_KEYS)
    return CachePlan(clips, settings, fields, encoders, holds=", prompt embeddings")
