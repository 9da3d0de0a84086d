"""Prompts for online RL (GRPO, issue 46) -> the run's prompt shards: each prompt tokenized as TRL's GRPOTrainer
tokenizes it, with the row's other fields (the answers the rewards read) kept beside it.

    python -m data.prepare_prompts --tokenizer ~/models/Llama-3.2-1B --input ~/data/gsm8k.jsonl --out data/my_prompts
                                   [--max-prompt-len 512] [--train-shards 8] [--val-shards 2] [--val-fraction 0.01]
                                   [--seed 0] [--force]

Input: ``.jsonl`` files (one row per line) or ``.json`` files (a list of rows), each row a JSON object with

- ``prompt``: a string (TRL's standard format: tokenized as the tokenizer does alone, its bos included, no chat
  template) or a list of messages (TRL's conversational format, ``[{"role": "system"|"user"|"assistant",
  "content": "..."}, ...]``, ending in a user turn: rendered with the tokenizer's chat template and its generation
  prompt, ``apply_chat_template(messages, add_generation_prompt=True)``, as GRPOTrainer renders it);
- any other fields (``answer``, ``format_pattern``, ...): kept as they are and handed to the reward functions, one
  value per completion, as TRL hands a dataset's columns (common/rewards.py).

Each prompt is one sample: ``ids.npy`` (its token ids) and ``json`` (``{"prompt": ..., <the other fields>}``, the
row as given). Skipped and counted, per row: bad JSON, not an object, no prompt, a prompt neither a string nor a
message list (or messages without a string role and content), messages that end in an assistant turn, messages when
the tokenizer has no chat template, what the chat template refuses, and a prompt of more than ``--max-prompt-len``
tokens (dropped, never cut). meta.json records each count, the fields found and the longest prompt.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import sys
from typing import TYPE_CHECKING

import numpy as np

from data import cli, user_data
from data.prepare_preference import read_pairs_file

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

FORMAT = "prompts"  # meta.json "format"
DEFAULT_MAX_PROMPT_LEN = 512
TOO_LONG = "prompt longer than --max-prompt-len"
NO_TEMPLATE = "messages, and the tokenizer has no chat template"
PROMPTS_PREP = {
    "text": "tokenizer(prompt)['input_ids']",
    "chat": "apply_chat_template(messages, add_generation_prompt=True, tokenize=True)",
    "fields": "json: the row as given",
    "too_long": "dropped whole",
}


def parse_prompt(row: object) -> dict:
    """One row -> ``{"prompt": str | [messages], "fields": {other fields}}``; ``user_data.Skip`` with the reason."""
    if not isinstance(row, dict):
        raise user_data.Skip("not a JSON object")
    prompt = row.get("prompt")
    if prompt in (None, "", []):
        raise user_data.Skip("no prompt")
    if not isinstance(prompt, str):
        if not isinstance(prompt, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        ):
            raise user_data.Skip("a prompt neither a string nor a message list")
        if prompt[-1]["role"] == "assistant":
            raise user_data.Skip("messages that end in an assistant turn")
    return {"prompt": prompt, "fields": {k: v for k, v in row.items() if k != "prompt"}}


def read_prompts_file(path: str) -> tuple[list[dict], collections.Counter]:
    """The usable prompts of one ``.jsonl``/``.json`` file and its skipped rows by reason."""
    return read_pairs_file(path, parse=parse_prompt)


def prompt_ids(tokenizer: PreTrainedTokenizerFast, prompt: str | list[dict]) -> list[int]:
    """The prompt's token ids, as TRL's GRPOTrainer._tokenize_prompts makes them."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if not tokenizer.chat_template:
        raise user_data.Skip(NO_TEMPLATE)
    from jinja2 import TemplateError

    try:
        out = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
    except (TemplateError, TypeError, KeyError) as exc:
        raise user_data.Skip(f"refused by the chat template ({user_data.reason_of(exc)})") from None
    return list(out["input_ids"])


def encode_prompts(
    tokenizer: PreTrainedTokenizerFast,
    files: list[tuple[str, list[dict]]],
    skipped_rows: collections.Counter,
    *,
    max_prompt_len: int,
) -> tuple[list[dict], dict]:
    """Every prompt that encodes and fits, in order; the others are counted in ``skipped_rows``."""
    encoded, fields = [], collections.Counter()
    for _, rows in files:
        for row in rows:
            try:
                ids = prompt_ids(tokenizer, row["prompt"])
            except user_data.Skip as exc:
                skipped_rows[str(exc)] += 1
                continue
            if len(ids) > max_prompt_len:
                skipped_rows[TOO_LONG] += 1
                continue
            fields.update(row["fields"].keys())
            record = {"prompt": row["prompt"], **row["fields"]}
            encoded.append({"ids": np.asarray(ids, dtype=user_data.ids_dtype(tokenizer)), "json": json.dumps(record)})
    if not encoded:
        reasons = ", ".join(f"{n} {r}" for r, n in skipped_rows.most_common())
        raise ValueError(f"no prompt could be used ({reasons})")
    return encoded, {
        "prompts": len(encoded),
        "dropped_too_long": skipped_rows[TOO_LONG],
        "max_prompt_len": max_prompt_len,
        "fields": dict(sorted(fields.items())),  # each field's name and the prompts that have it
    }


def decode_prompt(sample: dict) -> dict:
    """A raw shard sample -> ``{"ids": [token ids], "prompt": ..., <the row's other fields>}``."""
    import io

    ids = np.load(io.BytesIO(sample["ids.npy"]), allow_pickle=False)
    record = json.loads(sample["json"])
    return {"ids": ids.astype(np.int64).tolist(), **record}


def main(argv: list[str] | None = None) -> int:
    def extra(parser: argparse.ArgumentParser, positive_int) -> None:
        user_data.add_arguments(parser, required=True)
        parser.add_argument(
            "--max-prompt-len",
            type=positive_int,
            default=DEFAULT_MAX_PROMPT_LEN,
            help="prompts with more tokens are dropped (and counted)",
        )

    parser = cli.arg_parser(
        "python -m data.prepare_prompts",
        __doc__.splitlines()[0],
        "output directory (created; must be empty or a previous prompts build)",
        extra=extra,
        seed_help="seed of the train/val split",
    )
    parser.set_defaults(val_fraction=user_data.DEFAULT_VAL_FRACTION)
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))

    def options(tokenizer) -> dict:
        return {
            "max_prompt_len": args.max_prompt_len,
            "chat_template_sha256": hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest(),
            "prep_fingerprint": hashlib.sha256(json.dumps(PROMPTS_PREP, sort_keys=True).encode()).hexdigest()[:16],
        }

    return user_data.run_cli(
        args,
        fmt=FORMAT,
        options=options,
        read=read_prompts_file,
        encode=lambda tok, files, rows: encode_prompts(tok, files, rows, max_prompt_len=args.max_prompt_len),
        describe=lambda meta: (
            f"{meta['prompts']:,} prompts ({meta['dropped_too_long']} dropped as longer than {meta['max_prompt_len']} "
            f"tokens), fields: {', '.join(meta['fields']) or 'none'}"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
