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
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

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


def text_features(encoder, ids, mask):
    """What the pretraining's head reads of a text encoder: CLIP's projected (CLIPTextModelWithProjection) or pooled
    output (what SD3's and Flux's pooled_projections are), T5's states averaged over the prompt's tokens."""
    out = encoder(input_ids=ids, attention_mask=mask if encoder.config.model_type == "t5" else None)
    if encoder.config.model_type == "t5":
        m = mask.unsqueeze(-1).to(out.last_hidden_state.dtype)
        return (out.last_hidden_state * m).sum(1) / m.sum(1)
    return out.text_embeds if hasattr(out, "text_embeds") else out.pooler_output


def pretrain_text(encoder, tokenizer, length: int, *, steps: int = 300, lr: float = 3e-3, seed: int = 0) -> float:
    """Train `encoder` (CLIPTextModel, CLIPTextModelWithProjection or T5EncoderModel) with a linear head (thrown
    away) to name the digit of PRETRAIN_TEMPLATES' captions, padded to `length` as the pipelines pad them. Returns
    the head's accuracy on the captions at the end."""
    import torch

    torch.manual_seed(seed)
    captions, digits = pretrain_captions()
    tokens = tokenizer(captions, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
    labels = torch.tensor(digits)
    width = text_features(encoder, tokens.input_ids[:1], tokens.attention_mask[:1]).shape[-1]
    head = torch.nn.Linear(width, len(DIGIT_WORDS))
    opt = torch.optim.Adam([*encoder.parameters(), *head.parameters()], lr=lr)
    encoder.train()
    for _ in range(steps):
        logits = head(text_features(encoder, tokens.input_ids, tokens.attention_mask))
        loss = torch.nn.functional.cross_entropy(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    encoder.eval()
    with torch.no_grad():
        logits = head(text_features(encoder, tokens.input_ids, tokens.attention_mask))
    return (logits.argmax(-1) == labels).float().mean().item()
