"""Pretraining for the tiny pipelines' parts (data/tiny_bases.py), so that they have learned something, as a
release's parts have: a VAE that reconstructs the digits, and text encoders whose embeddings separate the digits'
words across phrasings. Each part is trained offline in seconds on CPU, deterministically, and cached under a
content-keyed folder (data/cache/tiny_bases/<part>-<key>: the key digests this file, the part's settings -- its
whole config, its tokenizer's vocabulary -- and the library versions), so the demo and the tests build it once.

    VAE            an AutoencoderKL trained as an autoencoder on scikit-learn's digits (MSE + a small KL term),
                   its scaling_factor and shift_factor then set from its latents as SD3's and Flux's were
                   (shift: their mean, scaling: 1 / their standard deviation)
    text encoders  CLIP (its pooled / projected output) and T5 (its states, averaged over the prompt's tokens)
                   trained with a linear head (thrown away) to name the digit a caption names, in
                   PRETRAIN_TEMPLATES' phrasings: the training captions' and others, never the prompt-adherence
                   eval's held-out ones
    video VAE      an AutoencoderKLWan trained as an autoencoder on moving-digit clips (MSE + a small KL term), its
                   latents_mean and latents_std then set per channel from its latents as Wan's were
    UMT5           as T5, with two heads: the digit and the direction of motion a caption names, in
                   MOTION_PRETRAIN_TEMPLATES' phrasings (never the video eval's held-out ones)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from common.data import moving_digits
from common.data.digit_captions import CAPTION_TEMPLATES, DIGIT_WORDS, digit_caption

CACHE = Path(__file__).resolve().parent / "cache" / "tiny_bases"
# The phrasings the text encoders pretrain on: the demo's training captions' and some of their own (a release's
# encoders have read far more text than the fine-tune's captions); never common/data/digit_captions.py's
# HELD_OUT_TEMPLATES, which the eval prompts with.
PRETRAIN_TEMPLATES = CAPTION_TEMPLATES + (
    "{name}",
    "{digit}",
    "the number {digit}",
    "a {name}",
    "a picture of the digit {digit}",
    "the handwritten {name}",
    "{digit}, written by hand",
    "a drawing of a {name}",
)
VAE_IMAGE_SIZE = 16  # the demo's image size: the VAE pretrains on the digits at it
# The moving digits' phrasings UMT5 pretrains on: the video demo's training captions' and some of their own; never
# common/data/moving_digits.py's HELD_OUT_TEMPLATES, which the video eval prompts with.
MOTION_PRETRAIN_TEMPLATES = moving_digits.CAPTION_TEMPLATES + (
    "{name} moving {way}",
    "{digit} moves {towards}",
    "the {name} drifting {way}",
    "a digit {digit} sliding {way}",
    "the number {digit} moving {towards}",
    "{name}, {way}",
)
POSTERIOR_STD_SCALE = 0.05  # pretrain_wan_vae: the posterior's width, scaled before training
CLIP_SHAPE = (9, 32, 32)  # the video demo's clips (frames, height, width): the video VAE pretrains on them


def cached(part: str, settings: dict, build: Callable[[Path], None]) -> Path:
    """The folder of a pretrained `part` built by `build(folder)` with `settings`, from the cache if it is there
    (built into a temporary folder and renamed, under a lock: a concurrent builder waits and reads the first's)."""
    import diffusers
    import torch
    import transformers

    digest = hashlib.sha256(Path(__file__).read_bytes())
    versions = [torch.__version__, diffusers.__version__, transformers.__version__]
    digest.update(json.dumps([part, settings, versions], sort_keys=True, default=str).encode())
    folder = CACHE / f"{part}-{digest.hexdigest()[:16]}"
    if (folder / "done").exists():
        return folder
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time (pytest-xdist workers, ranks): the others wait
        if not (folder / "done").exists():
            _build(folder, build)
    return folder


def _build(folder: Path, build: Callable[[Path], None]) -> None:
    """`build` into a temporary folder with one thread, then renamed into place with its `done` mark."""
    import torch

    tmp = CACHE / f".{folder.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is faster than several, and far faster on a busy machine
    try:
        build(tmp)
    finally:
        torch.set_num_threads(threads)
    (tmp / "done").write_text("")
    tmp.rename(folder)


def digit_images(size: int = VAE_IMAGE_SIZE):
    """scikit-learn's 1,797 digits as RGB images [N, 3, size, size] in [-1, 1], upscaled as the caption shards'
    builder does (bicubic, data/prepare_images.py center_crop), and their digits."""
    import numpy as np
    import torch
    from PIL import Image
    from sklearn.datasets import load_digits

    data = load_digits()
    pixels = [
        np.asarray(
            Image.fromarray(np.rint(img * 255 / 16).astype(np.uint8)).convert("RGB").resize((size, size), Image.BICUBIC)
        )
        for img in data.images
    ]
    images = torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).float() / 127.5 - 1
    return images, torch.from_numpy(data.target)


def pretrain_vae(vae, *, steps: int = 400, batch: int = 64, kl_weight: float = 1e-4, seed: int = 0) -> dict:
    """Train `vae` (a diffusers AutoencoderKL) to reconstruct the digits: MSE + kl_weight x KL to N(0, 1), Adam.
    Then sets its scaling_factor and shift_factor from its posterior means over the digits (as SD3's and Flux's
    were chosen: latents of about unit spread). Returns {mse, posterior_std, scaling_factor, shift_factor}."""
    import torch

    torch.manual_seed(seed)
    images, _ = digit_images()
    opt = torch.optim.Adam(vae.parameters(), lr=2e-3)
    vae.train()
    for step in range(steps):
        x = images[torch.randint(len(images), (batch,))]
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample()).sample
        loss = torch.nn.functional.mse_loss(recon, x) + kl_weight * posterior.kl().mean() / posterior.mean[0].numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
    vae.eval()
    with torch.no_grad():
        posterior = vae.encode(images).latent_dist
        mse = torch.nn.functional.mse_loss(vae.decode(posterior.mean).sample, images).item()
        shift, spread = posterior.mean.mean().item(), posterior.mean.std().item()
    vae.register_to_config(scaling_factor=round(1 / spread, 4), shift_factor=round(shift, 4))
    return {
        "mse": mse,
        "posterior_std": posterior.std.mean().item(),
        "scaling_factor": 1 / spread,
        "shift_factor": shift,
    }


def pretrain_captions(seed: int = 0) -> tuple[list[str], list[int]]:
    """Every PRETRAIN_TEMPLATES phrasing of every digit, and the digits."""
    pairs = [
        (digit_caption(d, p, PRETRAIN_TEMPLATES), d)
        for d in range(len(DIGIT_WORDS))
        for p in range(len(PRETRAIN_TEMPLATES))
    ]
    return [c for c, _ in pairs], [d for _, d in pairs]


def motion_pretrain_captions(templates: tuple[str, ...] = MOTION_PRETRAIN_TEMPLATES):
    """Every `templates` phrasing of every (digit, direction) pair, and [the digits, the directions' indices]."""
    rows = [
        (moving_digits.motion_caption(d, way, p, templates), d, moving_digits.DIRECTIONS.index(way))
        for d, way in moving_digits.PAIRS
        for p in range(len(templates))
    ]
    return [r[0] for r in rows], [[r[1] for r in rows], [r[2] for r in rows]]


def text_features(encoder, ids, mask):
    """What the pretraining's head reads of a text encoder: CLIP's projected (CLIPTextModelWithProjection) or pooled
    output (what SD3's and Flux's pooled_projections are), T5's and UMT5's states averaged over the prompt's tokens."""
    t5 = encoder.config.model_type in ("t5", "umt5")
    out = encoder(input_ids=ids, attention_mask=mask if t5 else None)
    if t5:
        m = mask.unsqueeze(-1).to(out.last_hidden_state.dtype)
        return (out.last_hidden_state * m).sum(1) / m.sum(1)
    return out.text_embeds if hasattr(out, "text_embeds") else out.pooler_output


def pretrain_text(
    encoder, tokenizer, length: int, *, steps: int = 300, lr: float = 3e-3, seed: int = 0, captions=None, labels=None
) -> float:
    """Train `encoder` (CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel or UMT5EncoderModel) with a linear
    head per list of `labels` (thrown away) to name what `captions` name (by default: the digit of
    PRETRAIN_TEMPLATES' captions), padded to `length` as the pipelines pad them. Returns the share of captions every
    head names right at the end."""
    import torch

    torch.manual_seed(seed)
    if captions is None:
        captions, digits = pretrain_captions()
        labels = [digits]
    tokens = tokenizer(captions, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
    targets = [torch.tensor(y) for y in labels]
    width = text_features(encoder, tokens.input_ids[:1], tokens.attention_mask[:1]).shape[-1]
    heads = torch.nn.ModuleList(torch.nn.Linear(width, int(y.max()) + 1) for y in targets)
    opt = torch.optim.Adam([*encoder.parameters(), *heads.parameters()], lr=lr)
    encoder.train()
    for _ in range(steps):
        features = text_features(encoder, tokens.input_ids, tokens.attention_mask)
        loss = sum(torch.nn.functional.cross_entropy(h(features), y) for h, y in zip(heads, targets))
        opt.zero_grad()
        loss.backward()
        opt.step()
    encoder.eval()
    with torch.no_grad():
        features = text_features(encoder, tokens.input_ids, tokens.attention_mask)
        right = torch.stack([h(features).argmax(-1) == y for h, y in zip(heads, targets)]).all(0)
    return right.float().mean().item()


def motion_clips(n: int, seed: int):
    """`n` moving-digit clips of CLIP_SHAPE (common/data/moving_digits.py, seeded apart from the demo's shards) as
    [n, 3, F, H, W] in [-1, 1]."""
    import torch

    clips = moving_digits.moving_digit_clips(n, *CLIP_SHAPE, seed=seed)[0]
    return torch.from_numpy(clips).permute(0, 4, 1, 2, 3).float() / 127.5 - 1


def _unclamped_decode(vae, z):
    """AutoencoderKLWan's decoding of latents `z` before its clamp to [-1, 1] (a pixel clamped below -1 passes no
    gradient: a fresh decoder whose output starts there never learns to draw): the decoder's outputs, chunk by chunk,
    as its decode() concatenates them."""
    import torch

    chunks = []
    hook = vae.decoder.register_forward_hook(lambda module, args, out: chunks.append(out))
    try:
        vae.decode(z)
    finally:
        hook.remove()
    return torch.cat(chunks, dim=2)


def pretrain_wan_vae(
    vae, *, steps: int = 600, batch: int = 16, crop: tuple[int, int] = (5, 24), lr: float = 1e-3,
    kl_weight: float = 1e-4, seed: int = 0,
) -> dict:  # fmt: skip
    """Train `vae` (a diffusers AutoencoderKLWan) to reconstruct moving-digit clips: MSE + kl_weight x KL to N(0, 1),
    Adam (lr decaying to 0 over the second half), on random crops of `crop` = (frames, side) of them (a 4k+1-frame
    crop keeps the causal first frame and a later group of 4; part of the frame costs part of the time, and the
    convolutions see the same strokes), its posterior narrowed (POSTERIOR_STD_SCALE) before the first step. Then sets
    its latents_mean and latents_std per channel from its posterior means over the clips (as Wan's were chosen:
    latents of about unit spread). Returns {mse (whole held-out clips, the posterior mean decoded), posterior_std,
    latents_mean, latents_std}."""
    import torch

    torch.manual_seed(seed)
    clips, held_out = motion_clips(512, seed + 1000), motion_clips(64, seed + 2000)
    frames, side = crop
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    # lr constant for the first half, then down linearly to 0: the last steps settle rather than jump
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, 2 * (1 - s / steps)))
    # A fresh posterior's noise is about as wide as its means' spread, and the encoder is slow to narrow it: a decoder
    # trained on such samples learns to draw their average (a blob, not the digit), and a diffusion model's latents
    # would be buried in that noise. So the posterior starts at POSTERIOR_STD_SCALE of its width (its log-variance
    # lowered by a constant), as nearly deterministic as Wan's own, and the decoder learns from it.
    with torch.no_grad():
        vae.quant_conv.bias[vae.config.z_dim :] += 2 * math.log(POSTERIOR_STD_SCALE)
    vae.train()
    for _ in range(steps):
        f0, y0, x0 = (
            int(torch.randint(0, n - c + 1, (), generator=g)) for n, c in zip(CLIP_SHAPE, (frames, side, side))
        )
        x = clips[torch.randint(len(clips), (batch,), generator=g)][
            :, :, f0 : f0 + frames, y0 : y0 + side, x0 : x0 + side
        ]
        posterior = vae.encode(x).latent_dist
        recon = _unclamped_decode(vae, posterior.sample())
        loss = torch.nn.functional.mse_loss(recon, x) + kl_weight * posterior.kl().mean() / posterior.mean[0].numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        decay.step()
    vae.eval()
    with torch.no_grad():
        posterior = vae.encode(held_out).latent_dist
        mse = torch.nn.functional.mse_loss(vae.decode(posterior.mean).sample, held_out).item()
        means = torch.cat([vae.encode(c).latent_dist.mean for c in clips[:128].split(32)])
    channel_mean = means.mean(dim=(0, 2, 3, 4)).tolist()
    channel_std = means.std(dim=(0, 2, 3, 4)).tolist()
    vae.register_to_config(
        latents_mean=[round(v, 4) for v in channel_mean], latents_std=[round(v, 4) for v in channel_std]
    )
    return {
        "mse": mse,
        "posterior_std": posterior.std.mean().item(),
        "latents_mean": channel_mean,
        "latents_std": channel_std,
    }
