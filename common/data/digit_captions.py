"""The captioned digits' language (the text-to-image demo, data.prepare_captions --digits, and its tests): a digit
in several phrasings for training ("a handwritten seven", "the digit 7", ...) and phrasings that no training image
is captioned with, which the prompt-adherence eval (recipes/t2i/evaluate.py) prompts with."""

from __future__ import annotations

import re

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# "{name}" is the digit's word, "{digit}" its numeral.
CAPTION_TEMPLATES = (
    "a handwritten {name}",
    "the digit {digit}",
    "a picture of the number {name}",
    "{name}, written by hand",
)
# Held out: used for no training caption, so a model that follows them generalizes over phrasing rather than
# recalling a caption it trained on. Each reuses words the training captions hold, in an order none of them has.
HELD_OUT_TEMPLATES = (
    "the handwritten digit {digit}",
    "a drawing of the number {name}",
)


def digit_caption(digit: int, phrasing: int, templates: tuple[str, ...] = CAPTION_TEMPLATES) -> str:
    """The `phrasing`-th caption (mod the templates) of `digit`."""
    return templates[phrasing % len(templates)].format(name=DIGIT_WORDS[digit], digit=digit)


def held_out_prompts(per_digit: int) -> tuple[list[str], list[int]]:
    """`per_digit` prompts per digit in the held-out phrasings (taken in turn), digit by digit, and their digits."""
    pairs = [(digit_caption(d, i, HELD_OUT_TEMPLATES), d) for d in range(len(DIGIT_WORDS)) for i in range(per_digit)]
    return [p for p, _ in pairs], [d for _, d in pairs]


def _pattern(template: str) -> re.Pattern:
    parts = re.split(r"(\{name\}|\{digit\})", template)
    named = {"{name}": f"(?P<name>{'|'.join(DIGIT_WORDS)})", "{digit}": "(?P<digit>[0-9])"}
    return re.compile("".join(named.get(p, re.escape(p)) for p in parts))


_PATTERNS = [_pattern(t) for t in CAPTION_TEMPLATES + HELD_OUT_TEMPLATES]


def caption_digit(caption: str) -> int | None:
    """The digit a caption in one of the phrasings names; None for any other text."""
    for pattern in _PATTERNS:
        match = pattern.fullmatch(caption.strip())
        if match:
            return int(match["digit"]) if match.groupdict().get("digit") else DIGIT_WORDS.index(match["name"])
    return None
