"""`data.latents=auto` (the GPU presets' default, DiT and text-to-image alike): train from the latent cache beside the
images when there is one, else encode every batch on the fly with one note saying how to make the cache.

The cache's place is the one data.cache_latents' usage names: `<data.root>_latents` (data/my_images ->
data/my_images_latents). Resolved when the config is composed, so config.yaml, run.dry_run and scripts/plan.py see
what the run does: the cache's folder, or "" (on the fly). A cache that is there but was made for another VAE, image
size, encoders or precision is still taken: the trainer refuses it with one line naming the rebuild, as for an
explicit data.latents=DIR. An explicit folder that does not exist is refused with one line (`missing_cache`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

AUTO = "auto"
CACHE_SUFFIX = "_latents"
META = "meta.json"  # common/data/dataset.py META_NAME: a complete cache has it (written last)


def default_cache(root: str) -> Path:
    """Where `data.latents=auto` looks for the cache of the images at `root`."""
    return Path(f"{str(root).rstrip('/')}{CACHE_SUFFIX}").expanduser()


def why_on_the_fly(cfg) -> str:
    """Why this run's data cannot come from a cache whatever exists ("" when it can)."""
    if getattr(cfg.data, "buckets", False):
        return "data.buckets=true (a latent cache holds square images only)"
    return ""


def resolve(cfg, *, note: bool) -> None:
    """data.latents=auto, in place: the default cache's folder when it holds a complete cache (its meta.json), else
    "" (encode on the fly). `note`: print the one `kiln: note:` line for the on-the-fly case (a training launch)."""
    data = cfg.data
    if getattr(data, "latents", None) != AUTO:
        return
    cache = default_cache(data.root)
    why = why_on_the_fly(cfg)
    if not why and (cache / META).is_file():
        data.latents = str(cache)
        return
    data.latents = ""
    if note and os.environ.get("RANK", "0") == "0":
        make = f"python -m data.cache_latents recipe={cfg.recipe.name} data.root={data.root} ... --out {cache}"
        reason = why or f"no latent cache at {cache} ({make} makes one)"
        print(
            f"kiln: note: data.latents=auto: encoding every batch through the frozen encoders on the fly; {reason}",
            file=sys.stderr,
            flush=True,
        )


def missing_cache(cfg) -> str | None:
    """The one line for an explicit data.latents folder that holds no cache, else None."""
    latents = getattr(cfg.data, "latents", "")
    if not latents or latents == AUTO or (Path(latents).expanduser() / META).is_file():
        return None
    return (
        f"data.latents={latents} holds no latent cache (no {META}); build it with python -m data.cache_latents "
        f"recipe={cfg.recipe.name} data.root={cfg.data.root} ... --out {latents}, or leave data.latents empty to "
        "encode on the fly"
    )


@dataclass
class CachePlan:
    """What data/cache_latents.py builds for one run (its family's `latent_cache(cfg, device)`, named by the spec's
    latent_cache_module): `images`, the checked meta of the dataset it encodes; `settings`, what a cache must match to
    be reused (meta.json keeps them; training compares them); `fields`, more of meta.json (the VAE's geometry, the
    classes); `encoders()` loads the frozen encoders and gives (decode, encode, files): decode turns a shard sample into
    the encoders' input, encode a list of those into cache records, files are arrays saved once beside the shards
    ({name: {array name: array}}, e.g. the empty prompt's embedding); `holds` names what a record holds besides the
    posterior's moments."""

    images: dict
    settings: dict
    fields: dict
    encoders: Callable[[], tuple[Callable, Callable, dict]]
    holds: str = ""
