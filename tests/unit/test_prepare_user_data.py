"""Your own text and chat data (data.prepare_text --tokenizer, data.prepare_chat): documents encoded as the
tokenizer defines them, labels exactly on assistant tokens (checked against a hand-built expectation),
bad files and rows skipped and counted, and what training reads of them (recipes/llm/data.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import webdataset as wds

from common.config import DataConfig
from common.data import prepare_dataset
from common.data.dataset import load_dataset_meta, tokenizer_sha256
from common.distributed import DistInfo
from common.errors import DataError
from data import prepare_chat, prepare_text
from recipes.llm.data import decode_document, load_tokenizer, local_batch
from tests.fixtures.llm import (
    EOT,
    HEADER_END,
    HEADER_START,
    chat_conversations,
    write_chat,
    write_corpus,
    write_llama_tokenizer,
)

SOLO = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
CONVERSATION = [
    {"role": "system", "content": "Answer in one sentence."},
    {"role": "user", "content": "What is the opposite of hot?"},
    {"role": "assistant", "content": "The opposite of hot is cold."},
    {"role": "user", "content": "  And of up?  "},
    {"role": "assistant", "content": "  Down, the opposite of up.\n"},  # the template trims content
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return write_llama_tokenizer(tmp_path_factory.mktemp("models") / "Llama-3.2-1B")


@pytest.fixture(scope="module")
def tok(tok_dir):
    return prepare_text.user_data.load_tokenizer(tok_dir)


def _samples(root: Path) -> list[dict]:
    meta = load_dataset_meta(root, asset="tokenizer")
    return [
        s
        for split in ("train", "val")
        for s in wds.WebDataset(meta[f"{split}_urls"], shardshuffle=False, empty_check=False)
    ]


# --- text ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Six good .txt files, a good .jsonl and .parquet, and one broken file of each kind."""
    folder = write_corpus(tmp_path_factory.mktemp("data") / "corpus", files=6)
    (folder / "rows.jsonl").write_text('{"text": "First row."}\n{"text": ""}\n{"text": "Second row."}\n')
    pq.write_table(pa.table({"text": ["A parquet row.", "Another one."], "id": [1, 2]}), folder / "rows.parquet")
    (folder / "broken.jsonl").write_text('{"text": "ok"}\n{"text": \n')  # a parse error
    (folder / "wrong_field.jsonl").write_text('{"body": "no text field here"}\n')
    pq.write_table(pa.table({"body": ["no text column"]}), folder / "no_column.parquet")
    (folder / "empty.txt").write_text("  \n")
    (folder / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    (folder / "notes.md").write_text("not a suffix the builder reads")
    return folder


@pytest.fixture(scope="module")
def text_root(tmp_path_factory, tok_dir, corpus) -> Path:
    out = tmp_path_factory.mktemp("built") / "my_text"
    argv = [
        "--tokenizer",
        str(tok_dir),
        "--input",
        f"{corpus}/*",
        str(corpus / "missing.txt"),
        "--out",
        str(out),
        "--train-shards",
        "4",
        "--val-shards",
        "1",
        "--val-fraction",
        "0.2",
    ]
    assert prepare_text.main(argv) == 0
    return out


def test_text_documents_are_encoded_as_the_tokenizer_defines_them(text_root, corpus, tok):
    meta = json.loads((text_root / "meta.json").read_text())
    texts = [(corpus / f"doc{i:02d}.txt").read_text() for i in range(6)]
    texts += ["First row.", "Second row.", "A parquet row.", "Another one."]
    assert meta["format"] == "text" and sum(meta["splits"][s]["samples"] for s in ("train", "val")) == len(texts)
    bos, eos = tok.convert_tokens_to_ids("<|begin_of_text|>"), tok.convert_tokens_to_ids("<|end_of_text|>")
    # Independently: bos + the text's BPE tokens + eos, for every document, with bos once.
    expected = sorted(tuple([bos, *tok.encode(t, add_special_tokens=False), eos]) for t in texts)
    got = [decode_document(s)["input_ids"].tolist() for s in _samples(text_root)]
    assert sorted(tuple(g) for g in got) == expected
    assert all(g.count(bos) == 1 and g[0] == bos and g[-1] == eos for g in got)
    assert meta["tokens"]["train"] + meta["tokens"]["val"] == sum(map(len, expected))
    assert meta["splits"]["val"]["samples"] == 2 and meta["ids_dtype"] == "uint16"


def test_bad_text_files_are_skipped_and_counted(text_root, corpus):
    inputs = json.loads((text_root / "meta.json").read_text())["inputs"]
    assert len(inputs["used"]) == 8  # six .txt, rows.jsonl, rows.parquet
    reasons = {Path(s["path"]).name: s["reason"].split(" (")[0] for s in inputs["skipped"]}
    assert reasons == {
        "broken.jsonl": "unreadable",
        "latin1.txt": "unreadable",
        "wrong_field.jsonl": "no 'text' field",
        "no_column.parquet": "no 'text' field",
        "empty.txt": "empty",
        "notes.md": "unsupported suffix",
        "missing.txt": "missing",
    }


def test_the_tokenizer_travels_with_the_data(text_root, tok):
    meta = json.loads((text_root / "meta.json").read_text())
    copy = load_tokenizer(text_root)
    # The saved copy is the same tokenizer (what a checkpoint's tokenizer is compared with).
    assert meta["tokenizer_sha256"] == tokenizer_sha256(copy) == tokenizer_sha256(tok)
    assert copy.chat_template == tok.chat_template and copy.eos_token_id == tok.eos_token_id


def test_rebuild_is_a_noop_and_other_inputs_are_refused(text_root, tok_dir, corpus, capsys):
    argv = [
        "--tokenizer",
        str(tok_dir),
        "--input",
        f"{corpus}/*",
        str(corpus / "missing.txt"),
        "--out",
        str(text_root),
        "--train-shards",
        "4",
        "--val-shards",
        "1",
        "--val-fraction",
        "0.2",
    ]
    assert prepare_text.main(argv) == 0 and "nothing to do" in capsys.readouterr().out
    assert prepare_text.main([*argv[:3], f"{corpus}/doc*.txt", *argv[5:]]) == 1
    assert "inputs_digest" in capsys.readouterr().err


def test_all_bad_inputs_stop_with_one_line_and_write_nothing(tmp_path, tok_dir, corpus, capsys):
    out = tmp_path / "nothing"
    argv = [
        "--tokenizer",
        str(tok_dir),
        "--input",
        str(corpus / "broken.jsonl"),
        str(corpus / "empty.txt"),
        "--out",
        str(out),
    ]
    assert prepare_text.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: none of the 2 input files could be used") and not out.exists()
    assert (
        prepare_text.main(
            ["--tokenizer", str(tmp_path / "no_model"), "--input", str(corpus / "doc00.txt"), "--out", str(out)]
        )
        == 2
    )
    assert "--tokenizer" in capsys.readouterr().err and not out.exists()
    with pytest.raises(SystemExit):  # --tokenizer without --input
        prepare_text.main(["--tokenizer", str(tok_dir), "--out", str(out)])


# --- chat ----------------------------------------------------------------------------------------------


def expected_llama3(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Llama 3's chat format built piece by piece (independent of the template and of the builder): bos, then
    per message <|start_header_id|> role <|end_header_id|> "\\n\\n" content.strip() <|eot_id|>; the mask is 1
    exactly on an assistant message's content tokens and its <|eot_id|>."""
    special = tok.convert_tokens_to_ids
    ids, mask = [tok.bos_token_id], [0]
    for m in messages:
        head = [
            special(HEADER_START),
            *tok.encode(m["role"], add_special_tokens=False),
            special(HEADER_END),
            *tok.encode("\n\n", add_special_tokens=False),
        ]
        body = [*tok.encode(m["content"].strip(), add_special_tokens=False), special(EOT)]
        ids += head + body
        mask += [0] * len(head) + [int(m["role"] == "assistant")] * len(body)
    return ids, mask


def test_exactly_the_assistant_tokens_carry_labels(tok):
    sample = prepare_chat.encode_conversation(tok, CONVERSATION)
    ids, mask = expected_llama3(tok, CONVERSATION)
    assert sample["ids"].tolist() == ids
    assert sample["mask"].tolist() == mask
    # The rendering is the template's own: the same ids as apply_chat_template.
    assert ids == list(tok.apply_chat_template(CONVERSATION, tokenize=True)["input_ids"])
    labelled = tok.decode([i for i, m in zip(ids, mask) if m])
    assert labelled == "The opposite of hot is cold.<|eot_id|>Down, the opposite of up.<|eot_id|>"


def test_chat_labels_reach_the_packed_batch(tok):
    sample = prepare_chat.encode_conversation(tok, CONVERSATION)
    decoded = decode_document(
        {
            "__key__": "k",
            "ids.npy": prepare_text.encode_ids(sample["ids"]),
            "mask.npy": prepare_text.encode_ids(sample["mask"]),
        }
    )
    ids, mask = expected_llama3(tok, CONVERSATION)
    assert decoded["labels"].tolist() == [i if m else -100 for i, m in zip(ids, mask)]
    # Packed with a text document in one row: the conversation keeps its labels, the document all of its own.
    doc = torch.arange(3, 40)
    packed = local_batch([[decoded, {"input_ids": doc, "labels": doc}]], dp_rank=0, dp=1, max_seq_len=256, pad_id=1)
    assert int((packed.labels != -100).sum()) == sum(mask) + len(doc) - 1  # the packer masks a document's first label


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    """The chat fixture plus one malformed row of each kind and one conversation too long for --max-seq-len 200."""
    path = write_chat(tmp_path_factory.mktemp("data") / "chat.jsonl", n=40)
    bad = [
        '{"messages": [{"role": "user", "content": "unterminated"}',  # bad JSON
        json.dumps({"conversation": []}),  # no messages list
        json.dumps({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}),  # no content
        json.dumps({"messages": [{"role": "user", "content": "Hello?"}]}),  # no assistant turn
        json.dumps({"messages": [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}]}),
        json.dumps({"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]}),
    ]
    with path.open("a") as f:
        f.write("\n".join(bad) + "\n")
    return path


def test_chat_build_counts_malformed_and_too_long_rows(tmp_path, tok_dir, chat_file, capsys):
    out = tmp_path / "my_chat"
    argv = [
        "--tokenizer",
        str(tok_dir),
        "--input",
        str(chat_file),
        "--out",
        str(out),
        "--max-seq-len",
        "200",
        "--train-shards",
        "2",
        "--val-shards",
        "1",
    ]
    assert prepare_chat.main(argv) == 0
    assert "1 dropped as longer than 200 tokens" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    assert meta["format"] == "chat" and meta["conversations"] == 40 and meta["dropped_too_long"] == 1
    rows = {reason.split(" (")[0]: n for reason, n in meta["inputs"]["skipped_rows"].items()}
    assert rows == {
        "bad JSON": 1,
        "no messages list": 1,
        "a message without a string role and content": 1,
        "no assistant turn": 1,
        "refused by the chat template": 1,
        "longer than --max-seq-len": 1,
    }
    assert meta["longest_sample"] <= 200
    labels = [decode_document(s)["labels"] for s in _samples(out)]
    assert sum(int((lab != -100).sum()) for lab in labels) == meta["labelled_tokens"]
    # Training refuses a data.max_seq_len shorter than the longest conversation (never cuts one).
    from recipes.llm.data import prepare_data
    from scripts.kiln.launch import compose

    cfg = compose(["recipe=llm_tiny", "data=chat_shards", f"data.root={out}", "data.max_seq_len=32"])
    with pytest.raises(DataError, match="data.max_seq_len=32"):
        prepare_data(cfg, SOLO)


def test_chat_needs_a_template_and_usable_rows(tmp_path, tok_dir, chat_file, capsys):
    no_template = tmp_path / "base"
    tok = load_tokenizer(tok_dir)
    tok.chat_template = None
    tok.save_pretrained(no_template)
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    out = tmp_path / "out"
    assert prepare_chat.main(["--tokenizer", str(no_template), "--input", str(chat_file), "--out", str(out)]) == 2
    assert "no chat template" in capsys.readouterr().err and not out.exists()
    assert (
        prepare_chat.main(
            ["--tokenizer", str(tok_dir), "--input", str(chat_file), "--out", str(out), "--max-seq-len", "8"]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no conversation could be used" in err[0] and not out.exists()


def test_a_file_without_one_usable_row_says_why(tmp_path, tok_dir, capsys):
    """No row parses: the one line counts the rows' reasons (the three most frequent), not just "no usable row"."""
    path = tmp_path / "broken.jsonl"
    rows = [
        "{not json",
        "{not json either",
        json.dumps({"messages": [{"role": "user", "content": "Hi?"}]}),
        json.dumps({"conversation": []}),
        json.dumps({"messages": [{"role": "user"}]}),
    ]
    path.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    assert prepare_chat.main(["--tokenizer", str(tok_dir), "--input", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and not out.exists()
    assert err[0].startswith(
        f"error: none of the 1 input files could be used ({path}: empty (no usable row: 2 bad "
        "JSON, 1 no assistant turn, 1 no messages list, ...))"
    ), err[0]


def test_a_missing_user_dataset_names_its_build_command(tmp_path):
    from scripts.kiln.launch import compose

    cfg = compose(["recipe=llm_tiny", "data=chat_shards", f"data.root={tmp_path / 'none'}"])
    with pytest.raises(
        DataError,
        match=r"data.build is empty.*python -m data.prepare_chat --tokenizer .* --out " + str(tmp_path / "none"),
    ):
        prepare_dataset(cfg.data, SOLO)
    assert DataConfig().build_hint == ""


def test_fixture_conversations_are_well_formed(tok):
    for conv in chat_conversations(20):
        sample = prepare_chat.encode_conversation(tok, conv["messages"])
        assert sample["mask"].any() and sample["ids"].size == sample["mask"].size
        assert np.array_equal(sample["ids"], expected_llama3(tok, conv["messages"])[0])
