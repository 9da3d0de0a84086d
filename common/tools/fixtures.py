"""Offline stand-ins for what a DiT user brings, built in seconds: a diffusers VAE folder and an ImageFolder of images.

    make_vae(dir)            # ~/models/sd-vae-ft-mse: a small random AutoencoderKL (save_pretrained)
    make_image_folder(dir)   # ~/data/my_images: digits upscaled to RGB PNGs, one folder per class, one corrupt file

Both write into the folder they are given and return it. scripts/gpu_check.py builds dit_2b's inputs with them
(a GPU node has no VAE or images either); the tests use them through tests/fixtures/dit.py.
"""

from __future__ import annotations

from pathlib import Path

CLASS_NAMES = tuple(f"digit_{c}" for c in range(10))  # sorted like the digits they hold


def make_vae(
    out: str | Path,
    *,
    block_out_channels: tuple[int, ...] = (16, 16, 32, 32),
    latent_channels: int = 4,
    shift_factor: float | None = None,
    seed: int = 0,
) -> Path:
    """A random AutoencoderKL saved with save_pretrained, shaped like sd-vae-ft-mse by default (4 latent
    channels, 1/8 size: it downsamples by 2^(len(block_out_channels)-1)) but with a few thousand
    times fewer weights. `scaling_factor` is SD's 0.18215; `shift_factor` gives an SD3/Flux-style config."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    n = len(block_out_channels)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=block_out_channels,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=8,
        sample_size=32,
        shift_factor=shift_factor,
    )
    out = Path(out)
    vae.save_pretrained(out)
    return out


def make_image_folder(
    out: str | Path, *, classes: int = 3, per_class: int = 64, size: int = 24, corrupt: bool = True
) -> Path:
    """An ImageFolder of sklearn digits: `classes` folders digit_0, digit_1, ... with `per_class` RGB PNGs
    each (digits upscaled to `size`, tinted per class so the three channels differ), plus one file
    `broken.png` that is not an image (prepare_images skips and counts it)."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    out = Path(out)
    tint = np.array([[1.0, 0.6, 0.3], [0.3, 1.0, 0.6], [0.6, 0.3, 1.0]])
    for c in range(classes):
        folder = out / CLASS_NAMES[c]
        folder.mkdir(parents=True, exist_ok=True)
        rows = np.flatnonzero(digits.target == c)[:per_class]
        for i, row in enumerate(rows):
            gray = Image.fromarray(np.rint(digits.images[row] * 255 / 16).astype(np.uint8)).resize(
                (size, size), Image.BILINEAR
            )
            rgb = (np.asarray(gray, dtype=np.float64)[..., None] * tint[c % len(tint)]).round().astype(np.uint8)
            Image.fromarray(rgb).save(folder / f"{i:04d}.png")
    if corrupt:
        (out / CLASS_NAMES[0] / "broken.png").write_bytes(b"this is not a PNG file")
    return out
