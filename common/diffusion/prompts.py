"""What the text-conditioned diffusion families (text-to-image, video) do alike with prompts on a latent cache: a
cache sample's posterior moments, caption and prompt embedding read back (`decode_cached`), the sample prompts (the
first held-out captions), and the prompt encoder of a run on a cache (`CachedPrompts`: embeddings read from it, the
text encoders loaded only for a prompt it does not hold). A family names its embedding's fields: transformer
argument -> the array's name in a cache sample (text-to-image: encoder_hidden_states and pooled_projections; Wan:
encoder_hidden_states)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from common.data.webdataset import iter_samples
from common.diffusion.vae import read_moments

EMPTY_PROMPT = "empty_prompt.npz"  # the empty prompt's embedding, once per cache (caption dropout)


def caption_of(sample: dict) -> str:
    caption = sample["txt"]
    return caption.decode("utf-8") if isinstance(caption, bytes) else caption


def decode_cached(sample: dict, fields: dict[str, str]) -> dict:
    """A cache sample: {"mean", "std": float [C, ...], "caption": str, and the prompt embedding's `fields`}."""
    mean, std = read_moments(sample)
    text = {key: torch.from_numpy(np.load(io.BytesIO(sample[name]))) for key, name in fields.items()}
    return {"mean": mean, "std": std, "caption": caption_of(sample), **text}


def first_samples(meta: dict, n: int) -> tuple[list[dict], str]:
    """The first `n` held-out samples (in shard order, the same on every rank) and "val"; when the val split holds
    none (a small folder whose held-out samples did not decode), the first `n` training samples and "train"."""
    for split in ("val", "train"):
        samples = [sample for _, sample in zip(range(n), iter_samples(meta[f"{split}_urls"]))]
        if samples:
            return samples, split
    return [], "train"


def sample_prompts(meta: dict, n: int) -> tuple[list[str], str]:
    """The prompts of sample grids and the split they come from: `first_samples`' captions."""
    samples, split = first_samples(meta, n)
    return [caption_of(s) for s in samples], split


class CachedPrompts:
    """The prompt encoder of a run on a cache: the embeddings of the empty prompt and of the sample prompts
    (`sample_prompts` on the cache: its first `n` validation captions, or its first `n` training captions when its
    val split is empty), read from the cache; the text encoders are not loaded for training. A prompt it does not hold
    (an eval's held-out phrasings) loads them then, once: `load()` -> the family's prompt encoder."""

    def __init__(self, root: str | Path, meta: dict, n: int, fields: dict[str, str], *, device, dtype, load):
        with np.load(Path(root).expanduser() / EMPTY_PROMPT) as empty:
            self.table = {"": {key: torch.from_numpy(empty[key]) for key in fields}}
        for sample in first_samples(meta, n)[0]:
            cached = decode_cached(sample, fields)
            self.table[cached["caption"]] = {key: cached[key] for key in fields}
        self.fields, self.device, self.dtype, self.load, self.encoder = fields, device, dtype, load, None

    def __call__(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        if any(p not in self.table for p in prompts):
            if self.encoder is None:
                self.encoder = self.load()
            return self.encoder(prompts)
        return {
            key: torch.stack([self.table[p][key] for p in prompts]).to(self.device, self.dtype) for key in self.fields
        }


# ---- the cache's settings: what a run on it must match ---------------------------------------------------------
def cache_settings(cfg, identity: dict, keys: tuple[str, ...]) -> dict:
    """What a cache records of the run that may read it, and what that run checks: the pipeline's frozen encoders
    (`identity`: the family's encoders_identity) and the values of the dotted config `keys` (by their last name)."""
    out = {"encoders": identity}
    for key in keys:
        section, name = key.split(".")
        out[name] = getattr(getattr(cfg, section), name)
    return out


def load_cache_meta(cfg, identity: dict, keys: tuple[str, ...], kind: str) -> dict:
    """meta.json of the cache at data.latents, checked against this run (`identity`, `keys`: cache_settings'; `kind`:
    the family, for the message): one DataError line naming what differs and the rebuild otherwise."""
    from common.data.dataset import load_dataset_meta
    from common.diffusion.vae import LATENT_SOURCE
    from common.errors import DataError

    meta = load_dataset_meta(Path(cfg.data.latents).expanduser())
    if meta.get("source") != LATENT_SOURCE or "encoders" not in meta:
        raise DataError(
            f"data.latents={cfg.data.latents} is not a {kind} cache (meta.json source {meta.get('source')!r}); "
            "build one with python -m data.cache_latents recipe=<this recipe> ... --out DIR"
        )
    want = cache_settings(cfg, identity, keys)
    differs = [
        f"model.init_from's {name}"
        for name in sorted(set(want["encoders"]) | set(meta["encoders"]))
        if want["encoders"].get(name) != meta["encoders"].get(name)
    ]
    differs += [
        f"{key}={want[key.split('.')[1]]} (the cache's: {meta.get(key.split('.')[1])})"
        for key in keys
        if meta.get(key.split(".")[1]) != want[key.split(".")[1]]
    ]
    if differs:
        settings = " ".join(f"{key}={want[key.split('.')[1]]}" for key in keys)
        raise DataError(
            f"data.latents={cfg.data.latents} was made with other settings than this run's: {'; '.join(differs)}; "
            f"rebuild it: python -m data.cache_latents recipe={cfg.recipe.name} model.init_from={cfg.model.init_from} "
            f"data.root={cfg.data.root} {settings} --out {cfg.data.latents} --force"
        )
    return meta
