"""Tokenize text into the LLM's document shards (train / held-out val): CPython's pydoc help topics with a
byte-level BPE trained here (the llm_tiny demo), or your own files with your checkpoint's tokenizer.

    python -m data.prepare_text --out data/text [--vocab-size 2048] [--train-shards 8] [--val-shards 2]
                                [--val-fraction 0.1] [--seed 0] [--force]
    python -m data.prepare_text --tokenizer ~/models/Llama-3.2-1B --input '~/data/corpus/*.txt' --out data/my_text
                                [--text-field text] [--sample-by document] [--val-fraction 0.01] ...

Your own text (``--tokenizer`` and ``--input``): ``.txt`` files (one document per file, or per
blank-line paragraph or line: ``--sample-by``), ``.jsonl``/``.json`` rows with a ``text`` field
(``--text-field``) and ``.parquet`` files with that column, read with Hugging Face ``datasets``
(streaming: no cached copy). Each document is encoded as the tokenizer defines it -- with the bos
its post-processor adds (Llama 3: ``<|begin_of_text|>``, once) -- and ended with its eos (Llama 3:
``<|end_of_text|>``) unless the tokenizer already appends it. Samples are ``{__key__:
"train_00000012", ids.npy}``, the same shards the recipe reads for the pydoc corpus (documents
longer than ``data.max_seq_len`` are cut into pieces at training time). Bad files are skipped and
counted (``data.user_data``); the tokenizer is saved in ``DIR/tokenizer``.

The pydoc corpus (no ``--tokenizer``/``--input``):

``pydoc_data.topics.topics`` (about 80 help topics, ~465 KB of English reference
text that ships with Python; no download). Topics are split train / val (seeded), so no
topic is seen in both; each topic is then cut at paragraph boundaries into documents of at
most :data:`MAX_DOC_CHARS` characters (losslessly: a topic's documents concatenate back to it).
The tokenizer is a byte-level BPE trained on the train documents only, saved as a
``PreTrainedTokenizerFast`` in ``DIR/tokenizer`` (training loads it offline with
``AutoTokenizer``: ``recipes/llm/data.py``); like Llama's it adds ``<s>`` and not ``</s>``, so
``tokenizer(text)`` at serving time starts the way every training document does.

Each sample is ``{__key__: "train_000123", ids.npy: <s> + tokens + </s> as a uint16 array
(int32 above 65,536 tokens), txt: the document's text}``; the number in the key is the
document's index in :func:`load_documents`, so keys are unique across splits and every
sample traces back to its topic. ``DIR/meta.json`` (document and token counts per split,
vocab size, shards, seed) is written last and the directory appears at once (see
``data.shards``). The corpus depends on the Python version: meta.json records the version
and the corpus hash; a dataset is reused as built whatever Python reads it later.
"""

from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import json
import os
import platform
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from common.data import dataset as common_dataset
from data import cli, shards, user_data
from data.shards import META_NAME, SPLITS  # noqa: F401  (re-exported: part of this module's API)
from data.shards import npy_bytes as encode_ids  # a sample's ids.npy
from data.user_data import TOKENIZER_DIR, read_meta

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SOURCE = "pydoc_data.topics.topics"
MAX_DOC_CHARS = 2000
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
# Order fixes the ids: <pad>=0, <s>=1, </s>=2 (Llama's bos/eos ids), <unk>=3.
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# 256 byte tokens + the special tokens: a byte-level BPE cannot be smaller.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
DEFAULT_VAL_FRACTION = 0.1
MIN_VAL_TOPICS = 2

# Everything about how text becomes samples, apart from the CLI settings. Any change here
# changes the fingerprint, so an older build is refused instead of silently reused.
_PREP_RECIPE = {
    "max_doc_chars": MAX_DOC_CHARS,
    "chunking": "split after blank-line runs, then after newlines, then hard; greedy merge; lossless",
    "split": "topics, numpy default_rng(seed).permutation of sorted names, max(2, round(f * n)) to val",
    "special_tokens": list(SPECIAL_TOKENS),
    "bpe": "tokenizers BPE, ByteLevel(add_prefix_space=False) pre-tokenizer + decoder, "
    "no normalizer, full byte alphabet",
    "sample_ids": "<s> + tokens + </s>",
}


class Document(NamedTuple):
    topic: str
    part: int  # index of this piece within its topic
    text: str


# --- corpus ------------------------------------------------------------------------------------------


def load_topics() -> dict[str, str]:
    """``pydoc_data.topics.topics`` in sorted topic order."""
    from pydoc_data.topics import topics

    return {name: topics[name] for name in sorted(topics)}


def corpus_sha256(topics: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(topics, sort_keys=True).encode()).hexdigest()


# Zero-width split points: after a run of blank lines (a paragraph boundary), after a newline.
_PARAGRAPH_END = re.compile(r"(?<=\n\n)(?!\n)")
_LINE_END = re.compile(r"(?<=\n)(?!\n)")


def chunk_text(text: str, max_chars: int = MAX_DOC_CHARS) -> list[str]:
    """Cut ``text`` into pieces of at most ``max_chars`` characters, preferably at paragraph boundaries.

    Lossless: ``"".join(chunk_text(t)) == t``. Paragraphs (with the blank lines after them) are
    merged greedily; a paragraph longer than ``max_chars`` is cut after lines, and a longer line
    hard at ``max_chars``. Deterministic.
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    units: list[str] = []
    for paragraph in _PARAGRAPH_END.split(text):
        if len(paragraph) <= max_chars:
            units.append(paragraph)
            continue
        for line in _LINE_END.split(paragraph):
            units.extend(line[i : i + max_chars] for i in range(0, len(line), max_chars))
    chunks: list[str] = []
    for unit in units:
        if chunks and len(chunks[-1]) + len(unit) <= max_chars:
            chunks[-1] += unit
        elif unit:
            chunks.append(unit)
    return chunks


def load_documents(topics: dict[str, str] | None = None, *, max_chars: int = MAX_DOC_CHARS) -> list[Document]:
    """Every topic cut by :func:`chunk_text`, in topic order then part order (the keys' numbering)."""
    topics = load_topics() if topics is None else topics
    return [
        Document(name, part, text) for name in topics for part, text in enumerate(chunk_text(topics[name], max_chars))
    ]


def split_topics(names: list[str], *, val_fraction: float, seed: int) -> dict[str, list[str]]:
    """Seeded train/val split of topic names (sorted within each split): ``max(2, round(f * n))`` go to val."""
    names = sorted(names)
    num_val = max(MIN_VAL_TOPICS, round(val_fraction * len(names)))
    if num_val >= len(names):
        raise ValueError(f"{len(names)} topics cannot give {num_val} val topics and leave any for train")
    order = np.random.default_rng(seed).permutation(len(names))
    val = {names[i] for i in order[:num_val]}
    return {"train": [n for n in names if n not in val], "val": [n for n in names if n in val]}


# --- tokenizer -----------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on ``texts`` (deterministic), as a PreTrainedTokenizerFast that adds ``<s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} special tokens), "
            f"got {vocab_size}"
        )
    # Byte-level with no normalizer: every string encodes and decodes back unchanged, so
    # <unk> never occurs; it is set because the tokenizer API (and some servers) expect one.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # add_bos_token given explicitly: transformers then installs (and saves) the "<s> $A"
    # post-processor, Llama's convention. clean_up_tokenization_spaces=False: the legacy
    # clean-up rewrites " ." etc. on decode and would break decode(encode(x)) == x.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
    )


def encode_documents(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> list[np.ndarray]:
    """Each text as the tokenizer encodes it with its special tokens, ending in its eos, as uint16 arrays
    (int32 if the vocab does not fit in 16 bits): ``<s> + tokens + </s>`` here, ``<|begin_of_text|> + tokens +
    <|end_of_text|>`` with Llama 3's."""
    dtype = user_data.ids_dtype(tokenizer)
    eos = tokenizer.eos_token_id
    # The tokenizer adds its bos itself (its post-processor), so samples start exactly like served
    # prompts; eos is appended unless the tokenizer already ends every text with it (add_eos_token).
    ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    return [np.asarray(row if row and row[-1] == eos else [*row, eos], dtype=dtype) for row in ids]


# --- shards, meta, atomic build ----------------------------------------------------------------------------


def _prep_fingerprint() -> str:
    """Changes whenever how documents are cut or tokenized changes: old builds are then stale."""
    return hashlib.sha256(json.dumps(_PREP_RECIPE, sort_keys=True).encode()).hexdigest()[:16]


def _write_shards(
    out: Path, split: str, rows: np.ndarray, texts: list[str], ids: list[np.ndarray], num_shards: int
) -> list[dict]:
    """One split's shards (``data.shards.ShardWriter``; the "images" and "labels" are texts and id arrays)."""
    return shards.write_split(
        out,
        split,
        rows,
        lambda row: {"__key__": f"{split}_{row:06d}", "ids.npy": encode_ids(ids[row]), "txt": texts[row]},
        num_shards,
    )


def _settings(meta: dict) -> dict:
    return {
        "vocab_size": meta.get("requested_vocab_size"),
        **shards.split_settings(meta),
        "prep_fingerprint": meta.get("prep_fingerprint"),
    }


def _start_meta(tmp: Path, built: dict[str, Any], *, seed: int, val_fraction: float, vocab_size: int) -> dict[str, Any]:
    """The tokenizer saved in ``tmp`` and meta.json before the shards are written, from what load() made (``built``)."""
    tokenizer, rows, ids = built["tokenizer"], built["rows"], built["ids"]
    tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
    os.chmod(tmp / TOKENIZER_DIR, 0o755)  # readable by others, like the dataset dir
    return {
        "source": SOURCE,
        "python_version": platform.python_version(),
        "corpus_sha256": corpus_sha256(built["topics"]),
        "max_doc_chars": MAX_DOC_CHARS,
        "splits": {},
        "seed": seed,
        "val_fraction": val_fraction,
        "documents": {s: len(rows[s]) for s in SPLITS},
        "tokens": {s: int(sum(len(ids[i]) for i in rows[s])) for s in SPLITS},
        "topics": built["split"],
        "ids_dtype": np.dtype(ids[0].dtype).name,
        "vocab_size": len(tokenizer),
        "requested_vocab_size": vocab_size,
        "special_tokens": {"pad": PAD, "bos": BOS, "eos": EOS, "unk": UNK},
        "special_token_ids": {
            "pad": tokenizer.pad_token_id,
            "bos": tokenizer.bos_token_id,
            "eos": tokenizer.eos_token_id,
            "unk": tokenizer.unk_token_id,
        },
        "tokenizer": TOKENIZER_DIR,
        "tokenizer_files": shards.file_sizes(tmp / TOKENIZER_DIR),
        "prep_fingerprint": _prep_fingerprint(),
    }


def build_text_shards(
    out: str | Path,
    *,
    vocab_size: int = 2048,
    train_shards: int = 8,
    val_shards: int = 2,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    seed: int = 0,
    force: bool = False,
) -> tuple[dict, bool]:
    """Build the dataset in ``out`` unless a complete one is there. Returns (meta, built_now).

    A complete dataset with other settings is left alone (``built_now`` False); callers compare.
    """
    out = Path(out).absolute()
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} special tokens), "
            f"got {vocab_size}"
        )
    built: dict[str, Any] = {}  # what load() makes and start_meta() records

    def load() -> tuple[list[str], list[np.ndarray], dict[str, np.ndarray]]:
        topics = load_topics()
        docs = load_documents(topics)
        split = split_topics(list(topics), val_fraction=val_fraction, seed=seed)
        in_val = set(split["val"])
        rng = np.random.default_rng(seed)
        # Written in a seeded order, so each shard holds a mix of topics (and similar token counts).
        rows = {
            s: rng.permutation(
                np.asarray([i for i, d in enumerate(docs) if (d.topic in in_val) == (s == "val")], dtype=np.int64)
            )
            for s in SPLITS
        }
        texts = [d.text for d in docs]
        # Train documents only: val text must stay unseen, by the tokenizer too.
        tokenizer = train_tokenizer([texts[i] for i in sorted(rows["train"])], vocab_size)
        ids = encode_documents(tokenizer, texts)
        built.update(topics=topics, split=split, rows=rows, tokenizer=tokenizer, ids=ids)
        return texts, ids, rows

    def start_meta(tmp: Path) -> dict[str, Any]:
        return _start_meta(tmp, built, seed=seed, val_fraction=val_fraction, vocab_size=vocab_size)

    return shards.build_atomically(
        out,
        train_shards=train_shards,
        val_shards=val_shards,
        val_fraction=val_fraction,
        force=force,
        dataset="text",
        read_meta=read_meta,
        load=load,
        start_meta=start_meta,
        write_shards=_write_shards,
    )


def ensure_text_shards(
    root: str | Path,
    *,
    vocab_size: int = 2048,
    train_shards: int = 8,
    val_shards: int = 2,
    seed: int = 0,
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> dict:
    """Parsed meta.json of the text dataset under ``root``, building it first if missing.

    Adds absolute ``train_urls`` / ``val_urls`` and ``tokenizer_dir``. For scripts and
    tests (training runs the CLI instead: ``data.build``). A complete
    dataset built with other settings (or by an older version of this file) raises ValueError
    rather than being reused.
    """
    root = Path(root).absolute()
    meta, _ = build_text_shards(
        root,
        vocab_size=vocab_size,
        train_shards=train_shards,
        val_shards=val_shards,
        val_fraction=val_fraction,
        seed=seed,
    )
    wanted = {
        "vocab_size": vocab_size,
        "train_shards": train_shards,
        "val_shards": val_shards,
        "val_fraction": val_fraction,
        "seed": seed,
        "prep_fingerprint": _prep_fingerprint(),
    }
    shards.require_settings(
        root,
        _settings(meta),
        wanted,
        holds="text data",
        rebuild=f"`python -m data.prepare_text --out {root} --force` (plus your settings)",
    )
    return common_dataset.with_urls(root, meta, asset="tokenizer")


# --- your own text ---------------------------------------------------------------------------------------

# .txt through datasets' "text" builder, .jsonl/.json through "json", .parquet through "parquet".
TEXT_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
USER_PREP = {
    "documents": "tokenizer(text, add_special_tokens=True) + eos unless already last",
    "empty": "texts that are empty or whitespace are not documents",
}


def read_text_file(
    path: str, *, field: str = "text", sample_by: str = "document"
) -> tuple[list[str], collections.Counter]:
    """The documents of one file and its skipped rows by reason; ``user_data.Skip`` if it cannot be read."""
    import datasets

    suffix = Path(path).suffix.lower()
    builder = TEXT_BUILDERS.get(suffix)
    if builder is None:
        raise user_data.Skip(f"unsupported suffix ({suffix or 'none'}; expected one of {', '.join(TEXT_BUILDERS)})")
    key = "text" if builder == "text" else field
    texts, rows = [], collections.Counter()
    try:
        kwargs = {"sample_by": sample_by} if builder == "text" else {}
        for row in datasets.load_dataset(builder, data_files=path, split="train", streaming=True, **kwargs):
            value = row.get(key)
            if not isinstance(value, str):
                rows[f"no {key!r} text field"] += 1
            elif value.strip():
                texts.append(value)
    except Exception as exc:  # the readers raise many types: ArrowInvalid, UnicodeDecodeError, OSError, ...
        raise user_data.Skip(f"unreadable ({user_data.reason_of(exc)})") from None
    if not texts and rows:
        raise user_data.Skip(f"no {key!r} field (in none of its {sum(rows.values())} rows)")
    return texts, rows


def encode_user_text(
    tokenizer: PreTrainedTokenizerFast,
    files: list[tuple[str, list[str]]],
    skipped_rows: collections.Counter,
    batch: int = 256,
) -> tuple[list[dict], dict]:
    """Every document of every file, in order, as ``{"ids": ...}`` (:func:`encode_documents`)."""
    texts = [t for _, file_texts in files for t in file_texts]
    ids = [a for i in range(0, len(texts), batch) for a in encode_documents(tokenizer, texts[i : i + batch])]
    return [{"ids": a} for a in ids], {}


# --- CLI ---------------------------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    def extra(parser: argparse.ArgumentParser, positive_int) -> None:
        parser.add_argument(
            "--vocab-size",
            type=positive_int,
            default=None,
            help=f"pydoc corpus: BPE vocabulary size, special tokens included (>= {MIN_VOCAB_SIZE}; default 2048)",
        )
        user_data.add_arguments(parser, required=False)
        parser.add_argument(
            "--text-field", default="text", help="your text: the field (.jsonl/.json) or column (.parquet) holding it"
        )
        parser.add_argument(
            "--sample-by",
            choices=("document", "paragraph", "line"),
            default="document",
            help="your text: a .txt file is one document, or one per blank-line paragraph, or per line",
        )

    parser = cli.arg_parser(
        "python -m data.prepare_text",
        __doc__.splitlines()[0],
        "output directory (created; must be empty or a previous text build)",
        extra=extra,
        seed_help="seed of the train/val split (pydoc: of the topic split) and of the shard order",
    )
    # Held out by topic for pydoc (not stratified), by document for your text; the shared default (0.15) suits
    # the digits.
    parser.set_defaults(val_fraction=None)
    args = parser.parse_args(argv)
    own = args.tokenizer is not None or args.input is not None
    if own and (args.tokenizer is None or args.input is None):
        parser.error("--tokenizer and --input go together (your own text); without both the pydoc corpus is built")
    if own and args.vocab_size is not None:
        parser.error("--vocab-size is for the pydoc corpus; your text keeps --tokenizer's vocabulary")
    if args.vocab_size is not None and args.vocab_size < MIN_VOCAB_SIZE:
        parser.error(
            f"--vocab-size must be >= {MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} special tokens), "
            f"got {args.vocab_size}"
        )
    if args.val_fraction is None:
        args.val_fraction = user_data.DEFAULT_VAL_FRACTION if own else DEFAULT_VAL_FRACTION
    if args.vocab_size is None:
        args.vocab_size = 2048
    return args


def _main_own_text(args: argparse.Namespace) -> int:
    user_data.quiet_datasets()
    options = {
        "text_field": args.text_field,
        "sample_by": args.sample_by,
        "prep_fingerprint": hashlib.sha256(json.dumps(USER_PREP, sort_keys=True).encode()).hexdigest()[:16],
    }
    return user_data.run_cli(
        args,
        fmt="text",
        options=lambda _tokenizer: options,
        read=functools.partial(read_text_file, field=args.text_field, sample_by=args.sample_by),
        encode=encode_user_text,
        describe=lambda meta: f"tokens train {meta['tokens']['train']:,} / val {meta['tokens']['val']:,}",
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.tokenizer is not None:
        return _main_own_text(args)

    def describe(out: Path, meta: dict) -> str:
        note = (
            ""
            if meta["vocab_size"] == args.vocab_size
            else f" (asked for {args.vocab_size}: the corpus has no more merges)"
        )
        return (
            f"{cli.summary(out, meta)}; "
            f"tokens train {meta['tokens']['train']:,} / val {meta['tokens']['val']:,} "
            f"from {len(meta['topics']['train'])} / {len(meta['topics']['val'])} topics; "
            f"tokenizer in {out / TOKENIZER_DIR}: vocab {meta['vocab_size']}{note}"
        )

    return cli.run(
        build_text_shards,
        args,
        wanted=cli.split_wanted(args, vocab_size=args.vocab_size),
        describe=describe,
        settings=_settings,
        holds="text data",
        also_wanted={"prep_fingerprint": _prep_fingerprint()},
    )


if __name__ == "__main__":
    sys.exit(main())
