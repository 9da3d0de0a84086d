"""The GRPO demo's data (docs/rl.md#the-demo): a tiny Llama, fine-tuned on answers that end in "." four times in five,
learns by reward alone to end them in "!".

    python -m data.grpo_demo --out data/my_grpo_demo [--chat-rows 1200] [--seed 0]

writes into ``--out``:

- ``tokenizer/``: the tiny Llama 3 tokenizer (data/tiny_llama_tokenizer.py), with its chat template;
- ``chat.jsonl``: the supervised warm start, the preference demo's conversations (data/preference_demo.py): every
  word in every phrasing asked for its opposite, the answer "The opposite of hot is cold." in four rows of five,
  "The opposite of hot is cold!" in the fifth, so the supervised model's greedy answer ends in ".";
- ``prompts.jsonl``: every word in every phrasing once (17 words x 3 phrasings), as messages, with the
  ``format_pattern`` that ``common.rewards:format_match`` reads: the answer with the right opposite, ending in "!"
  (target_pattern). data.prepare_prompts' split holds some out (``--val-fraction``): the GRPO run's held-out evaluation.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from pathlib import Path

from data.preference_demo import (
    HELD_OUT_PHRASING,
    HELD_OUT_WORDS,
    TRAIN_PHRASINGS,
    TRAIN_WORDS,
    answer,
    chat_rows,
    write_jsonl,
)
from data.tiny_llama_tokenizer import write_llama_tokenizer


def target_pattern(a: str, b: str) -> str:
    """The reward's regex: the completion opens with the answer for (a, b) ending in "!". What follows is not read:
    the chat template ends a turn with <|eot_id|>, whereas the engine stops at the export's eos (<|end_of_text|>) or
    at grpo.max_completion_length."""
    return "^" + re.escape(answer(a, b, True))


def prompt_rows() -> list[dict]:
    """Every word in every phrasing, asked once."""
    return [
        {"prompt": [{"role": "user", "content": p.format(a=a)}], "format_pattern": target_pattern(a, b)}
        for a, b in (*TRAIN_WORDS, *HELD_OUT_WORDS)
        for p in (*TRAIN_PHRASINGS, HELD_OUT_PHRASING)
    ]


def build(out: Path, chat: int, seed: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    write_llama_tokenizer(out / "tokenizer")
    write_jsonl(out / "chat.jsonl", chat_rows(chat, random.Random(seed)))
    prompts = prompt_rows()
    write_jsonl(out / "prompts.jsonl", prompts)
    return {"conversations": chat, "prompts": len(prompts)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data.grpo_demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for tokenizer/, chat.jsonl, prompts.jsonl")
    parser.add_argument("--chat-rows", type=int, default=1200, help="supervised conversations")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.chat_rows < 1:
        parser.error("--chat-rows must be >= 1")
    counts = build(args.out, args.chat_rows, args.seed)
    print(
        f"kiln: wrote {args.out}: tokenizer/, chat.jsonl ({counts['conversations']} conversations), prompts.jsonl "
        f"({counts['prompts']} prompts)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
