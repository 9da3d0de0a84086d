"""The moving digits (the text-to-video demo, data.prepare_videos --moving-digits, data/tiny_bases.py's clip folder,
and their eval): a handwritten digit crossing a black frame left, right, up or down, captioned in several phrasings
that name the digit and the direction, phrasings that no training clip is captioned with for the eval's prompts, a
parser that reads (digit, direction) back from any of them, and `track_direction`, which reads the direction of motion
off the frames (the eval's motion score; tested against the generator's own labels)."""

from __future__ import annotations

import functools
import re

import numpy as np

from common.data.digit_captions import DIGIT_WORDS

DIRECTIONS = ("left", "right", "up", "down")
# A direction in two wordings: "{way}" plain ("moving left"), "{towards}" with its preposition ("drifting to the left").
WAY = {"left": "left", "right": "right", "up": "up", "down": "down"}
TOWARDS = {"left": "to the left", "right": "to the right", "up": "upward", "down": "downward"}
# "{name}" is the digit's word, "{digit}" its numeral (common/data/digit_captions.py's convention).
CAPTION_TEMPLATES = (
    "the digit {digit} moving {way}",
    "a handwritten {name} drifting {towards}",
    "{name} sliding {towards}",
    "the number {name} moves {way}",
)
# Held out: used for no training caption (the eval prompts with them), so a model that follows them generalizes over
# phrasing rather than recalling a caption. Each reuses words the training captions hold, in an order none of them has.
HELD_OUT_TEMPLATES = (
    "the handwritten {name} moving {towards}",
    "a number {digit} drifting {way}",
)
PAIRS = tuple((d, way) for d in range(len(DIGIT_WORDS)) for way in DIRECTIONS)
SPRITE_FRACTION = 1 / 2  # the digit's sprite: this share of the frame's shorter side


def sprite_side(height: int, width: int) -> int:
    """The side in pixels of a moving digit's square sprite in frames of height x width."""
    return max(3, round(min(height, width) * SPRITE_FRACTION))


def motion_caption(digit: int, direction: str, phrasing: int, templates: tuple[str, ...] = CAPTION_TEMPLATES) -> str:
    """The `phrasing`-th caption (mod the templates) of `digit` moving `direction`."""
    template = templates[phrasing % len(templates)]
    return template.format(name=DIGIT_WORDS[digit], digit=digit, way=WAY[direction], towards=TOWARDS[direction])


def held_out_prompts(per_pair: int) -> tuple[list[str], list[int], list[str]]:
    """`per_pair` prompts per (digit, direction) in the held-out phrasings (taken in turn), pair by pair (digit-major),
    with their digits and directions."""
    rows = [
        (motion_caption(d, way, i, HELD_OUT_TEMPLATES), d, way)
        for d in range(len(DIGIT_WORDS))
        for way in DIRECTIONS
        for i in range(per_pair)
    ]
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def _pattern(template: str) -> re.Pattern:
    def alternatives(words) -> str:
        return "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))

    named = {
        "{name}": f"(?P<name>{alternatives(DIGIT_WORDS)})",
        "{digit}": "(?P<digit>[0-9])",
        "{way}": f"(?P<way>{alternatives(WAY.values())})",
        "{towards}": f"(?P<towards>{alternatives(TOWARDS.values())})",
    }
    parts = re.split(r"(\{name\}|\{digit\}|\{way\}|\{towards\})", template)
    return re.compile("".join(named.get(p, re.escape(p)) for p in parts))


_PATTERNS = [_pattern(t) for t in CAPTION_TEMPLATES + HELD_OUT_TEMPLATES]


def caption_motion(caption: str) -> tuple[int, str] | None:
    """(digit, direction) that a caption in one of the phrasings (training or held out) names; None for other text."""
    for pattern in _PATTERNS:
        match = pattern.fullmatch(caption.strip())
        if match:
            found = match.groupdict()
            digit = int(found["digit"]) if found.get("digit") else DIGIT_WORDS.index(found["name"])
            if found.get("way"):
                return digit, next(k for k, v in WAY.items() if v == found["way"])
            return digit, next(k for k, v in TOWARDS.items() if v == found["towards"])
    return None


def _sprite(image8: np.ndarray, side: int) -> np.ndarray:
    """An 8x8 digit (values 0..16) as a uint8 side x side sprite (bilinear, as the caption folder's digits)."""
    from PIL import Image

    gray = Image.fromarray(np.rint(image8 * 255 / 16).astype(np.uint8))
    return np.asarray(gray.resize((side, side), Image.BILINEAR), dtype=np.uint8)


def _path(direction: str, num_frames: int, height: int, width: int, side: int, rng) -> list[tuple[int, int]]:
    """The sprite's top-left corner per frame: from one edge to the other along the direction's axis, linearly
    (rounded), at a fixed place on the other axis (centered, plus a random offset of up to an eighth of the frame)."""
    t = np.linspace(0.0, 1.0, num_frames)
    span = {"x": width - side, "y": height - side}
    along = "x" if direction in ("left", "right") else "y"
    across = "y" if along == "x" else "x"
    start, end = (span[along], 0) if direction in ("left", "up") else (0, span[along])
    moving = np.rint(start + (end - start) * t).astype(int)
    reach = span[across] // 2
    wobble = int(rng.integers(-(reach // 4), reach // 4 + 1)) if reach >= 4 else 0
    fixed = np.full(num_frames, reach + wobble)
    xs, ys = (moving, fixed) if along == "x" else (fixed, moving)
    return list(zip(ys.tolist(), xs.tolist()))


@functools.lru_cache(maxsize=1)
def _digits():
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.images, data.target


def moving_digit_clip(
    index: int, num_frames: int, height: int, width: int, seed: int
) -> tuple[np.ndarray, str, int, str]:
    """Clip `index` of the seeded sequence (uint8 [F, H, W, 3], white on black), its caption, digit and direction:
    the (digit, direction) pairs cycle through all 40 in a shuffled order per cycle, the caption takes the training
    phrasings in turn per cycle, the digit image is drawn from scikit-learn's digits of that class and its sprite is
    half the frame's shorter side (SPRITE_FRACTION). Each clip depends only on (seed, index), so a builder reads any row
    without generating the ones before it."""
    if min(height, width) < 6 or num_frames < 2:
        raise ValueError(
            f"moving digits need frames of at least 6x6 pixels and 2 frames (got {num_frames}x{height}x{width})"
        )
    images, targets = _digits()
    cycle, place = divmod(index, len(PAIRS))
    digit, direction = PAIRS[np.random.default_rng([seed, cycle]).permutation(len(PAIRS))[place]]
    rng = np.random.default_rng([seed, cycle, place, 1])
    side = sprite_side(height, width)
    sprite = _sprite(images[rng.choice(np.flatnonzero(targets == digit))], side)
    clip = np.zeros((num_frames, height, width, 3), dtype=np.uint8)
    for f, (y, x) in enumerate(_path(direction, num_frames, height, width, side, rng)):
        clip[f, y : y + side, x : x + side] = sprite[..., None]
    return clip, motion_caption(digit, direction, cycle), digit, direction


def moving_digit_clips(
    n: int, num_frames: int, height: int, width: int, seed: int
) -> tuple[np.ndarray, list[str], list[int], list[str]]:
    """The first `n` clips of the seeded sequence (`moving_digit_clip`): uint8 [n, F, H, W, 3], captions, digits,
    directions."""
    rows = [moving_digit_clip(i, num_frames, height, width, seed) for i in range(n)]
    clips = np.stack([r[0] for r in rows]) if rows else np.zeros((0, num_frames, height, width, 3), np.uint8)
    return clips, [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows]


def track_direction(frames) -> str | None:
    """The direction a clip (uint8 or float [F, H, W, 3] or [F, H, W]) moves in: each frame's intensity-weighted
    centroid (intensity above the frame's median, so that a generated clip's gray background does not pull it to the
    middle), a least-squares line through the centroids over time, and the axis and sign of its displacement over
    the clip (image rows grow downward). None when fewer than two frames hold anything or it moves less than half
    a pixel."""
    x = np.asarray(frames, dtype=np.float64)
    if x.ndim == 4:
        x = x.mean(axis=-1)
    weights = np.clip(x - np.median(x, axis=(1, 2), keepdims=True), 0.0, None)
    mass = weights.sum(axis=(1, 2))
    keep = mass > 0
    if keep.sum() < 2:
        return None
    rows, cols = np.arange(x.shape[1]), np.arange(x.shape[2])
    cy = (weights.sum(axis=2) @ rows)[keep] / mass[keep]
    cx = (weights.sum(axis=1) @ cols)[keep] / mass[keep]
    t = np.flatnonzero(keep).astype(np.float64)
    span = t[-1] - t[0]
    dy, dx = (np.polyfit(t, c, 1)[0] * span for c in (cy, cx))
    if max(abs(dx), abs(dy)) < 0.5:  # under half a pixel over the clip: still (and free of rounding noise)
        return None
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"
