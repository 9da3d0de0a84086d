"""The frozen VAE of latent diffusion: its folder checked from config.json, images to posterior moments, latents,
and back.

A latent is `(z - shift_factor) * scaling_factor` with `z = mean + std * eps` drawn from the VAE's
posterior (the shift only where the VAE's config has one, as in SD3/Flux VAEs); decoding inverts it.
The DiT never sees the VAE's weights: the VAE is frozen, in eval mode and fp32, held by the trainer
beside the DeepSpeed engine, so it is neither in the optimizer nor in the ZeRO partitions.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from common.errors import ConfigError

# What run.dry_run and scripts/plan.py size a latent model with when the VAE folder is not on this
# machine: the Stable Diffusion VAE's shape (stabilityai/sd-vae-ft-mse, SDXL's VAE), 4 channels at 1/8.
ASSUMED_LATENT_CHANNELS, ASSUMED_DOWNSAMPLE = 4, 8
# A latent cache (python -m data.cache_latents; a run reads it with data.latents=DIR): its meta.json "source", and
# each sample's [2, C, h, w] float32 posterior mean and std (the trainer draws the latent itself, as without it).
LATENT_SOURCE = "latents"
MOMENTS = "moments.npy"


@dataclass(frozen=True)
class VaeGeometry:
    """What the DiT needs to know about a VAE: shapes and the latent scaling."""

    path: Path
    image_channels: int
    latent_channels: int
    downsample: int  # 2 ** (len(block_out_channels) - 1): one 2x downsampling per encoder block but the last
    image_size: int
    scaling_factor: float = 1.0
    shift_factor: float = 0.0
    assumed: bool = False  # the folder is not here: ASSUMED_* shapes, for sizing only

    @property
    def latent_size(self) -> int:
        return self.image_size // self.downsample


def resolve(path: str | Path) -> Path:
    return Path(os.path.expanduser(str(path)))


def read_vae_config(path: str | Path) -> dict:
    """config.json of a diffusers AutoencoderKL folder; ConfigError (one line) for anything else."""
    folder = resolve(path)
    if not folder.is_dir():
        raise ConfigError(
            f"diffusion.vae={path}: no such folder (a diffusers AutoencoderKL folder, e.g. "
            f"stabilityai/sd-vae-ft-mse saved with save_pretrained)"
        )
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        raise ConfigError(
            f"diffusion.vae={path} is not a diffusers AutoencoderKL folder (no readable config.json)"
        ) from None
    name = config.get("_class_name") if isinstance(config, dict) else None
    if (
        name != "AutoencoderKL"
        or not isinstance(config.get("block_out_channels"), list)
        or not isinstance(config.get("latent_channels"), int)
    ):
        raise ConfigError(
            f"diffusion.vae={path} is not a diffusers AutoencoderKL folder (its config.json describes "
            f"{'a ' + name if name else 'no diffusers model'})"
        )
    return config


def vae_geometry(path: str | Path, image_size: int, *, must_exist: bool = True) -> VaeGeometry:
    """The latent shape `path`'s VAE gives `image_size` images; ConfigError if it cannot downsample
    them evenly. A missing folder is an error unless `must_exist=False` (sizing): then the ASSUMED_* shape."""
    if not must_exist and not resolve(path).exists():
        return VaeGeometry(resolve(path), 3, ASSUMED_LATENT_CHANNELS, ASSUMED_DOWNSAMPLE, image_size, assumed=True)
    config = read_vae_config(path)
    factor = 2 ** (len(config["block_out_channels"]) - 1)
    if image_size % factor:
        raise ConfigError(
            f"data.image_size={image_size}: the VAE in diffusion.vae={path} downsamples by {factor} "
            f"(2^(len(block_out_channels)-1)); choose an image size that is a multiple of {factor}"
        )
    shift = config.get("shift_factor")
    return VaeGeometry(
        resolve(path),
        int(config.get("in_channels", 3)),
        int(config["latent_channels"]),
        factor,
        image_size,
        scaling_factor=float(config.get("scaling_factor", 1.0)),
        shift_factor=float(shift) if shift is not None else 0.0,
    )


def vae_identity(path: str | Path) -> dict:
    """What a latent cache records of the VAE that encoded it: its config.json (diffusers' version
    stamp left out) and a digest of its weight files (sd-vae-ft-mse and -ema share a config)."""
    import hashlib

    digest = hashlib.sha256()
    for f in sorted(p for p in resolve(path).iterdir() if p.suffix in (".safetensors", ".bin")):
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                digest.update(block)
    config = {k: v for k, v in read_vae_config(path).items() if k != "_diffusers_version"}
    return {"config": config, "weights_sha256": digest.hexdigest()}


def load_vae(geometry: VaeGeometry, device):
    """The VAE in fp32 eval mode with no trainable parameters, on `device`."""
    import torch
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(geometry.path, torch_dtype=torch.float32)
    return vae.eval().requires_grad_(False).to(device)


def posterior(vae, images):
    """(mean, std) of the VAE's posterior for images in [-1, 1]: what the latent cache stores, and
    what on-the-fly encoding hands the trainer, which draws `eps` itself (the same draw either way)."""
    import torch

    with torch.no_grad():
        dist = vae.encode(images.float()).latent_dist
    # Contiguous, as the cache stores them: the encoder's output can be channels-last (oneDNN on
    # CPU) and a chunk of it is strided, and randn_like(x) fills x's memory order -- a different
    # noise tensor for the same seed.
    return dist.mean.contiguous(), dist.std.contiguous()


def moments_record(mean, std) -> list:
    """A batch's posterior moments as the latent cache stores them: one float32 [2, C, h, w] array per sample."""
    import numpy as np
    import torch

    return [np.ascontiguousarray(m) for m in torch.stack([mean, std], dim=1).float().cpu().numpy()]


def read_moments(sample: dict):
    """(mean, std) float32 [C, h, w] of a latent cache sample."""
    import io

    import numpy as np
    import torch

    moments = torch.from_numpy(np.load(io.BytesIO(sample[MOMENTS])))
    return moments[0], moments[1]


def to_latents(mean, std, eps, geometry: VaeGeometry):
    """A posterior sample, shifted and scaled to the DiT's latent space (about unit variance)."""
    return (mean + std * eps - geometry.shift_factor) * geometry.scaling_factor


def decode(vae, latents, geometry: VaeGeometry):
    """DiT-space latents -> images in [-1, 1]."""
    import torch

    with torch.no_grad():
        return vae.decode(latents.float() / geometry.scaling_factor + geometry.shift_factor).sample.clamp(-1, 1)


def folder_decoder(folder: str | Path, image_size: int, device):
    """decode() bound to the VAE saved in `folder` (an export's vae/): latents -> images in [-1, 1]."""
    geometry = vae_geometry(folder, image_size)
    return functools.partial(decode, load_vae(geometry, device), geometry=geometry)
