"""Preference pairs (TRL's layouts, UltraFeedback's) -> the LLM's pair shards (--tokenizer), or the VLM's (--images).

The LLM's: both answers of a pair tokenized with the prompt, labels on the answers only.

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

Pairs with images, for the VLM (no ``--tokenizer``: the text is stored as it is, and training tokenizes it with
the processor of the model being trained, as data.prepare_llava's conversations):

    python -m data.prepare_preference --input ~/data/rlaif-v.jsonl --images ~/data/rlaif-v-images --out data/vpairs
                                      [--train-shards 8] [--val-shards 2] [--val-fraction 0.01] [--workers N]

Rows in TRL's vision layout (RLAIF-V's, as trl-lib/rlaif-v has it): ``"images": ["a.png", ...]`` (paths under
``--images``) or ``"image": "a.png"``, with ``prompt``, ``chosen`` and ``rejected`` as above (strings or message
lists), a message's content a string with ``<image>`` where an image goes, or OpenAI/TRL parts (``[{"type":
"image"}, {"type": "text", "text": "..."}]``). A prompt with images that places none of them gets them at the start
of its first user turn (as TRL's prepare_multimodal_messages). Stored in data.prepare_llava's shards (its image
checks, split and atomic build), meta.json format ``llava-preference`` (VLM_FORMAT), each sample ``{__key__, json:
{"id", "prompt": [{"role", "content"}] (ending with the user's turn, one ``<image>`` per image, in order),
"chosen": str, "rejected": str, "num_images"}, image0, image1, ...: the image files' bytes}``. Skipped and counted
as above, and also: a missing or undecodable image, ``<image>`` placeholders that do not match the images one to one
(or sit outside user turns), and a row whose images or contents cannot be read (malformed).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from common.data import dataset as common_dataset
from data import cli, prepare_llava, shards, user_data
from data.prepare_chat import assistant_spans

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

DEFAULT_MAX_SEQ_LEN = 2048
PROMPT_TOO_LONG = "prompt alone over the length budget"
PAIR_TOO_LONG = "pair longer than --max-seq-len"
VLM_FORMAT = "llava-preference"  # meta.json "format" of pairs with images (--images): the VLM's preference data
MALFORMED = "malformed"  # a row whose images or message contents cannot be read
KILN_ERROR = "kiln: error"
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


def read_pairs_file(path: str, parse: Callable[[object], dict] = parse_pair) -> tuple[list[dict], collections.Counter]:
    """The usable pairs of one ``.jsonl``/``.json`` file and its skipped rows by reason. A pair whose ``"id"`` is
    None is named by its place, ``file.jsonl:3`` (the third row)."""
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
            for number, item in enumerate(items, 1):
                try:
                    pairs.append(parse(json.loads(item) if suffix == ".jsonl" else item))
                    if pairs[-1].get("id", "") is None:
                        pairs[-1]["id"] = f"{Path(path).name}:{number}"
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


# --- pairs with images: the VLM's layout (--images) ---------------------------------------------------


def _content_text(content: object) -> str | None:
    """A message's content as one string with ``<image>`` where an image goes: a string as it is, OpenAI/TRL parts
    joined in order (an image part is ``<image>``, a text part its text); None if it is neither."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    text = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            text.append(prepare_llava.IMAGE_TOKEN)
        elif kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        else:
            return None
    return "".join(text)


def _string_turns(value: object, answer: bool) -> object:
    """A row's prompt or answer with string contents: a message list's parts joined, an answer string one assistant
    turn; anything else as it is (``parse_pair`` judges it). Skip(MALFORMED) for a message it cannot read."""
    if isinstance(value, str) and value and answer:
        return [{"role": "assistant", "content": value}]
    if not isinstance(value, list):
        return value
    turns = []
    for m in value:
        text = _content_text(m.get("content")) if isinstance(m, dict) and isinstance(m.get("role"), str) else None
        if text is None:
            raise user_data.Skip(MALFORMED)
        turns.append({"role": m["role"], "content": text})
    return turns


def parse_image_pair(row: object) -> dict:
    """One row of TRL's vision layout -> ``{"id", "prompt": [messages], "chosen": str, "rejected": str, "images":
    [relative paths]}``, the prompt's contents strings with one ``<image>`` per image in order (put at the start of
    the first user turn when the prompt names none, as TRL's prepare_multimodal_messages); ``user_data.Skip`` with
    the reason if it cannot be one."""
    if not isinstance(row, dict):
        raise user_data.Skip("not a JSON object")
    if "image" in row and "images" in row:
        raise user_data.Skip(MALFORMED)
    images = row.get("images", row.get("image"))
    images = [] if images is None else [images] if isinstance(images, str) else images
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        raise user_data.Skip(MALFORMED)
    pair = parse_pair({k: _string_turns(row.get(k), k != "prompt") for k in ("prompt", "chosen", "rejected")})
    prompt = [dict(m) for m in pair["prompt"]]
    first_user = next((m for m in prompt if m["role"] == "user"), None)
    if images and first_user and not any(prepare_llava.IMAGE_TOKEN in m["content"] for m in prompt):
        first_user["content"] = prepare_llava.IMAGE_TOKEN * len(images) + first_user["content"]
    for answer in (pair["chosen"], pair["rejected"]):
        if not answer["content"].strip():
            raise user_data.Skip("a missing side (chosen or rejected)")
        turns = [{"from": m["role"], "value": m["content"]} for m in (*prompt, answer)]
        try:  # LLaVA's rules: turns alternate from the user's, one <image> per image, in user turns only
            prepare_llava.to_messages({"images": images, "conversations": turns})
        except prepare_llava.Rejected as exc:
            raise user_data.Skip(exc.reason) from None
    rid = row.get("id")
    return {
        "id": str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) and rid != "" else None,
        "prompt": prompt,
        "chosen": pair["chosen"]["content"],
        "rejected": pair["rejected"]["content"],
        "images": images,
    }


def read_image_pairs_file(path: str) -> tuple[list[dict], collections.Counter]:
    return read_pairs_file(path, parse=parse_image_pair)


def decodable_pairs(
    files: list[tuple[str, list[dict]]], skipped_rows: collections.Counter, images: Path, workers: int
) -> tuple[list[dict], dict]:
    """The pairs whose images all decode (each image checked once, as data.prepare_llava checks them), their paths
    made absolute; the others counted in ``skipped_rows``. Also the first skipped pair of each image reason."""
    pairs = [{**p, "images": [images / name for name in p["images"]]} for _, ps in files for p in ps]
    verdict = prepare_llava.image_verdicts(list(dict.fromkeys(q for p in pairs for q in p["images"])), workers)
    usable, examples = [], {}
    for pair in pairs:
        bad = next(((q, verdict[q]) for q in pair["images"] if verdict[q]), None)
        if bad is None:
            usable.append(pair)
            continue
        skipped_rows[bad[1]] += 1
        examples.setdefault(bad[1], f"{pair['id']}: {bad[0]}")
    if not usable:
        reasons = ", ".join(f"{n} {r}" for r, n in skipped_rows.most_common())
        raise ValueError(f"no pair could be used ({reasons})")
    return usable, examples


def _image_pair_sample(split: str, row: int, pair: dict) -> dict:
    """One stored sample: the text as the VLM's trainer reads it (not tokenized) and the image files' bytes."""
    record = {
        "id": pair["id"],
        "prompt": pair["prompt"],
        "chosen": pair["chosen"],
        "rejected": pair["rejected"],
        "num_images": len(pair["images"]),
    }
    return {
        "__key__": prepare_llava.sample_key(split, row),
        "json": json.dumps(record),
        **prepare_llava.image_members(pair["images"]),
    }


def build_image_pairs(
    out: Path, *, settings: dict, files: list[str], images: Path, workers: int, force: bool
) -> tuple[dict, bool]:
    """Write the pairs with images in ``out`` (data.prepare_llava's shards and split) unless a complete dataset is
    there. Returns (meta, built_now); ValueError (one line) when nothing is usable."""
    found: dict = {}

    def load() -> tuple[None, None, dict[str, np.ndarray]]:
        used, inputs = user_data.read_files(files, read_image_pairs_file)
        skipped_rows = collections.Counter(inputs["skipped_rows"])
        pairs, examples = decodable_pairs(used, skipped_rows, images, workers)
        split = {k: settings[k] for k in ("val_shards", "val_fraction", "seed")}
        rows = prepare_llava.split_filled(len(pairs), train_shards=None, **split)
        found.update(pairs=pairs, inputs={**inputs, "skipped_rows": dict(skipped_rows)}, examples=examples)
        return None, None, rows

    def start_meta(tmp: Path) -> dict:
        pairs = found["pairs"]
        return {
            "format": VLM_FORMAT,
            "images": str(images),
            "splits": {},
            "seed": settings["seed"],
            "val_fraction": settings["val_fraction"],
            "pairs": len(pairs),
            "image_files": sum(len(p["images"]) for p in pairs),
            "text_only": sum(not p["images"] for p in pairs),
            "multi_turn": sum(any(m["role"] == "assistant" for m in p["prompt"]) for p in pairs),
            "inputs": found["inputs"],
            "skipped_examples": found["examples"],
            "settings": settings,
        }

    def write(tmp: Path, split: str, rows: np.ndarray, _images, _labels, num_shards: int) -> list[dict]:
        return shards.write_split(
            tmp, split, rows, lambda row: _image_pair_sample(split, row, found["pairs"][row]), num_shards
        )

    return shards.build_atomically(
        Path(out).absolute(),
        train_shards=settings["train_shards"],
        val_shards=settings["val_shards"],
        val_fraction=settings["val_fraction"],
        force=force,
        dataset="VLM preference",
        read_meta=common_dataset.read_meta,
        load=load,
        start_meta=start_meta,
        write_shards=write,
        fewer_shards_ok=True,  # a split gets at most one shard per pair, as the LLM's pairs
    )


def describe_image_pairs(out: Path, meta: dict) -> str:
    lines = [
        f"{cli.summary(out, meta)}; {meta['pairs']:,} pairs with {meta['image_files']:,} images "
        f"({meta['text_only']:,} text-only, {meta['multi_turn']:,} multi-turn); {user_data.summarize(meta['inputs'])}"
    ]
    return "\n".join(lines + [f"  first {k}: {v}" for k, v in meta["skipped_examples"].items()])


def image_pairs_main(argv: list[str]) -> int:
    """``--input FILES --images DIR --out DIR``: the pairs with their images for the VLM, not tokenized."""

    def extra(parser: argparse.ArgumentParser, positive_int) -> None:
        parser.add_argument("--input", nargs="+", required=True, metavar="FILE_OR_GLOB", help="input files or globs")
        parser.add_argument("--images", required=True, type=Path, help="folder the rows' image paths are under")
        parser.add_argument("--tokenizer", type=Path, help=argparse.SUPPRESS)  # refused below, in one line
        parser.add_argument(
            "--workers", type=positive_int, default=min(8, os.cpu_count() or 1), help="processes checking images"
        )

    parser = cli.arg_parser(
        "python -m data.prepare_preference",
        __doc__.splitlines()[0],
        "output directory (created; must be empty or a previous build of the same kind)",
        extra=extra,
        seed_help="seed of the train/val split",
    )
    parser.set_defaults(val_fraction=user_data.DEFAULT_VAL_FRACTION)
    args = parser.parse_args(argv)
    if args.tokenizer is not None:
        return cli.error(
            ValueError(
                "--tokenizer with --images: pairs with images are stored as text, which training tokenizes with "
                "the model's processor; drop --tokenizer"
            ),
            KILN_ERROR,
        )
    images = args.images.expanduser().absolute()
    if not images.is_dir():
        return cli.error(ValueError(f"--images {images}: no such folder"), KILN_ERROR)
    files = user_data.resolve_inputs(args.input)
    settings = cli.split_wanted(
        args, format=VLM_FORMAT, images=str(images), inputs_digest=user_data.inputs_digest(files)
    )
    return cli.run(
        lambda out, force, **_: build_image_pairs(
            out, settings=settings, files=files, images=images, workers=args.workers, force=force
        ),
        args,
        wanted=settings,
        describe=describe_image_pairs,
        settings=lambda meta: {k: meta.get("settings", {}).get(k) for k in settings},
        holds="preference pairs",
        error_prefix=KILN_ERROR,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    layout = argparse.ArgumentParser(prog="python -m data.prepare_preference", add_help=False)
    layout.add_argument("--images")
    if layout.parse_known_args(argv)[0].images is not None:
        return image_pairs_main(argv)
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
