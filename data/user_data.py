"""Your own files -> the LLM's token shards: what ``prepare_text --tokenizer`` and ``prepare_chat`` share.

Inputs are paths or globs (``~`` expanded, ``**`` recursive). A file that cannot be used -- missing,
unreadable, not UTF-8, a parse error, no usable row, no such field, an unknown suffix -- is skipped
with its reason and counted, and so is a row that cannot be used; if nothing is usable the build
stops with one line (exit 2) and writes nothing. meta.json's ``inputs`` lists what was used and
skipped.

The tokenizer comes from a local folder (a released checkpoint's, e.g. ``~/models/Llama-3.2-1B``;
``AutoTokenizer``, offline) and is saved beside the shards in ``tokenizer/``, so training reads the
data with the tokenizer that made it. meta.json identifies it by ``tokenizer_sha256``
(:func:`common.data.dataset.tokenizer_sha256`: vocabulary, merges, special tokens and how text
becomes ids), which a checkpoint's tokenizer can be compared with.

Samples are split train/val by a seeded permutation (``max(1, round(f * n))`` to val) and written as
``{split}-NNNNNN.tar`` shards of ``ids.npy`` (and, for chat, ``mask.npy``) by ``data.shards``' atomic
build; a split gets at most one shard per sample. A complete dataset built with the same settings
(``meta["settings"]``: format, tokenizer, input files with their sizes and times, split, ...) is left
alone; one built with other settings is refused until ``--force``.
"""

from __future__ import annotations

import argparse
import collections
import glob
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.data import dataset as common_dataset
from data import cli, shards

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TOKENIZER_DIR = "tokenizer"  # meta.json "tokenizer": the side folder training loads (recipes/llm/data.py)
DEFAULT_VAL_FRACTION = 0.01

# read(path) -> (items, {reason: rows skipped}); raises Skip to skip the whole file.
Reader = Callable[[str], tuple[list, collections.Counter]]
# encode(tokenizer, [(path, items), ...], skipped_rows) -> ([{"ids": array, ...}, ...], meta entries)
Encoder = Callable[[Any, list[tuple[str, list]], collections.Counter], tuple[list[dict[str, np.ndarray]], dict]]


class Skip(Exception):
    """A file or row that cannot be used. The message is its reason; the part before `` (`` is what is counted."""


def reason_of(exc: Exception) -> str:
    """First line of an exception from a third-party reader, for a skip reason."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def resolve_inputs(patterns: Iterable[str]) -> list[str]:
    """Absolute paths of the files the patterns name, in order, each once. A pattern that matches no file
    is kept as given, so it is skipped and counted like any missing file."""
    files: list[str] = []
    for pattern in patterns:
        pattern = os.path.expanduser(pattern)
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        files += [str(Path(m).absolute()) for m in matches if not Path(m).is_dir()] or [pattern]
    return list(dict.fromkeys(files))


MAX_REASONS = 3  # the row reasons an unusable file's one line names


def read_files(files: list[str], read: Reader) -> tuple[list[tuple[str, list]], dict]:
    """``[(file, items)]`` for every file ``read`` accepts, and meta.json's ``inputs`` record of what was
    used and skipped. ValueError (one line) when no file is usable."""
    used, skipped, rows = [], [], collections.Counter()
    for path in files:
        try:
            if not Path(path).is_file():
                raise Skip("missing (no such file)")
            items, bad_rows = read(path)
            rows.update(bad_rows)
            if not items:  # say why: its rows' reasons, the most frequent first
                why = ", ".join(f"{n} {r}" for r, n in bad_rows.most_common(MAX_REASONS))
                more = ", ..." if len(bad_rows) > MAX_REASONS else ""
                raise Skip(f"empty (no usable row{': ' + why + more if why else ''})")
        except Skip as exc:
            skipped.append({"path": path, "reason": str(exc)})
            continue
        used.append((path, items))
    if not used:
        detail = "; ".join(f"{s['path']}: {s['reason']}" for s in skipped[:3]) + ("; ..." if len(skipped) > 3 else "")
        raise ValueError(f"none of the {len(files)} input files could be used ({detail})")
    return used, {"used": [p for p, _ in used], "skipped": skipped, "skipped_rows": dict(rows)}


def summarize(inputs: dict) -> str:
    """``read 3 of 5 input files (skipped: 1 empty, 1 unreadable); skipped rows: 2 bad JSON``."""
    reasons = collections.Counter(s["reason"].split(" (", 1)[0] for s in inputs["skipped"])
    text = f"read {len(inputs['used'])} of {len(inputs['used']) + len(inputs['skipped'])} input files"
    if reasons:
        text += " (skipped: " + ", ".join(f"{n} {r}" for r, n in reasons.most_common()) + ")"
    rows = collections.Counter(inputs["skipped_rows"])
    if rows:
        text += "; skipped rows: " + ", ".join(f"{n} {r}" for r, n in rows.most_common())
    return text


def quiet_datasets() -> None:
    """Hugging Face datasets logs a reader's failure before raising it; the skip summary reports it instead."""
    import datasets

    datasets.utils.logging.set_verbosity(logging.CRITICAL)
    datasets.disable_progress_bars()


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer in a local folder (a checkpoint's), offline; ValueError in one line if there is none."""
    from transformers import AutoTokenizer

    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ValueError(f"--tokenizer {folder}: no such folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"--tokenizer {folder}: no tokenizer could be loaded from it ({reason_of(exc)})") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"--tokenizer {folder}: {type(tokenizer).__name__} is not a fast (tokenizers) tokenizer")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"--tokenizer {folder}: the tokenizer defines no eos token, so a document cannot be ended")
    return tokenizer


def ids_dtype(tokenizer: PreTrainedTokenizerFast) -> np.dtype:
    """uint16 while every id fits (half the bytes), else int32 (Llama 3's 128,256 tokens)."""
    return np.dtype(np.uint16 if len(tokenizer) <= 1 << 16 else np.int32)


def inputs_digest(files: list[str]) -> str:
    """Changes when the set of input files, or a file's size or modification time, changes."""
    stats = []
    for f in files:
        st = os.stat(f) if os.path.isfile(f) else None
        stats.append([f, st.st_size, st.st_mtime_ns] if st else [f])
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16]


def split_rows(n: int, *, val_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """A seeded permutation of ``range(n)``: ``max(1, round(f * n))`` rows to val, the rest to train."""
    if n < 2:
        raise ValueError(f"{n} usable sample(s): at least 2 are needed, one for train and one for val")
    num_val = min(n - 1, max(1, round(val_fraction * n)))
    order = np.random.default_rng(seed).permutation(n)
    return {"train": order[num_val:], "val": order[:num_val]}


def read_meta(root: str | Path) -> dict[str, Any] | None:
    """Parsed meta.json of a complete LLM token dataset in ``root`` (shards and tokenizer), else None."""
    return common_dataset.read_meta(root, also_complete=common_dataset.asset_complete(TOKENIZER_DIR))


def build(
    out: Path,
    *,
    settings: dict,
    samples: Callable[[], tuple[list[dict[str, np.ndarray]], dict]],
    tokenizer: PreTrainedTokenizerFast,
    force: bool,
) -> tuple[dict, bool]:
    """Write the dataset in ``out`` unless a complete one is there. Returns (meta, built_now).

    ``samples()`` reads and encodes the inputs (only when building): a list of ``{"ids": ..., ["mask": ...]}``
    arrays (and, for prompts, a ``"json"`` string) and the meta entries that describe them. ``settings`` go to
    ``meta["settings"]``.
    """
    built: dict[str, Any] = {}

    def load() -> tuple[None, None, dict[str, np.ndarray]]:
        encoded, described = samples()
        rows = split_rows(len(encoded), val_fraction=settings["val_fraction"], seed=settings["seed"])
        built.update(encoded=encoded, described=described, rows=rows)
        return None, None, rows

    def start_meta(tmp: Path) -> dict[str, Any]:
        encoded, rows = built["encoded"], built["rows"]
        tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
        os.chmod(tmp / TOKENIZER_DIR, 0o755)  # readable by others, like the dataset dir
        return {
            "format": settings["format"],
            "splits": {},
            "seed": settings["seed"],
            "val_fraction": settings["val_fraction"],
            "tokens": {s: int(sum(encoded[i]["ids"].size for i in rows[s])) for s in shards.SPLITS},
            "longest_sample": max(int(e["ids"].size) for e in encoded),
            **built["described"],
            "ids_dtype": ids_dtype(tokenizer).name,
            "vocab_size": len(tokenizer),
            "special_token_ids": {
                "bos": tokenizer.bos_token_id,
                "eos": tokenizer.eos_token_id,
                "pad": tokenizer.pad_token_id,
            },
            "tokenizer": TOKENIZER_DIR,
            "tokenizer_files": shards.file_sizes(tmp / TOKENIZER_DIR),
            "tokenizer_sha256": common_dataset.tokenizer_sha256(tokenizer),
            "settings": settings,
        }

    def write(tmp: Path, split: str, rows: np.ndarray, _images, _labels, num_shards: int) -> list[dict]:
        encoded = built["encoded"]

        def sample(row: int) -> dict:  # arrays as KEY.npy; any other member (a prompt's "json") as it is
            return {
                "__key__": f"{split}_{row:08d}",
                **{
                    (f"{k}.npy" if isinstance(v, np.ndarray) else k): (
                        shards.npy_bytes(v) if isinstance(v, np.ndarray) else v
                    )
                    for k, v in encoded[row].items()
                },
            }

        return shards.write_split(tmp, split, rows, sample, num_shards)

    return shards.build_atomically(
        Path(out).absolute(),
        train_shards=settings["train_shards"],
        val_shards=settings["val_shards"],
        val_fraction=settings["val_fraction"],
        force=force,
        dataset=f"{settings['format']} data",
        read_meta=read_meta,
        load=load,
        start_meta=start_meta,
        write_shards=write,
        fewer_shards_ok=True,
    )


# --- CLI ---------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """``--tokenizer`` and ``--input``, the two arguments every user-data build takes."""
    parser.add_argument(
        "--tokenizer",
        type=Path,
        required=required,
        metavar="FOLDER",
        help="folder holding the tokenizer to use, e.g. the checkpoint you fine-tune (~/models/Llama-3.2-1B)",
    )
    parser.add_argument(
        "--input",
        nargs="+",
        required=required,
        metavar="FILE_OR_GLOB",
        help="input files or globs (quote a glob to let it match more files than the shell allows)",
    )


def run_cli(
    args: argparse.Namespace,
    *,
    fmt: str,
    options: Callable[[Any], dict],
    read: Reader,
    encode: Encoder,
    describe: Callable[[dict], str],
) -> int:
    """Build ``args.out`` from ``args.input`` with ``args.tokenizer``; print one summary line. Exit codes as
    ``cli.run``: 0 built or already there, 1 there with other settings, 2 a one-line error.

    ``options(tokenizer)`` gives the format's own settings (recorded, and compared on rebuild, with its
    prep fingerprint) or raises ValueError; ``describe(meta)`` adds the format's numbers to the summary.
    """
    out = args.out.absolute()
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        own = options(tokenizer)
    except ValueError as exc:
        return cli.error(exc)
    files = resolve_inputs(args.input)
    settings = cli.split_wanted(
        args,
        format=fmt,
        tokenizer_sha256=common_dataset.tokenizer_sha256(tokenizer),
        inputs_digest=inputs_digest(files),
        **own,
    )

    def samples() -> tuple[list[dict[str, np.ndarray]], dict]:
        used, inputs = read_files(files, read)
        skipped_rows = collections.Counter(inputs["skipped_rows"])
        encoded, described = encode(tokenizer, used, skipped_rows)  # adds the rows it cannot encode
        return encoded, {"inputs": {**inputs, "skipped_rows": dict(skipped_rows)}, **described}

    def have(meta: dict) -> dict:  # a dataset of another kind (e.g. the pydoc build) has no settings
        return {k: meta.get("settings", {}).get(k) for k in settings}

    return cli.run(
        lambda *_, **__: build(out, settings=settings, samples=samples, tokenizer=tokenizer, force=args.force),
        args,
        wanted=settings,
        describe=lambda out, meta: (
            f"{cli.summary(out, meta)}; {describe(meta)}; {summarize(meta['inputs'])}; "
            f"tokenizer in {out / TOKENIZER_DIR}: vocab {meta['vocab_size']}"
        ),
        settings=have,
        holds=f"{fmt} data",
    )


def templated_cli(
    argv: list[str] | None,
    *,
    module: str,
    doc: str,
    fmt: str,
    default_max_seq_len: int,
    max_seq_len_help: str,
    prep: dict,
    read: Reader,
    encode: Callable[..., tuple],
    describe: Callable[[dict], str],
    need_template: bool,
) -> int:
    """The command line of a build rendered with the tokenizer's chat template (prepare_chat, prepare_preference):
    --tokenizer, --input, --max-seq-len and the shared split flags; the template's and the preparation's
    fingerprints recorded with the settings. ``encode(tokenizer, files, skipped_rows, max_seq_len=...)``."""

    def extra(parser, positive_int) -> None:
        add_arguments(parser, required=True)
        parser.add_argument("--max-seq-len", type=positive_int, default=default_max_seq_len, help=max_seq_len_help)

    parser = cli.arg_parser(
        f"python -m {module}",
        doc.splitlines()[0],
        f"output directory (created; must be empty or a previous {fmt} build)",
        extra=extra,
        seed_help="seed of the train/val split and of the shard order",
    )
    parser.set_defaults(val_fraction=DEFAULT_VAL_FRACTION)
    args = parser.parse_args(argv)

    def options(tokenizer) -> dict:
        if need_template and not tokenizer.chat_template:
            raise ValueError(
                f"--tokenizer {args.tokenizer}: the tokenizer has no chat template to render conversations with"
            )
        return {
            "max_seq_len": args.max_seq_len,
            "chat_template_sha256": hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest(),
            "prep_fingerprint": hashlib.sha256(json.dumps(prep, sort_keys=True).encode()).hexdigest()[:16],
        }

    return run_cli(
        args,
        fmt=fmt,
        options=options,
        read=read,
        encode=lambda tok, files, rows: encode(tok, files, rows, max_seq_len=args.max_seq_len),
        describe=describe,
    )
