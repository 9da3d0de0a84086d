"""Prompt adherence of the moving-digits demo: clips drawn from prompts in phrasings no training caption uses
(common/data/moving_digits.py HELD_OUT_TEMPLATES), scored twice:

    digit      a classifier (common/diffusion/evaluate.py's RBF SVM) fitted on real frames of the run's training
               clips, each frame cropped around the digit (a window about its centroid, so the digit's place in the
               frame does not matter), applied to every frame of a sampled clip; the clip's digit is the frames'
               majority (chance: 0.1)
    direction  common/data/moving_digits.py track_direction (the frames' centroids, a line through them) on the
               sampled clip equals the prompt's direction (chance: 0.25; a still or empty clip has none)

The classifier fits on the real clips as the pipeline's own VAE renders them (encoded, the posterior mean decoded),
as the text-to-image demo's does (recipes/t2i/evaluate.py); its frame accuracy on the held-out clips (the val split)
and both scores of those real clips stand beside the samples' scores in eval.json: the scorer is only as meaningful
as they are high.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from common.data.digit_captions import DIGIT_WORDS
from common.data.moving_digits import (
    DIRECTIONS,
    HELD_OUT_TEMPLATES,
    caption_motion,
    held_out_prompts,
    sprite_side,
    track_direction,
)
from common.data.video import decode_video_sample
from common.data.webdataset import iter_samples
from common.diffusion.evaluate import fit_image_classifier

NUM_DIGITS = len(DIGIT_WORDS)
MAX_PROMPTS_PER_PAIR = 3  # diffusion.eval_samples_per_class, capped: 40 pairs x 3 = 120 clips to sample
REAL_CLIPS_PER_DIGIT = 24  # the classifier's real clips per digit (x F frames each)


@dataclass
class MovingDigitClips:
    """One split of clip shards read as moving digits: every caption, and up to `per_digit` clips [N, 3, F, H, W] in
    [-1, 1] per digit with the digits and directions their captions name (decoded only with `videos`)."""

    captions: set[str] = field(default_factory=set)
    videos: torch.Tensor | None = None
    digits: torch.Tensor | None = None
    directions: list[str] = field(default_factory=list)


def read_moving_digits(urls: list[str], *, videos: bool = True, per_digit: int = REAL_CLIPS_PER_DIGIT):
    """The split at `urls` if every caption names a digit and a direction in the moving digits' phrasings, else
    None (the shards are not the moving digits: there is no scorer for them)."""
    out, clips, counts = MovingDigitClips(), [], [0] * NUM_DIGITS
    digits = []
    for sample in iter_samples(urls):
        caption = sample["txt"].decode("utf-8") if isinstance(sample["txt"], bytes) else sample["txt"]
        motion = caption_motion(caption)
        if motion is None:
            return None
        out.captions.add(caption)
        if videos and counts[motion[0]] < per_digit:
            counts[motion[0]] += 1
            clips.append(decode_video_sample(sample)["video"])
            digits.append(motion[0])
            out.directions.append(motion[1])
    if clips:
        out.videos, out.digits = torch.stack(clips), torch.tensor(digits)
    return out


def eval_prompts(per_pair: int) -> tuple[list[str], torch.Tensor, list[str]]:
    """The eval's prompts (held-out phrasings, `per_pair` per (digit, direction), capped at MAX_PROMPTS_PER_PAIR),
    their digits and directions."""
    prompts, digits, directions = held_out_prompts(max(1, min(per_pair, MAX_PROMPTS_PER_PAIR)))
    return prompts, torch.tensor(digits), directions


def digit_crops(videos: torch.Tensor) -> torch.Tensor:
    """Each frame of clips [N, 3, F, H, W] in [-1, 1] as a window [N * F, 1, S, S] about its digit: gray, centered on
    the centroid of what is brighter than the frame's median (track_direction's centroid), S the moving digits'
    sprite's side plus 4 (a margin), the background (-1) beyond the frame's edge."""
    gray = videos.float().mean(dim=1).flatten(0, 1)  # [N * F, H, W]
    h, w = gray.shape[1:]
    side = sprite_side(h, w) + 4
    weights = (gray - gray.flatten(1).median(dim=1).values.view(-1, 1, 1)).clamp(min=0)
    mass = weights.sum(dim=(1, 2)).clamp(min=1e-6)
    cy = (weights.sum(dim=2) * torch.arange(h)).sum(1) / mass
    cx = (weights.sum(dim=1) * torch.arange(w)).sum(1) / mass
    # An empty frame (no mass) keeps the frame's middle.
    cy = torch.where(weights.sum(dim=(1, 2)) > 0, cy, torch.full_like(cy, (h - 1) / 2))
    cx = torch.where(weights.sum(dim=(1, 2)) > 0, cx, torch.full_like(cx, (w - 1) / 2))
    padded = torch.nn.functional.pad(gray, (side, side, side, side), value=-1.0)
    top = (cy - (side - 1) / 2).round().long() + side
    left = (cx - (side - 1) / 2).round().long() + side
    rows = top.view(-1, 1) + torch.arange(side)  # [N * F, S]
    cols = left.view(-1, 1) + torch.arange(side)
    frames = torch.arange(len(gray)).view(-1, 1, 1)
    return padded[frames, rows.unsqueeze(2), cols.unsqueeze(1)].unsqueeze(1)


def clip_digits(clf, videos: torch.Tensor) -> np.ndarray:
    """The digit the classifier reads in each clip [N, 3, F, H, W]: the majority over its frames (ties: the lowest)."""
    frames = videos.shape[2]
    pred = clf.predict(digit_crops(videos).flatten(1).numpy()).reshape(len(videos), frames)
    return np.array([np.bincount(row, minlength=NUM_DIGITS).argmax() for row in pred])


def clip_directions(videos: torch.Tensor) -> list[str | None]:
    """track_direction of each clip [N, 3, F, H, W] in [-1, 1]."""
    return [track_direction(v.float().permute(1, 2, 3, 0).numpy()) for v in videos]


def score_clips(clf, videos: torch.Tensor, digits: torch.Tensor, directions: list[str]) -> dict:
    """digit_accuracy, direction_accuracy and both_accuracy (the share of clips with the right digit, direction, and
    both) and the digit's and direction's accuracy per digit and per direction."""
    digit_ok = clip_digits(clf, videos) == digits.numpy()
    way_ok = np.array([found == want for found, want in zip(clip_directions(videos), directions)])
    y, ways = digits.numpy(), np.array(directions)
    return {
        "digit_accuracy": float(digit_ok.mean()),
        "direction_accuracy": float(way_ok.mean()),
        "both_accuracy": float((digit_ok & way_ok).mean()),
        "per_digit_accuracy": {str(d): float(digit_ok[y == d].mean()) for d in range(NUM_DIGITS) if (y == d).any()},
        "per_direction_accuracy": {w: float(way_ok[ways == w].mean()) for w in DIRECTIONS if (ways == w).any()},
        "num_samples": len(videos),
    }


def fit_digit_classifier(train: MovingDigitClips, val: MovingDigitClips, seed: int = 0):
    """The classifier on `train`'s frames (digit_crops) and its frame accuracy on `val`'s."""
    frames = train.videos.shape[2]
    fit = (digit_crops(train.videos), train.digits.repeat_interleave(frames))
    held_out = (digit_crops(val.videos), val.digits.repeat_interleave(val.videos.shape[2]))
    return fit_image_classifier(fit, held_out, seed)


def score_prompt_adherence(
    videos: torch.Tensor, digits: torch.Tensor, directions: list[str], prompts: list[str], train: MovingDigitClips,
    val: MovingDigitClips, seed: int = 0, render: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict:  # fmt: skip
    """eval.json's fields: `score_clips` of the sampled clips, the chance levels, the classifier's frame accuracy on
    the real held-out clips, both scores of those real clips (the scorer's own check), the held-out phrasings and how
    many of the prompts a training caption holds (0: the model never saw them). `render`: what the real clips go
    through before the scorer sees them (`through_vae`)."""
    render = render or (lambda x: x)
    train = MovingDigitClips(train.captions, render(train.videos), train.digits, train.directions)
    val = MovingDigitClips(val.captions, render(val.videos), val.digits, val.directions)
    clf, frame_acc = fit_digit_classifier(train, val, seed)
    real = score_clips(clf, val.videos, val.digits, val.directions)
    result = score_clips(clf, videos, digits, directions)
    result.update(
        chance_digit=1.0 / NUM_DIGITS,
        chance_direction=1.0 / len(DIRECTIONS),
        classifier_frame_accuracy_on_real_val=frame_acc,
        real_val_digit_accuracy=real["digit_accuracy"],
        real_val_direction_accuracy=real["direction_accuracy"],
        held_out_phrasings=list(HELD_OUT_TEMPLATES),
        prompts_seen_in_training=sum(p in train.captions for p in set(prompts)),
    )
    return result


@torch.no_grad()
def through_vae(vae, geometry, videos: torch.Tensor, batch: int = 32) -> torch.Tensor:
    """Clips [N, 3, F, H, W] in [-1, 1] encoded by the video VAE and decoded from their posterior mean (as the
    transformer's latents: normalized, then decoded as WanPipeline decodes), `batch` at a time."""
    from recipes.video.weights import posterior

    out = []
    for chunk in videos.split(batch):
        mean, std = posterior(vae, chunk)
        out.append(geometry.decode(vae, geometry.to_latents(mean, std, torch.zeros_like(mean))))
    return torch.cat(out).float()
