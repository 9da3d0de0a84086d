"""The preference demo's data (docs/preference.md#demo): a tiny model is taught, by DPO, to end its answers with "!".

    python -m data.preference_demo --out data/my_pref_demo [--chat-rows 1200] [--pairs 480] [--seed 0]

writes into ``--out``:

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
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data.preference_demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for tokenizer/ and the .jsonl files")
    parser.add_argument("--chat-rows", type=int, default=1200, help="supervised conversations")
    parser.add_argument("--pairs", type=int, default=480, help="training preference pairs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.chat_rows < 1 or args.pairs < 1:
        parser.error("--chat-rows and --pairs must be >= 1")
    counts = build(args.out, args.chat_rows, args.pairs, args.seed)
    print(
        f"kiln: wrote {args.out}: tokenizer/, chat.jsonl ({counts['conversations']} conversations), pairs.jsonl "
        f"({counts['pairs']} pairs), held_out.jsonl ({counts['held_out']} pairs)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
