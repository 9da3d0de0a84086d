"""Prompts for GRPO (data.prepare_prompts): each prompt's ids equal what TRL's GRPOTrainer._tokenize_prompts makes
of it (text: the plain tokenizer; messages: the chat template with its generation prompt), the row's other fields kept
as JSON beside it, malformed rows and over-long prompts skipped and counted."""

from __future__ import annotations

import json
import types

import pytest

from common.data.dataset import load_dataset_meta
from common.data.webdataset import iter_samples
from data import prepare_prompts
from tests.fixtures.llm import write_llama_tokenizer

ROWS = [
    {"prompt": "What is 2 + 2?", "answer": "#### 4"},
    {"prompt": [{"role": "user", "content": "What is 3 + 4?"}], "answer": "7", "level": 1},
    {
        "prompt": [
            {"role": "system", "content": "Answer in <answer> tags."},
            {"role": "user", "content": "And 5 + 6?"},
        ],
        "answer": "11",
        "format_pattern": "^<answer>.*</answer>$",
    },
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_llama_tokenizer(tmp_path_factory.mktemp("tok") / "Llama-3.2-1B")


def build(tokenizer_dir, out, inputs, *extra) -> dict:
    argv = ["--tokenizer", str(tokenizer_dir), "--input", *map(str, inputs), "--out", str(out), "--val-fraction", "0.2"]
    assert prepare_prompts.main([*argv, *extra]) == 0
    return load_dataset_meta(out, "tokenizer")


def prompts_of(meta: dict) -> list[dict]:
    return [prepare_prompts.decode_prompt(s) for s in iter_samples([*meta["train_urls"], *meta["val_urls"]])]


def trl_prompt_ids(tokenizer, prompts: list) -> list[list[int]]:
    """TRL's own GRPOTrainer._tokenize_prompts on a stand-in trainer (no model needed)."""
    from trl import GRPOTrainer

    me = types.SimpleNamespace(
        processing_class=tokenizer, _is_vlm=False, environment_factories=None, tools=None, chat_template=None,
        chat_template_kwargs={},
    )  # fmt: skip
    return [list(ids) for ids in GRPOTrainer._tokenize_prompts(me, prompts)[0]]


def test_prompts_are_tokenized_as_trl_and_keep_their_fields(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS * 2))
    meta = build(tokenizer_dir, tmp_path / "out", [path])
    assert meta["format"] == "prompts" and meta["prompts"] == 6
    assert meta["fields"] == {"answer": 6, "format_pattern": 2, "level": 2}
    got = prompts_of(meta)
    assert len(got) == 6
    for sample in got:
        row = next(r for r in ROWS if r["prompt"] == sample["prompt"])
        assert {k: v for k, v in sample.items() if k != "ids"} == row
        # one prompt at a time: TRL tokenizes text and conversations in separate calls
        assert sample["ids"] == trl_prompt_ids(tokenizer, [row["prompt"]])[0]
    chat = next(s for s in got if isinstance(s["prompt"], list))
    assert tokenizer.decode(chat["ids"]).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    text = next(s for s in got if isinstance(s["prompt"], str))
    assert text["ids"][0] == tokenizer.bos_token_id


def test_malformed_rows_and_long_prompts_are_skipped_and_counted(tokenizer_dir, tmp_path):
    rows = [
        json.dumps(ROWS[0]),
        json.dumps({"answer": "4"}),
        json.dumps({"prompt": 42}),
        json.dumps({"prompt": [{"role": "user"}]}),
        json.dumps({"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}),
        json.dumps({"prompt": "word " * 200, "answer": "1"}),
        "[1, 2]",
        "{not json",
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(rows * 2) + "\n")
    meta = build(tokenizer_dir, tmp_path / "out", [path], "--max-prompt-len", "64")
    assert meta["prompts"] == 2 and meta["dropped_too_long"] == 2
    assert meta["inputs"]["skipped_rows"] == {
        "no prompt": 2,
        "a prompt neither a string nor a message list": 4,
        "messages that end in an assistant turn": 2,
        prepare_prompts.TOO_LONG: 2,
        "not a JSON object": 2,
        "bad JSON": 2,
    }
    assert meta["longest_sample"] <= 64


def test_nothing_usable_is_one_line(tokenizer_dir, tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"answer": "4"}) + "\n")
    argv = ["--tokenizer", str(tokenizer_dir), "--input", str(path), "--out", str(tmp_path / "out")]
    assert prepare_prompts.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no usable row: 1 no prompt" in err, err
