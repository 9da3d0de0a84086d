"""The preference demo of docs/preference.md#demo, shortened: data.preference_demo's chats and pairs, llm_tiny
fine-tuned on the chats (answers end in "." four times in five), its export trained with DPO on pairs preferring
the answer that ends in "!", then scripts/preference_demo.py on held-out pairs (words and a phrasing no pair uses).

The figures come from the exports loaded by transformers, not from the trainer: each answer's log-prob summed over
its tokens, greedy generations by transformers' generate. Before DPO the model never ends an answer in "!" and
prefers the rejected answer on every held-out pair (its TRL reward accuracy is 0: it is its own reference); after,
the reward accuracy and the "!" rate in greedy generations are near 1 and the answers still say the opposite.

Marked slow (57 s in CI): `make test` leaves it out, `pytest -m slow tests/integration/test_llm_preference_demo.py`
runs it; tests/integration/test_llm_preference.py holds DPO learning the preference in CI."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import metrics, run_train
from tests.support.launcher import python_ok, run_python

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # ~1 CPU-minute: more than CI holds now
RUN = ["recipe=llm_tiny", "trainer.progress_bar=false", "checkpoint.every=0", "checkpoint.final=false"]
# Shorter than the docs' 150 supervised steps: rows of 128 tokens (two chats a row, half the step's compute) at twice
# the learning rate; the DPO run is the docs' own.
SFT = ["trainer.max_steps=100", "data.max_seq_len=128", "optim.lr=6e-3"]


def test_dpo_teaches_the_property_on_held_out_prompts(tmp_path):
    src, chat, pairs = tmp_path / "my_pref_demo", tmp_path / "my_pref_chat", tmp_path / "my_pref_pairs"
    python_ok("-m", "data.preference_demo", "--out", str(src))
    tokenizer = str(src / "tokenizer")
    python_ok(
        "-m", "data.prepare_chat", "--tokenizer", tokenizer, "--input", str(src / "chat.jsonl"), "--out", str(chat)
    )
    sft = tmp_path / "sft"
    run_train([*RUN, "data=chat_shards", f"data.root={chat}", *SFT, f"run.dir={sft}"])
    args = ["--tokenizer", tokenizer, "--input", str(src / "pairs.jsonl"), "--out", str(pairs), "--val-fraction", "0.1"]
    python_ok("-m", "data.prepare_preference", *args)
    dpo = tmp_path / "dpo"
    run_train(
        [
            *RUN,
            "data=preference_shards",
            f"data.root={pairs}",
            "data.max_seq_len=128",
            "preference.loss=sigmoid",
            f"model.init_from={sft / 'export'}",
            "optim.lr=1e-4",
            "optim.warmup_steps=5",
            "trainer.max_steps=40",
            "trainer.log_every=1",
            f"run.dir={dpo}",
        ]
    )
    assert metrics(dpo)[1]["rewards/accuracies"] == 0.0  # step 1: the policy is its reference, every reward 0
    assert json.loads((dpo / "eval.json").read_text())["rewards/accuracies"] >= 0.9  # the trainer's own val pairs
    out = tmp_path / "samples"
    held_out = str(src / "held_out.jsonl")
    python_ok(
        "scripts/preference_demo.py",
        "--before",
        str(sft / "export"),
        "--after",
        str(dpo / "export"),
        "--held-out",
        held_out,
        "--out",
        str(out),
    )
    result = json.loads((out / "eval.json").read_text())
    before, after = result["before"], result["after"]
    assert result["num_pairs"] == 27
    assert before["rewards/accuracies"] == 0.0 and before["prefers_chosen"] <= 0.1, before
    assert before["property_rate"] <= 0.1 and before["content_kept"] >= 0.7, before
    assert after["rewards/accuracies"] >= 0.9 and after["prefers_chosen"] >= 0.9, after
    assert after["property_rate"] >= 0.8 and after["content_kept"] >= 0.7, after
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == 27 and sum(r["after"].endswith("!") for r in rows) == round(27 * after["property_rate"])
    assert (out / "generations.md").read_text().startswith("| held-out prompt | before (supervised) | after (DPO) |")
    proc = run_python(
        [
            sys.executable,
            "scripts/preference_demo.py",
            "--before",
            str(tmp_path / "none"),
            "--after",
            str(dpo / "export"),
            "--held-out",
            held_out,
            "--out",
            str(out),
        ],
        timeout=120,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "not an exported model folder" in lines[0], proc.stderr
