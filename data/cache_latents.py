"""Encode a diffusion run's shards once with its frozen encoders into a cache that training reads with data.latents=DIR
(the GPU presets' data.latents=auto reads the one at <data.root>_latents, the --out below, by itself).

    python -m data.cache_latents recipe=dit_xl2 data.root=data/my_images diffusion.vae=~/models/sd-vae-ft-mse
                                 --out data/my_images_latents [--batch-size 64] [--device cpu|cuda] [--force]

Arguments with `=` are the run's config overrides (the same as scripts/train.py's): they say which
images (data.root, data.image_size) and which VAE (diffusion.vae). Each sample keeps its key and
class and stores the VAE posterior's mean and std (``moments.npy``: float32 [2, C, h, w]), not one
sampled latent, so training still draws a fresh latent from the posterior every epoch, as fast-DiT
does. The cache mirrors the image dataset shard for shard (same names, same samples in the same
order), so the training loader's shuffle, resume position and corrupt-shard handling are the same
as on the images, and a run on the cache sees the same batches as one that encodes on the fly.

A text-to-image run's cache (recipe=t2i_* model.init_from=<pipeline folder>) also holds each sample's caption and
its prompt embedding from the pipeline's text encoders, run in toggles.precision's compute dtype (float32 arrays of
those values: recipes/t2i/data.py TEXT_FIELDS), and the empty prompt's once (common/diffusion/prompts.py
EMPTY_PROMPT, caption dropout); its meta.json records the text encoders and VAE (config + weights fingerprint),
model.max_sequence_length, the image size and the precision, and a run with other ones stops with one line. For a DiT,
meta.json records the VAE (its config and a digest of its weights), the image size and the
classes; training refuses a cache made by another VAE or at another size. A shard that cannot be
read to its end is cached up to where it broke, counted and named in meta.json (``corrupt_shards``);
if no sample can be read the cache is not written. Like the dataset builders, DIR appears at once
with meta.json written last; a complete cache with the same settings is left alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from common.data.dataset import META_NAME, SPLITS, read_meta, run_builder
from data import cli, shards


def _parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m data.cache_latents", description=__doc__.splitlines()[0])
    parser.add_argument(
        "overrides", nargs="*", help="config overrides, e.g. recipe=dit_xl2 data.root=DIR diffusion.vae=DIR"
    )
    parser.add_argument("--out", required=True, type=Path, help="the latent cache directory (created)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per VAE forward")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete cache is there (replaces DIR)")
    args = parser.parse_intermixed_args(argv)  # overrides before or after the options
    bad = [a for a in args.overrides if "=" not in a]
    if bad:
        parser.error(f"not a key=value override: {' '.join(bad)}")
    return args, args.overrides


def encode_shard(url: str, out: Path, *, decode, encode, batch_size: int, bar) -> dict:
    """One shard -> one cache shard of the same name: {"name", "samples", "bytes", "error"}. `decode` turns a raw
    sample into the encoders' input, `encode` a list of those into each sample's cached fields."""
    import webdataset as wds

    from common.data.webdataset import iter_samples

    name, written, error = os.path.basename(url), 0, None
    pending: list[tuple[str, dict]] = []

    def flush(sink) -> None:
        nonlocal written
        if not pending:
            return
        for (key, _), fields in zip(pending, encode([decoded for _, decoded in pending])):
            sink.write({"__key__": key, **fields})
        written += len(pending)
        bar.update(len(pending))
        pending.clear()

    with wds.TarWriter(str(out / name), mtime=0) as sink:
        try:
            for sample in iter_samples([url]):
                pending.append((sample["__key__"], decode(sample)))
                if len(pending) == batch_size:
                    flush(sink)
        except Exception as exc:  # a truncated or corrupt tar, or a sample that does not decode
            error = f"{type(exc).__name__}: {str(exc.args[0] if exc.args else exc).split(' @ ')[0]}"
        flush(sink)
    return {"name": name, "samples": written, "bytes": (out / name).stat().st_size, "error": error}


def build_cache(cfg, plan, out: Path, *, batch_size: int, force: bool) -> tuple[dict | None, int]:
    """(meta, 0) after building; (None, exit code) when a cache is already there or on an error. `plan`: the
    family's common.diffusion.latents.CachePlan for this run."""
    import numpy as np
    from tqdm.auto import tqdm

    from common.diffusion.vae import LATENT_SOURCE

    root = Path(cfg.data.root).absolute()
    images = plan.images
    wanted = {"data_root": str(root), **plan.settings}
    existing = read_meta(out)
    if existing is not None and not force:
        if {k: existing.get(k) for k in wanted} == wanted:
            return None, cli.nothing_to_do(out)
        print(
            f"error: {out} already holds a latent cache of other images, size or encoders; pass --force to rebuild",
            file=sys.stderr,
        )
        return None, 1
    if existing is None and out.is_dir() and any(out.iterdir()):
        raise ValueError(
            f"{out} is not empty and holds no complete latent cache; choose an empty directory or pass --force"
        )

    decode, encode, files = plan.encoders()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        meta = {"source": LATENT_SOURCE, **wanted, **plan.fields, "splits": {}, "corrupt_shards": {}}
        for name, arrays in files.items():  # e.g. the text-to-image cache's empty prompt embedding (caption dropout)
            np.savez(tmp / name, **arrays)
        total = sum(images["splits"][s]["samples"] for s in SPLITS)
        with tqdm(total=total, desc="encoding", unit="image", dynamic_ncols=True) as bar:
            for split in SPLITS:
                done = [
                    encode_shard(url, tmp, decode=decode, encode=encode, batch_size=batch_size, bar=bar)
                    for url in images[f"{split}_urls"]
                ]
                meta["corrupt_shards"].update({d["name"]: d["error"] for d in done if d["error"]})
                meta["splits"][split] = {
                    "shards": [d["name"] for d in done],
                    "samples": sum(d["samples"] for d in done),
                    "shard_samples": [d["samples"] for d in done],
                    "shard_bytes": [d["bytes"] for d in done],
                }
        if meta["splits"]["train"]["samples"] == 0:
            raise ValueError(f"no training image of data.root={root} could be read; nothing cached")
        (tmp / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
        os.chmod(tmp, 0o755)
        shards.move_into_place(tmp, out, force=force, dataset="latent cache", read_meta=read_meta)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return meta, 0


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parse_args(argv)
    from common.compose import compose
    from common.errors import UserError
    from recipes import registry

    try:
        cfg = compose(overrides, registry=registry)
        latent_cache = registry.recipe_spec(cfg.recipe.family).latent_cache()
        if latent_cache is None:
            raise ValueError(
                f"recipe={cfg.recipe.name} has no latent cache: a DiT recipe with diffusion.vae=<an AutoencoderKL "
                "folder> or a text-to-image recipe with model.init_from has one"
            )
        if args.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        root = Path(cfg.data.root).absolute()
        if cfg.data.build:  # as training does, on every start: built on first use, shards of other settings refused
            run_builder(cfg.data.build, root)
        plan = latent_cache(cfg, device)
        meta, rc = build_cache(cfg, plan, args.out.absolute(), batch_size=args.batch_size, force=args.force)
    except (UserError, ValueError, FileNotFoundError) as exc:
        return cli.error(exc)
    if meta is None:
        return rc
    splits, bad = meta["splits"], meta["corrupt_shards"]
    shape = meta.get("latent_shape") or [meta["latent_channels"], meta["latent_size"], meta["latent_size"]]
    print(
        f"wrote {args.out}: train {splits['train']['samples']} and val {splits['val']['samples']} latents "
        f"({'x'.join(map(str, shape))} posterior mean + std" + plan.holds + ") from "
        f"{meta['data_root']}"
        + (f"; {len(bad)} corrupt shard(s) cached up to the damage: {', '.join(bad)}" if bad else "")
    )
    return 0


if __name__ == "__main__":
    from common.known_warnings import silence_known_warnings

    silence_known_warnings()
    sys.exit(main())
