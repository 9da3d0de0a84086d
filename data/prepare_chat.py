"""Chat conversations (OpenAI ``messages`` .jsonl) -> the LLM's token shards with labels on assistant tokens only.

    python -m data.prepare_chat --tokenizer ~/models/Llama-3.2-1B --input ~/data/chat.jsonl --out data/my_chat
                                [--max-seq-len 8192] [--train-shards 8] [--val-shards 2] [--val-fraction 0.01]
                                [--seed 0] [--force]

Input: ``.jsonl`` files, one ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."},
...]}`` per line. Each conversation is rendered with the tokenizer's chat template exactly as
``apply_chat_template`` renders it (the template places bos and the end-of-turn tokens; nothing is
added), and stored as ``ids.npy`` plus ``mask.npy`` (uint8, 1 on the tokens the loss trains on).

Which tokens are the assistant's: released Llama templates have no ``{% generation %}`` markers,
so the spans are found by rendering prefixes. For assistant message i, the text of messages[:i]
with the generation prompt (``...<|start_header_id|>assistant<|end_header_id|>\\n\\n``) and the text
of messages[:i+1] must both be prefixes of the whole conversation's text; the characters between
their ends are the reply and its end of turn (``...<|eot_id|>``). The whole text is tokenized once
with offsets, and a token is trained on iff it starts inside such a span. So the model learns every
reply and when to stop, never the system/user turns or the headers. A template that renders an
earlier turn differently once later turns follow (e.g. one that drops past reasoning) fails the
prefix check: such conversations are skipped and counted.

Skipped and counted, per row: bad JSON, no ``messages`` list, a message without a string ``role``
and ``content``, no assistant turn, a role or order the template refuses (its
``raise_exception``), a template that does not render incrementally, and -- the length rule -- a
conversation of more than ``--max-seq-len`` tokens, which is dropped whole (never cut: a cut reply
would teach the model to stop mid-sentence). meta.json records each count; training refuses a
dataset whose longest conversation exceeds ``data.max_seq_len``.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from data import user_data

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

DEFAULT_MAX_SEQ_LEN = 8192
TOO_LONG = "longer than --max-seq-len"
CHAT_PREP = {
    "render": "apply_chat_template(messages, tokenize=False), tokenized without special tokens",
    "labels": "tokens starting in [render(m[:i], gen prompt), render(m[:i+1])) for assistant message i",
    "too_long": "dropped whole",
}


def _check_messages(row: object) -> list[dict]:
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
        raise user_data.Skip("no messages list")
    messages = row["messages"]
    if not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise user_data.Skip("a message without a string role and content")
    if not any(m["role"] == "assistant" for m in messages):
        raise user_data.Skip("no assistant turn")
    return messages


def read_chat_file(path: str) -> tuple[list[list[dict]], collections.Counter]:
    """The conversations of one ``.jsonl`` file and its skipped rows by reason. Read line by line: a bad
    row is skipped on its own (Arrow's JSON reader, behind ``datasets``, fails the whole file at one)."""
    if Path(path).suffix.lower() != ".jsonl":
        raise user_data.Skip(f"unsupported suffix ({Path(path).suffix or 'none'}; expected .jsonl)")
    conversations, rows = [], collections.Counter()
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    conversations.append(_check_messages(json.loads(line)))
                except json.JSONDecodeError:
                    rows["bad JSON"] += 1
                except user_data.Skip as exc:
                    rows[str(exc)] += 1
    except (OSError, UnicodeDecodeError) as exc:
        raise user_data.Skip(f"unreadable ({user_data.reason_of(exc)})") from None
    return conversations, rows


def assistant_spans(tokenizer: PreTrainedTokenizerFast, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character spans of its assistant turns (see the module doc)."""
    from jinja2 import TemplateError

    def render(part: list[dict], prompt: bool) -> str:
        return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt)

    try:
        text = render(messages, False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt, through = render(messages[:i], True), render(messages[: i + 1], False)
            if not (text.startswith(prompt) and text.startswith(through) and len(prompt) < len(through)):
                raise user_data.Skip("not rendered incrementally by the chat template")
            spans.append((len(prompt), len(through)))
    except (TemplateError, TypeError, KeyError) as exc:  # raise_exception in the template, or content it cannot take
        raise user_data.Skip(f"refused by the chat template ({user_data.reason_of(exc)})") from None
    return text, spans


def encode_conversation(tokenizer: PreTrainedTokenizerFast, messages: list[dict]) -> dict[str, np.ndarray]:
    """``{"ids": token ids, "mask": 1 on assistant tokens}`` of one conversation; ``user_data.Skip`` if it cannot be."""
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = [a for a, _ in spans]
    # Token j is the assistant's iff its first character lies in a span [a, b).
    mask = []
    for tok_start, _ in enc["offset_mapping"]:
        k = bisect.bisect_right(starts, tok_start) - 1
        mask.append(k >= 0 and tok_start < spans[k][1])
    return {
        "ids": np.asarray(enc["input_ids"], dtype=user_data.ids_dtype(tokenizer)),
        "mask": np.asarray(mask, dtype=np.uint8),
    }


def encode_chats(
    tokenizer: PreTrainedTokenizerFast,
    files: list[tuple[str, list[list[dict]]]],
    skipped_rows: collections.Counter,
    *,
    max_seq_len: int,
) -> tuple[list[dict], dict]:
    """Every conversation that encodes and fits, in order; the others are counted in ``skipped_rows``."""
    encoded = []
    for _, conversations in files:
        for messages in conversations:
            try:
                sample = encode_conversation(tokenizer, messages)
            except user_data.Skip as exc:
                skipped_rows[str(exc)] += 1
                continue
            if sample["ids"].size > max_seq_len:
                skipped_rows[TOO_LONG] += 1
            elif not sample["mask"].any():  # e.g. an empty reply that the template trims away
                skipped_rows["no assistant token"] += 1
            else:
                encoded.append(sample)
    if not encoded:
        reasons = ", ".join(f"{n} {r}" for r, n in skipped_rows.most_common())
        raise ValueError(f"no conversation could be used ({reasons})")
    return encoded, {
        "conversations": len(encoded),
        "dropped_too_long": skipped_rows[TOO_LONG],
        "max_seq_len": max_seq_len,
        "labelled_tokens": int(sum(s["mask"].sum() for s in encoded)),
        "chat_template_sha256": hashlib.sha256(tokenizer.chat_template.encode()).hexdigest(),
    }


def main(argv: list[str] | None = None) -> int:
    return user_data.templated_cli(
        argv,
        module="data.prepare_chat",
        doc=__doc__,
        fmt="chat",
        default_max_seq_len=DEFAULT_MAX_SEQ_LEN,
        max_seq_len_help="conversations with more tokens are dropped (and counted); "
        "train with data.max_seq_len >= the longest kept",
        prep=CHAT_PREP,
        read=read_chat_file,
        encode=encode_chats,
        describe=lambda meta: (
            f"{meta['conversations']:,} conversations ({meta['dropped_too_long']} dropped as longer "
            f"than {meta['max_seq_len']} tokens), {meta['labelled_tokens']:,} assistant tokens of "
            f"{meta['tokens']['train'] + meta['tokens']['val']:,}"
        ),
        need_template=True,
    )


if __name__ == "__main__":
    sys.exit(main())
