"""Unit tests for data.prepare_text and what training reads of it (recipes/llm/data.py): corpus cutting and split,
shards vs meta, offline tokenizer, no-op rebuild, decoding and chunking through the loader."""

from __future__ import annotations

import collections
import io
import json
import pickle
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds

from common.data.webdataset import build_webdataset_loader
from data import prepare_text as pt
from recipes.llm.data import decode_document, load_tokenizer

SEED = 3
VOCAB = 2048
BUILD_ARGS = ["--vocab-size", str(VOCAB), "--train-shards", "4", "--val-shards", "2", "--seed", str(SEED)]
ENSURE_KW = dict(vocab_size=VOCAB, train_shards=4, val_shards=2, seed=SEED)


@pytest.fixture(scope="module")
def topics():
    return pt.load_topics()


@pytest.fixture(scope="module")
def documents(topics):
    return pt.load_documents(topics)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("text") / "text"
    assert pt.main(["--out", str(out), *BUILD_ARGS]) == 0
    return out


@pytest.fixture(scope="module")
def meta(built):
    return pt.ensure_text_shards(built, **ENSURE_KW)


@pytest.fixture(scope="module")
def tokenizer(meta):
    return load_tokenizer(meta["tokenizer_dir"])


@pytest.fixture(scope="module")
def samples(meta):
    """{split: raw samples in shard order}, read with a plain webdataset.WebDataset."""
    return {s: list(wds.WebDataset(meta[f"{s}_urls"], shardshuffle=False, empty_check=False)) for s in pt.SPLITS}


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test (the tokenizer must load offline)."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _doc_index(sample: dict) -> int:
    return int(sample["__key__"].split("_")[1])


def _ids(sample: dict) -> np.ndarray:
    return decode_document(sample)["input_ids"].numpy()


# --- corpus ------------------------------------------------------------------------------------------


def test_corpus_is_pydoc_topics(topics):
    from pydoc_data.topics import topics as source

    assert list(topics) == sorted(source) and len(topics) >= 50
    assert sum(map(len, topics.values())) > 300_000  # ~465 KB on CPython 3.11


def test_chunk_text_is_lossless_bounded_and_cuts_at_paragraphs(topics, documents):
    for name, text in topics.items():
        parts = [d for d in documents if d.topic == name]
        assert [d.part for d in parts] == list(range(len(parts)))
        assert "".join(d.text for d in parts) == text
        assert all(0 < len(d.text) <= pt.MAX_DOC_CHARS for d in parts)
    # Every cut lands on a paragraph boundary unless a paragraph alone exceeds the limit.
    paragraph_cuts = sum(
        d.text.endswith("\n\n") for d in documents if d.part < max(p.part for p in documents if p.topic == d.topic)
    )
    cuts = len(documents) - len(topics)
    assert cuts > 150 and paragraph_cuts >= 0.8 * cuts


def test_chunk_text_edge_cases():
    assert pt.chunk_text("") == []
    assert pt.chunk_text("one paragraph", 100) == ["one paragraph"]
    assert pt.chunk_text("aa\n\nbb\n\ncc", 6) == ["aa\n\n", "bb\n\ncc"]  # greedy, cut after the blank line
    assert pt.chunk_text("aaaa\n\n\nbbbb", 8) == ["aaaa\n\n\n", "bbbb"]  # a blank-line run stays with its paragraph
    long_line = "x" * 25
    assert pt.chunk_text(long_line, 10) == ["x" * 10, "x" * 10, "x" * 5]
    lines = "".join(f"line {i}\n" for i in range(40))  # one paragraph, longer than the limit: cut after lines
    pieces = pt.chunk_text(lines, 50)
    assert "".join(pieces) == lines and all(len(p) <= 50 and p.endswith("\n") for p in pieces)
    with pytest.raises(ValueError, match="max_chars"):
        pt.chunk_text("x", 0)


def test_split_topics_is_seeded_disjoint_and_covering(topics):
    names = list(topics)
    split = pt.split_topics(names, val_fraction=0.1, seed=SEED)
    assert split == pt.split_topics(list(reversed(names)), val_fraction=0.1, seed=SEED)
    assert split != pt.split_topics(names, val_fraction=0.1, seed=SEED + 1)
    assert not set(split["train"]) & set(split["val"])
    assert sorted(split["train"] + split["val"]) == sorted(names)
    assert len(split["val"]) == max(2, round(0.1 * len(names)))
    assert len(pt.split_topics(names[:5], val_fraction=0.1, seed=0)["val"]) == 2  # at least two
    with pytest.raises(ValueError, match="topics"):
        pt.split_topics(names[:2], val_fraction=0.1, seed=0)


# --- files, meta, shards ---------------------------------------------------------------------------


def test_files_and_meta(built, meta, documents, tokenizer):
    assert meta["source"] == "pydoc_data.topics.topics" and meta["seed"] == SEED and meta["val_fraction"] == 0.1
    assert meta["corpus_sha256"] == pt.corpus_sha256(pt.load_topics())
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    assert train["shards"] == [f"train-{i:06d}.tar" for i in range(4)]
    assert val["shards"] == [f"val-{i:06d}.tar" for i in range(2)]
    assert meta["train_urls"] == [str((built / n).resolve()) for n in train["shards"]]
    assert meta["tokenizer_dir"] == str((built / "tokenizer").resolve())
    assert meta["documents"] == {"train": train["samples"], "val": val["samples"]}
    assert train["samples"] + val["samples"] == len(documents)
    assert val["samples"] >= 2
    for info in (train, val):
        assert max(info["shard_samples"]) - min(info["shard_samples"]) <= 1
    assert meta["vocab_size"] == meta["requested_vocab_size"] == VOCAB == len(tokenizer)
    assert meta["ids_dtype"] == "uint16"
    assert meta["special_token_ids"] == {"pad": 0, "bos": 1, "eos": 2, "unk": 3}
    assert pt.read_meta(built) == json.loads((built / "meta.json").read_text())


def test_shards_cover_the_corpus_with_disjoint_topics(meta, samples, documents):
    by_split = {s: [_doc_index(x) for x in samples[s]] for s in pt.SPLITS}
    assert all(x["__key__"] == f"{s}_{i:06d}" for s in pt.SPLITS for x, i in zip(samples[s], by_split[s]))
    # Every document exactly once, in exactly one split, with its text.
    assert sorted(by_split["train"] + by_split["val"]) == list(range(len(documents)))
    for s in pt.SPLITS:
        assert all(x["txt"].decode("utf-8") == documents[_doc_index(x)].text for x in samples[s])
    # Held out by topic: no topic has documents in both splits; meta names each split's topics.
    topics = {s: {documents[i].topic for i in by_split[s]} for s in pt.SPLITS}
    assert not topics["train"] & topics["val"]
    assert {s: sorted(t) for s, t in topics.items()} == meta["topics"]
    assert len(meta["topics"]["val"]) >= 2


def test_token_counts_and_ids(meta, samples, tokenizer):
    for split in pt.SPLITS:
        ids = [_ids(x) for x in samples[split]]
        assert sum(map(len, ids)) == meta["tokens"][split]
        counts = meta["splits"][split]["shard_samples"]
        assert len(ids) == sum(counts)
        for x, row in zip(samples[split], ids):
            assert row[0] == tokenizer.bos_token_id and row[-1] == tokenizer.eos_token_id
            assert not np.isin(row[1:-1], [0, 1, 2, 3]).any()  # specials only at the ends
            assert row.max() < len(tokenizer)
    # ids are exactly what the saved tokenizer gives for the text (+ </s>), stored as uint16.
    raw = np.load(io.BytesIO(samples["val"][0]["ids.npy"]))
    assert raw.dtype == np.uint16
    text = samples["val"][0]["txt"].decode()
    assert raw.tolist() == [*tokenizer(text)["input_ids"], tokenizer.eos_token_id]


# --- tokenizer ---------------------------------------------------------------------------------------


def test_tokenizer_loads_offline_and_round_trips(meta, samples, no_network):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = AutoTokenizer.from_pretrained(meta["tokenizer_dir"], local_files_only=True)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert isinstance(load_tokenizer(Path(meta["tokenizer_dir"]).parent), PreTrainedTokenizerFast)  # dataset dir too
    assert (tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token) == ("<pad>", "<s>", "</s>", "<unk>")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    # Paragraphs from both splits (val text was never seen by the BPE trainer) plus odd text.
    paragraphs = [p for s in pt.SPLITS for x in samples[s][:5] for p in x["txt"].decode().split("\n\n") if p.strip()]
    paragraphs += [
        "  leading spaces, tabs\tand trailing newline\n",
        "déjà vu — “quotes” … 你好 🙂",
        "x = f(a) ; y=[1 ,2]",
    ]
    for text in paragraphs:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id and ids[-1] != tok.eos_token_id  # Llama-style: <s> added, </s> not
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
        assert tok.unk_token_id not in ids
    # BPE actually learned merges: English compresses well below one token per byte.
    text = samples["val"][0]["txt"].decode()
    assert len(tok(text, add_special_tokens=False)["input_ids"]) < 0.5 * len(text.encode())


def test_vocab_size_is_checked(tmp_path, capsys):
    with pytest.raises(ValueError, match="vocab_size"):
        pt.build_text_shards(tmp_path / "small", vocab_size=100)
    with pytest.raises(SystemExit) as exc:
        pt.main(["--out", str(tmp_path / "small"), "--vocab-size", "100"])
    assert exc.value.code == 2 and "--vocab-size" in capsys.readouterr().err
    assert not (tmp_path / "small").exists()


# --- rebuild -----------------------------------------------------------------------------------------


def test_rebuild_is_a_noop_and_other_settings_are_refused(built, meta, capsys):
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in built.rglob("*") if p.is_file()}
    assert pt.main(["--out", str(built), *BUILD_ARGS]) == 0
    assert "nothing to do" in capsys.readouterr().out
    again = pt.ensure_text_shards(built, **ENSURE_KW)
    assert again == meta
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in built.rglob("*") if p.is_file()} == before
    with pytest.raises(ValueError, match="vocab_size=2048 \\(wanted 1024\\)"):
        pt.ensure_text_shards(built, **{**ENSURE_KW, "vocab_size": 1024})
    assert pt.main(["--out", str(built), *BUILD_ARGS, "--seed", str(SEED + 1)]) == 1
    assert "--force" in capsys.readouterr().err


def test_forced_rebuild_is_byte_identical_and_tokenizer_sees_train_only(built, meta, documents, tmp_path, monkeypatch):
    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    seen: list[str] = []
    real = pt.train_tokenizer

    def recording(texts, vocab_size):
        seen.extend(texts)
        return real(texts, vocab_size)

    monkeypatch.setattr(pt, "train_tokenizer", recording)
    assert pt.main(["--out", str(copy), *BUILD_ARGS, "--force"]) == 0
    files = sorted(p.relative_to(built) for p in built.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(copy) for p in copy.rglob("*") if p.is_file())
    assert all((built / f).read_bytes() == (copy / f).read_bytes() for f in files)
    train_topics = set(meta["topics"]["train"])
    assert collections.Counter(seen) == collections.Counter(d.text for d in documents if d.topic in train_topics)


def test_refuses_a_foreign_non_empty_dir(tmp_path):
    root = tmp_path / "mine"
    root.mkdir()
    (root / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        pt.ensure_text_shards(root, **ENSURE_KW)
    assert (root / "notes.txt").read_text() == "keep me" and len(list(root.iterdir())) == 1


# --- loading -----------------------------------------------------------------------------------------


def test_decode_document_through_the_resumable_loader(meta, samples):
    assert pickle.loads(pickle.dumps(decode_document)) is decode_document
    n = meta["splits"]["train"]["samples"]
    loader = build_webdataset_loader(
        meta["train_urls"],
        decode=decode_document,
        collate=list,
        batch_size=1,
        rank=0,
        world_size=1,
        seed=SEED,
        shuffle_buffer=16,
    )
    it = iter(loader)
    batches = [next(it) for _ in range(n)]  # one epoch: every train document once
    loader.close()
    assert all(isinstance(b, list) and len(b) == 1 for b in batches)
    got = sorted(tuple(b[0]["input_ids"].tolist()) for b in batches)
    assert all(b[0]["input_ids"].dtype == torch.long for b in batches)
    assert got == sorted(tuple(_ids(x).tolist()) for x in samples["train"])


def test_decode_document_rejects_bad_arrays():
    with pytest.raises(ValueError, match="1-D"):
        decode_document({"__key__": "k", "ids.npy": pt.encode_ids(np.zeros((2, 2), dtype=np.uint16))})
    with pytest.raises(ValueError, match="integer"):
        decode_document({"__key__": "k", "ids.npy": pt.encode_ids(np.zeros(3, dtype=np.float32))})


def test_llm_stream_is_rows_of_max_seq_len_and_resumes_mid_document(meta, samples):
    """The LLM's loader (recipes/llm/data.py RowStream) on real shards: every micro-batch is micro_batch_size x dp rows
    of data.max_seq_len tokens, documents longer than a row included; the rows' tokens are the documents' in stream
    order (the loader's own document order), and a stream saved mid-document (through torch.save, as a checkpoint
    keeps it) resumes with the same next micro-batches."""
    from recipes.llm.data import build_train_loader
    from scripts.kiln.launch import compose

    cfg = compose(["recipe=llm_tiny", "trainer.micro_batch_size=2", "data.max_seq_len=64", "data.num_workers=0"])
    stream = build_train_loader(cfg, meta["train_urls"], dp=2, chat=False)
    it = iter(stream)
    batches = [next(it) for _ in range(6)]
    assert all(len(b) == 4 and [sum(len(p["input_ids"]) for p in row) for row in b] == [64] * 4 for b in batches)
    state = io.BytesIO()
    torch.save(stream.state_dict(), state)
    after = [next(it) for _ in range(3)]
    stream.close()

    loader = build_train_loader(cfg, meta["train_urls"], dp=2, chat=False).loader  # the documents, as read
    documents = [d["input_ids"] for batch, _ in zip(loader, range(40)) for d in batch]
    loader.close()
    laid = torch.cat([p["input_ids"] for b in batches + after for row in b for p in row])
    assert torch.equal(laid, torch.cat(documents)[: laid.numel()])
    ends = torch.tensor([len(d) for d in documents]).cumsum(0).tolist()
    assert 6 * 4 * 64 not in ends and any(len(d) > 64 for d in documents)  # saved mid-document; some span rows

    resumed = build_train_loader(cfg, meta["train_urls"], dp=2, chat=False)
    state.seek(0)
    resumed.load_state_dict(torch.load(state, weights_only=False))
    it = iter(resumed)
    again = [next(it) for _ in range(3)]
    resumed.close()
    flat = [[(p["input_ids"], p["labels"]) for b in run for row in b for p in row] for run in (after, again)]
    assert len(flat[0]) == len(flat[1]) and all(
        torch.equal(a, b) and torch.equal(la, lb) for (a, la), (b, lb) in zip(*flat)
    )
