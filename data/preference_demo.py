"""The preference demo's data (docs/preference.md#demo): a tiny model is taught, by DPO, to end its answers with "!";
with ``--vlm``, a tiny VLM to name the digit in an image as a word ("The digit is seven.", not "The digit is 7.").

    python -m data.preference_demo --out data/my_pref_demo [--chat-rows 1200] [--pairs 480] [--seed 0]
    python -m data.preference_demo --vlm --out data/my_vpref_demo [--chat-rows 1527] [--pairs 480] [--held-out 100]

writes into ``--out`` (the LLM demo):

- ``tokenizer/``: the tiny Llama 3 tokenizer (data/tiny_llama_tokenizer.py), with its chat template;
- ``chat.jsonl``: single-turn conversations (OpenAI ``messages``, what ``data.prepare_chat`` reads) asking for the
  opposite of a word, every word and phrasing of the demo; the answer "The opposite of hot is cold." in four rows of
  five, "The opposite of hot is cold!" in the fifth: the property (an answer ending in "!") is mostly absent, so the
  supervised model's greedy answer ends in ".";
- ``pairs.jsonl``: preference pairs in TRL's conversational layout (what ``data.prepare_preference`` reads), the
  chosen answer ending in "!", the rejected one the same answer ending in ".", over the TRAIN_WORDS asked in the
  TRAIN_PHRASINGS only;
- ``held_out.jsonl``: pairs in the same layout for every prompt no pair of ``pairs.jsonl`` uses (a HELD_OUT_WORDS
  word in any phrasing, or a TRAIN_WORDS word in the HELD_OUT_PHRASING), one a prompt: what the demo's evaluation
  (scripts/preference_demo.py) measures the preference and the greedy generations on.

and with ``--vlm`` (the VLM demo, on scikit-learn's digits split as data.prepare_vlm_digits splits them by default, so
that its held-out images are ones no run of the VLM digits demo trains on either):

- ``images/``: the digits as 8x8 grayscale PNGs (data.prepare_digits' pixels), ``train/NNNN.png`` and ``val/NNNN.png``
  named by their row of ``load_digits()``;
- ``chat.json``: LLaVA-format conversations (what ``data.prepare_llava`` reads, with ``--images images``), one a
  training image, asking what digit it shows in one of data.prepare_vlm_digits' phrasings; the answer "The digit is
  7." in four rows of five, "The digit is seven." in the fifth;
- ``pairs.jsonl``: preference pairs with images in TRL's vision layout (``"images": ["train/0001.png"]``, the prompt's
  ``<image>`` where the image goes; what ``data.prepare_preference --images`` reads), on training images asked in
  VLM_TRAIN_QUESTIONS, the chosen answer naming the digit as a word, the rejected one as a numeral;
- ``held_out.jsonl``: pairs in the same layout on validation images (``--held-out`` of them, as many of each digit),
  asked in every phrasing in turn: images no training run sees.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

from data import prepare_digits
from data.prepare_vlm_digits import NUMBER_WORDS, QUESTIONS
from data.tiny_llama_tokenizer import OPPOSITES, write_llama_tokenizer

TRAIN_WORDS = tuple(OPPOSITES)
HELD_OUT_WORDS = (("soft", "hard"), ("near", "far"), ("rich", "poor"), ("thick", "thin"), ("loud", "quiet"))
TRAIN_PHRASINGS = ("What is the opposite of {a}?", "Name the opposite of {a}.")
HELD_OUT_PHRASING = "Tell me the opposite of {a}."
PROPERTY_SHARE = 0.2  # of the supervised answers that end in "!"


def answer(a: str, b: str, exclaim: bool) -> str:
    return f"The opposite of {a} is {b}" + ("!" if exclaim else ".")


def has_property(text: str) -> bool:
    """The property the pairs prefer: the answer ends in "!"."""
    return text.strip().endswith("!")


def pair_row(question: str, a: str, b: str) -> dict:
    """TRL's conversational layout: the chosen answer has the property, the rejected one is the same without it."""
    return {
        "prompt": [{"role": "user", "content": question}],
        "chosen": [{"role": "assistant", "content": answer(a, b, True)}],
        "rejected": [{"role": "assistant", "content": answer(a, b, False)}],
    }


def train_prompts() -> list[tuple[str, str, str]]:
    return [(p.format(a=a), a, b) for a, b in TRAIN_WORDS for p in TRAIN_PHRASINGS]


def held_out_prompts() -> list[tuple[str, str, str]]:
    every = (*TRAIN_PHRASINGS, HELD_OUT_PHRASING)
    return [(p.format(a=a), a, b) for a, b in HELD_OUT_WORDS for p in every] + [
        (HELD_OUT_PHRASING.format(a=a), a, b) for a, b in TRAIN_WORDS
    ]


def chat_rows(n: int, rng: random.Random) -> list[dict]:
    """Every word in every phrasing (the supervised model knows them all), the property in PROPERTY_SHARE of them."""
    prompts = [
        (p.format(a=a), a, b) for a, b in (*TRAIN_WORDS, *HELD_OUT_WORDS) for p in (*TRAIN_PHRASINGS, HELD_OUT_PHRASING)
    ]
    rows = []
    for i in range(n):
        question, a, b = prompts[i % len(prompts)]
        reply = answer(a, b, rng.random() < PROPERTY_SHARE)
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]})
    rng.shuffle(rows)
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def build(out: Path, chat: int, pairs: int, seed: int) -> dict:
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    write_llama_tokenizer(out / "tokenizer")
    write_jsonl(out / "chat.jsonl", chat_rows(chat, rng))
    prompts = train_prompts()
    write_jsonl(out / "pairs.jsonl", [pair_row(*prompts[i % len(prompts)]) for i in range(pairs)])
    held_out = held_out_prompts()
    write_jsonl(out / "held_out.jsonl", [pair_row(*p) for p in held_out])
    return {"conversations": chat, "pairs": pairs, "held_out": len(held_out)}


# --- the VLM demo: digit images, the property an answer that names the digit as a word ----------------------------

VLM_TRAIN_QUESTIONS = QUESTIONS[:6]  # the phrasings pairs use; held-out pairs take all of QUESTIONS in turn
VLM_SPLIT = {"val_fraction": 0.15, "seed": 0}  # data.prepare_vlm_digits' default split
_DIGIT_RE = re.compile(r"(?<![0-9a-z])(" + "|".join(NUMBER_WORDS) + r"|[0-9])(?![0-9a-z])")


def digit_answer(label: int, word: bool) -> str:
    return f"The digit is {NUMBER_WORDS[label] if word else label}."


def vlm_pair_row(image: str, question: str, label: int) -> dict:
    """TRL's vision layout: the chosen answer names the digit as a word, the rejected one as a numeral."""
    return {
        "images": [image],
        "prompt": [{"role": "user", "content": "<image>" + question}],
        "chosen": [{"role": "assistant", "content": digit_answer(label, True)}],
        "rejected": [{"role": "assistant", "content": digit_answer(label, False)}],
    }


def digits_named(text: str) -> set[str]:
    """The digits a text names, each as it is written ("seven", "7")."""
    return set(_DIGIT_RE.findall(text.lower()))


def _pair_digit(row: dict) -> int:
    """The digit of a VLM pair: the numeral its rejected answer names."""
    return int(re.search(r"[0-9]", row["rejected"][-1]["content"]).group())


def shows_property(row: dict, text: str) -> bool:
    """The property a demo's pairs prefer, in a generation for the pair's prompt: the answer ends in "!" (LLM), the
    answer names the image's digit as a word (VLM)."""
    if "images" not in row:
        return has_property(text)
    return NUMBER_WORDS[_pair_digit(row)] in digits_named(text)


def keeps_content(row: dict, text: str) -> bool:
    """The generation still says the pair's answer: the right opposite (LLM), the right digit in either form (VLM,
    and no other digit)."""
    if "images" not in row:
        return text.rstrip("!.") == row["rejected"][-1]["content"].rstrip("!.")
    digit = _pair_digit(row)
    return digits_named(text) in ({str(digit)}, {NUMBER_WORDS[digit]}, {str(digit), NUMBER_WORDS[digit]})


def _write_png(images: Path, split: str, row: int, pixels) -> str:
    name = f"{split}/{row:04d}.png"
    (images / name).write_bytes(prepare_digits.encode_png(pixels))
    return name


def _held_out_rows(labels, val_rows, n: int) -> list[int]:
    """n validation rows, as many of each digit (in row order), interleaved digit by digit."""
    per_digit = [[r for r in val_rows if labels[r] == d] for d in range(len(NUMBER_WORDS))]
    take = -(-n // len(per_digit))
    return [rows[i] for i in range(take) for rows in per_digit if i < len(rows)][:n]


def build_vlm(out: Path, chat: int, pairs: int, held_out: int, seed: int) -> dict:
    rng = random.Random(seed)
    pixels, labels, split = prepare_digits.load_split(**VLM_SPLIT)
    images = out / "images"
    for name in ("train", "val"):
        (images / name).mkdir(parents=True, exist_ok=True)
    train = [(_write_png(images, "train", int(r), pixels[r]), int(labels[r])) for r in sorted(split["train"])]
    conversations = []
    for i in range(chat):
        image, label = train[i % len(train)]
        reply = digit_answer(label, rng.random() < PROPERTY_SHARE)
        turns = [{"from": "human", "value": "<image>" + rng.choice(QUESTIONS)}, {"from": "gpt", "value": reply}]
        conversations.append({"id": f"chat_{i:06d}", "image": image, "conversations": turns})
    rng.shuffle(conversations)
    (out / "chat.json").write_text(json.dumps(conversations))
    picked = rng.sample(range(len(train)), min(pairs, len(train)))
    picked += [rng.randrange(len(train)) for _ in range(pairs - len(picked))]
    write_jsonl(
        out / "pairs.jsonl",
        [
            vlm_pair_row(train[t][0], VLM_TRAIN_QUESTIONS[i % len(VLM_TRAIN_QUESTIONS)], train[t][1])
            for i, t in enumerate(picked)
        ],
    )
    rows = _held_out_rows(labels, sorted(int(r) for r in split["val"]), held_out)
    held = [
        vlm_pair_row(_write_png(images, "val", r, pixels[r]), QUESTIONS[i % len(QUESTIONS)], int(labels[r]))
        for i, r in enumerate(rows)
    ]
    write_jsonl(out / "held_out.jsonl", held)
    return {"conversations": chat, "pairs": pairs, "held_out": len(held), "train_images": len(train)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data.preference_demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for tokenizer/ (images/) and the data files")
    parser.add_argument("--vlm", action="store_true", help="the VLM demo: digit images, the digit named as a word")
    parser.add_argument(
        "--chat-rows", type=int, default=None, help="supervised conversations (default 1200; --vlm: 1527, one an image)"
    )
    parser.add_argument("--pairs", type=int, default=480, help="training preference pairs")
    parser.add_argument("--held-out", type=int, default=100, help="--vlm: held-out pairs, one a validation image")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    chat = args.chat_rows if args.chat_rows is not None else (1527 if args.vlm else 1200)
    if chat < 1 or args.pairs < 1 or args.held_out < 1:
        parser.error("--chat-rows, --pairs and --held-out must be >= 1")
    if not args.vlm:
        counts = build(args.out, chat, args.pairs, args.seed)
        print(
            f"kiln: wrote {args.out}: tokenizer/, chat.jsonl ({counts['conversations']} conversations), pairs.jsonl "
            f"({counts['pairs']} pairs), held_out.jsonl ({counts['held_out']} pairs)"
        )
        return 0
    counts = build_vlm(args.out, chat, args.pairs, args.held_out, args.seed)
    print(
        f"kiln: wrote {args.out}: images/ ({counts['train_images']} training images, {counts['held_out']} held-out), "
        f"chat.json ({counts['conversations']} conversations), pairs.jsonl ({counts['pairs']} pairs), held_out.jsonl "
        f"({counts['held_out']} pairs)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
