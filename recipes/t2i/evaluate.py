"""Prompt adherence of the captioned-digits demo: images drawn from prompts in phrasings no training caption uses
(common/data/digit_captions.py HELD_OUT_TEMPLATES), scored by the classifier the class-conditional DiT's eval fits
(common/diffusion/evaluate.py), fitted here on the run's own real images labelled by the digit their caption names.
The score is the share of samples the classifier reads as the prompted digit (chance: 0.1).

The classifier fits on the real images as the pipeline's own VAE renders them (encoded, the posterior mean decoded):
what a perfect model of the latents would draw. With a released VAE, or the demo's pretrained one
(data/tiny_pretrain.py), that is the images themselves, near enough; with a random stand-in VAE it is not (a
classifier fitted on the raw digits read a random VAE's renderings of real held-out digits as the right digit 0.07 of
the time, below chance; fitted on the renderings: 0.99).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.data.digit_captions import DIGIT_WORDS, HELD_OUT_TEMPLATES, caption_digit, held_out_prompts
from common.data.webdataset import iter_samples
from common.diffusion import vae as vae_lib
from common.diffusion.evaluate import MAX_PER_CLASS, fit_image_classifier, score_samples
from common.diffusion.images import decode_png, to_model_space

NUM_DIGITS = len(DIGIT_WORDS)


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


@dataclass
class CaptionedDigits:
    """One split of caption shards read as digits: every caption, and up to MAX_PER_CLASS images [N, 3, S, S] in
    [-1, 1] per digit with the digit their caption names (decoded only with `images`)."""

    captions: set[str] = field(default_factory=set)
    images: torch.Tensor | None = None
    labels: torch.Tensor | None = None


def read_captioned_digits(urls: list[str], image_size: int, *, images: bool = True) -> CaptionedDigits | None:
    """The split at `urls` if every caption names a digit in one of the digits' phrasings, else None (the shards
    are not the captioned digits: there is no classifier for them)."""
    out, pixels, labels, counts = CaptionedDigits(), [], [], [0] * NUM_DIGITS
    for sample in iter_samples(urls):
        caption = _text(sample["txt"])
        digit = caption_digit(caption)
        if digit is None:
            return None
        out.captions.add(caption)
        if images and counts[digit] < MAX_PER_CLASS:
            counts[digit] += 1
            pixels.append(torch.from_numpy(decode_png(sample["png"], channels=3)))
            labels.append(digit)
    if images and pixels:
        out.images = to_model_space(torch.stack(pixels), image_size)
        out.labels = torch.tensor(labels)
    return out


@torch.no_grad()
def through_vae(vae, geometry: vae_lib.VaeGeometry, images: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """Images [N, C, S, S] in [-1, 1] encoded by the VAE and decoded from their posterior mean, `batch` at a time."""
    out = []
    for chunk in images.split(batch):
        mean, std = vae_lib.posterior(vae, chunk)
        out.append(vae_lib.decode(vae, vae_lib.to_latents(mean, std, torch.zeros_like(mean), geometry), geometry))
    return torch.cat(out).float()


def eval_prompts(per_digit: int) -> tuple[list[str], torch.Tensor]:
    """The eval's prompts (held-out phrasings, `per_digit` per digit, digit by digit) and their digits."""
    prompts, digits = held_out_prompts(per_digit)
    return prompts, torch.tensor(digits)


def score_prompt_adherence(
    images: torch.Tensor, digits: torch.Tensor, prompts: list[str], train: CaptionedDigits, val: CaptionedDigits,
    seed: int = 0, render: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict:  # fmt: skip
    """eval.json's fields: the DiT's (mean_accuracy: the share of samples showing the prompted digit,
    per_class_accuracy: the same per digit, num_samples, classifier_accuracy_on_real_val, chance) and the held-out
    phrasings with how many of the prompts a training caption holds (0: the model never saw them). `render`: what
    the real images go through before the classifier sees them (`through_vae`)."""
    render = render or (lambda x: x)
    clf, real_acc = fit_image_classifier((render(train.images), train.labels), (render(val.images), val.labels), seed)
    result = score_samples(clf, images, digits, NUM_DIGITS)
    result.update(
        classifier_accuracy_on_real_val=real_acc,
        chance=1.0 / NUM_DIGITS,
        held_out_phrasings=list(HELD_OUT_TEMPLATES),
        prompts_seen_in_training=sum(p in train.captions for p in set(prompts)),
    )
    return result
