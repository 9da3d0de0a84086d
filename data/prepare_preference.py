"""Preference pairs (TRL's layouts, UltraFeedback's) -> the LLM's pair shards: both answers of a pair tokenized with
the prompt, labels on the answers only.

    python -m data.prepare_preference --tokenizer ~/models/Llama-3.2-1B --input ~/data/pairs.jsonl
                                      --out data/my_pairs [--max-seq-len 2048] [--train-shards 8] [--val-shards 2]
                                      [--val-fraction 0.01] [--seed 0] [--force]

Input: ``.jsonl`` files (one row per line) or ``.json`` files (a list of rows), each row one of

- TRL's standard format: ``{"prompt": "...", "chosen": "...", "rejected": "..."}``: plain text, the prompt
  tokenized as the tokenizer does alone (its bos), each answer without special tokens, then eos, as TRL's
  DPOTrainer tokenizes it;
- TRL's conversational format: ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``, or
  without ``prompt`` (implicit: the conversations' shared head), or UltraFeedback-binarized's
  ``{"prompt": "...", "chosen": [user, assistant], "rejected": [user, assistant], ...}`` (its string prompt repeats
  the user turn and is not used); rendered with the tokenizer's chat template as ``data.prepare_chat`` renders a
  conversation, the answer being the last assistant turn (its text and end of turn).

A pair is stored as one sample: ``ids.npy`` the chosen document (prompt + chosen answer) then the rejected one
(prompt + rejected answer), ``mask.npy`` (uint8) 1 on the chosen answer's tokens, 2 on the rejected's, 0 on the
prompts, ``lens.npy`` the two documents' lengths. Training packs both into one row as two documents that never attend
to each other (recipes/llm/preference.py), so a pair must fit ``--max-seq-len`` tokens in all.

Skipped and counted, per row: bad JSON, a missing or empty side, chosen equal to rejected, a layout none of the above,
an answer that is not one final assistant turn, what the chat template refuses or does not render incrementally,
a prompt alone over the length budget (half of ``--max-seq-len``: no room for its answers), and a pair over
``--max-seq-len`` (dropped whole, never cut). meta.json records each count.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from data import user_data
from data.prepare_chat import assistant_spans

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

DEFAULT_MAX_SEQ_LEN = 2048
PROMPT_TOO_LONG = "prompt alone over the length budget"
PAIR_TOO_LONG = "pair longer than --max-seq-len"
PREFERENCE_PREP = {
    "text": "tokenizer(prompt) + tokenizer(answer, add_special_tokens=False) + eos",
    "chat": "apply_chat_template(prompt + [answer]); labels on the last assistant turn's span",
    "pair": "ids = chosen document + rejected document; mask 1 chosen answer, 2 rejected answer",
    "too_long": "dropped whole",
}


def _messages(value: object) -> list[dict] | None:
    """``value`` as a list of messages, None if it is not one."""
    if (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
    ):
        return value
    return None


def parse_pair(row: object) -> dict:
    """One row -> ``{"kind": "text", "prompt", "chosen", "rejected"}`` (strings) or ``{"kind": "chat", "prompt":
    [messages], "chosen": message, "rejected": message}``; ``user_data.Skip`` with the reason if it is neither."""
    if not isinstance(row, dict):
        raise user_data.Skip("not a JSON object")
    chosen, rejected, prompt = row.get("chosen"), row.get("rejected"), row.get("prompt")
    if chosen in (None, "", []) or rejected in (None, "", []):
        raise user_data.Skip("a missing side (chosen or rejected)")
    if chosen == rejected:
        raise user_data.Skip("chosen equals rejected")
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str) or not prompt:
            raise user_data.Skip("text answers without a text prompt")
        return {"kind": "text", "prompt": prompt, "chosen": chosen, "rejected": rejected}
    chosen, rejected = _messages(chosen), _messages(rejected)
    if chosen is None or rejected is None:
        raise user_data.Skip("chosen/rejected neither strings nor message lists")
    head = _messages(prompt) or []
    if isinstance(prompt, str) and prompt and chosen[0]["role"] == "assistant":
        head = [{"role": "user", "content": prompt}]  # a bare string prompt before assistant-only answers
    full_c, full_r = head + chosen, head + rejected
    if full_c[:-1] != full_r[:-1]:
        raise user_data.Skip("chosen and rejected differ before their last turn")
    if full_c[-1]["role"] != "assistant" or full_r[-1]["role"] != "assistant" or len(full_c) < 2:
        raise user_data.Skip("an answer that is not one final assistant turn after a prompt")
    return {"kind": "chat", "prompt": full_c[:-1], "chosen": full_c[-1], "rejected": full_r[-1]}


def read_pairs_file(path: str) -> tuple[list[dict], collections.Counter]:
    """The usable pairs of one ``.jsonl``/``.json`` file and its skipped rows by reason."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".jsonl", ".json"):
        raise user_data.Skip(f"unsupported suffix ({suffix or 'none'}; expected .jsonl or .json)")
    pairs, rows = [], collections.Counter()
    try:
        with open(path, encoding="utf-8") as f:
            if suffix == ".json":
                try:
                    raw = json.load(f)
                except json.JSONDecodeError as exc:
                    raise user_data.Skip(f"bad JSON ({user_data.reason_of(exc)})") from None
                if not isinstance(raw, list):
                    raise user_data.Skip("a .json file that is not a list of rows")
                items = iter(raw)
            else:
                items = (line for line in f if line.strip())
            for item in items:
                try:
                    pairs.append(parse_pair(json.loads(item) if suffix == ".jsonl" else item))
                except json.JSONDecodeError:
                    rows["bad JSON"] += 1
                except user_data.Skip as exc:
                    rows[str(exc)] += 1
    except (OSError, UnicodeDecodeError) as exc:
        raise user_data.Skip(f"unreadable ({user_data.reason_of(exc)})") from None
    return pairs, rows


def encode_document(tokenizer: PreTrainedTokenizerFast, pair: dict, side: str) -> tuple[list[int], list[bool]]:
    """(ids, answer mask) of the prompt followed by the ``side`` answer."""
    if pair["kind"] == "text":
        prompt = tokenizer(pair["prompt"])["input_ids"]
        answer = [*tokenizer(pair[side], add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        return prompt + answer, [False] * len(prompt) + [True] * len(answer)
    text, spans = assistant_spans(tokenizer, [*pair["prompt"], pair[side]])
    start, end = spans[-1]  # the answer: the last assistant turn (earlier ones belong to the prompt)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [start <= a < end for a, _ in enc["offset_mapping"]]


def encode_pair(tokenizer: PreTrainedTokenizerFast, pair: dict, max_seq_len: int) -> dict[str, np.ndarray]:
    """The stored sample of one pair (see the module doc); ``user_data.Skip`` if it cannot be one."""
    (ids_c, mask_c), (ids_r, mask_r) = (encode_document(tokenizer, pair, s) for s in ("chosen", "rejected"))
    prompt_len = mask_c.index(True) if True in mask_c else len(mask_c)
    if 2 * prompt_len >= max_seq_len:
        raise user_data.Skip(PROMPT_TOO_LONG)
    if not any(mask_c) or not any(mask_r):
        raise user_data.Skip("an answer with no token")
    if ids_c == ids_r:
        raise user_data.Skip("chosen equals rejected")
    if len(ids_c) + len(ids_r) > max_seq_len:
        raise user_data.Skip(PAIR_TOO_LONG)
    mask = np.asarray([*mask_c, *(2 * m for m in mask_r)], dtype=np.uint8)
    return {
        "ids": np.asarray(ids_c + ids_r, dtype=user_data.ids_dtype(tokenizer)),
        "mask": mask,
        "lens": np.asarray([len(ids_c), len(ids_r)], dtype=np.int32),
    }


def encode_pairs(
    tokenizer: PreTrainedTokenizerFast,
    files: list[tuple[str, list[dict]]],
    skipped_rows: collections.Counter,
    *,
    max_seq_len: int,
) -> tuple[list[dict], dict]:
    """Every pair that encodes and fits, in order; the others are counted in ``skipped_rows``."""
    encoded = []
    for _, pairs in files:
        for pair in pairs:
            try:
                encoded.append(encode_pair(tokenizer, pair, max_seq_len))
            except user_data.Skip as exc:
                skipped_rows[str(exc)] += 1
    if not encoded:
        reasons = ", ".join(f"{n} {r}" for r, n in skipped_rows.most_common())
        raise ValueError(f"no pair could be used ({reasons})")
    return encoded, {
        "pairs": len(encoded),
        "dropped_too_long": skipped_rows[PAIR_TOO_LONG] + skipped_rows[PROMPT_TOO_LONG],
        "max_seq_len": max_seq_len,
        "answer_tokens": int(sum((s["mask"] > 0).sum() for s in encoded)),
    }


def main(argv: list[str] | None = None) -> int:
    return user_data.templated_cli(
        argv,
        module="data.prepare_preference",
        doc=__doc__,
        fmt="preference",
        default_max_seq_len=DEFAULT_MAX_SEQ_LEN,
        max_seq_len_help="a pair (both documents) with more tokens is dropped (and counted); "
        "train with data.max_seq_len >= it",
        prep=PREFERENCE_PREP,
        read=read_pairs_file,
        encode=encode_pairs,
        describe=lambda meta: (
            f"{meta['pairs']:,} pairs ({meta['dropped_too_long']} dropped as longer than {meta['max_seq_len']} "
            f"tokens), {meta['answer_tokens']:,} answer tokens of {meta['tokens']['train'] + meta['tokens']['val']:,}"
        ),
        need_template=False,
    )


if __name__ == "__main__":
    sys.exit(main())
