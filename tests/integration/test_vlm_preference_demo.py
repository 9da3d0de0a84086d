"""The VLM preference demo of docs/preference.md#the-vlm-demo, at the docs' sizes: vlm_tiny trained on the digits (the
VLM digits demo: a base that reads digits), fine-tuned on data.preference_demo's conversations (the digit named as a
numeral four times in five, as a word the fifth), its export trained with ORPO on pairs with images preferring the
word, then scripts/preference_demo.py on held-out pairs (validation images no run trains on).

The figures come from the exports loaded by transformers, not from the trainer: each answer's log-prob summed over
its tokens, greedy generations by transformers' generate, the images through the export's processor. Before, the
model names the digit as a numeral (no held-out answer as a word) and reads most held-out images right; after, TRL's
reward accuracy (against the supervised model) is near 1 and most answers name the right digit as a word."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import metrics, run_train
from tests.support.launcher import python_ok, run_python

# Two 300-step vlm_tiny runs and an ORPO run: ~10 CPU-minutes, more than CI's budget holds, so `make test` leaves it out
# (pyproject.toml: -m 'not slow'); `pytest -m slow tests/integration/test_vlm_preference_demo.py` runs it.
pytestmark = [pytest.mark.integration, pytest.mark.slow]
RUN = ["recipe=vlm_tiny", "trainer.progress_bar=false", "checkpoint.every=0", "checkpoint.final=false"]
# The docs' commands, the evals the test does not read left out (the base's digit eval, the SFT's held-out loss).
BASE = [*RUN, "trainer.max_steps=300", "trainer.eval=false"]
PAIRS = ["data=llava", "data.max_seq_len=256", "data.num_workers=1"]
# ORPO, not DPO's sigmoid loss: the rejected answer carries the digit too, and DPO widened its margin by forgetting
# the digit (docs/preference.md#the-vlm-demo has the runs).
ORPO = ["preference.loss=orpo", "preference.beta=0.1", "optim.lr=2e-4", "optim.warmup_steps=5", "trainer.max_steps=40"]


def test_preference_training_teaches_the_word_on_held_out_images(tmp_path, trained):
    src, chat, pairs = tmp_path / "my_vpref_demo", tmp_path / "my_vpref_chat", tmp_path / "my_vpref_pairs"
    python_ok("-m", "data.preference_demo", "--vlm", "--out", str(src), "--held-out", "50")
    images = str(src / "images")
    python_ok("-m", "data.prepare_llava", "--json", str(src / "chat.json"), "--images", images, "--out", str(chat))
    base = trained(BASE)
    sft = tmp_path / "sft"
    init = [f"model.init_from={base / 'export'}"]
    run_train(
        [*RUN, *PAIRS, f"data.root={chat}", *init, "trainer.max_steps=300", "trainer.eval=false", f"run.dir={sft}"]
    )
    args = ["--input", str(src / "pairs.jsonl"), "--images", images, "--out", str(pairs), "--val-fraction", "0.1"]
    python_ok("-m", "data.prepare_preference", *args)
    dpo = tmp_path / "orpo"
    init = [f"model.init_from={sft / 'export'}", "trainer.micro_batch_size=16", "trainer.log_every=1"]
    run_train([*RUN, *PAIRS, f"data.root={pairs}", *ORPO, *init, f"run.dir={dpo}"])
    assert metrics(dpo)[1]["rewards/accuracies"] <= 0.1  # step 1: the supervised model prefers the numeral
    assert json.loads((dpo / "eval.json").read_text())["rewards/accuracies"] >= 0.9  # the trainer's own val pairs
    out = tmp_path / "samples"
    held_out = str(src / "held_out.jsonl")
    cmd = ["--before", str(sft / "export"), "--after", str(dpo / "export"), "--held-out", held_out, "--out", str(out)]
    python_ok("scripts/preference_demo.py", *cmd)
    result = json.loads((out / "eval.json").read_text())
    before, after = result["before"], result["after"]
    assert result["num_pairs"] == 50
    assert before["rewards/accuracies"] == 0.0 and before["prefers_chosen"] <= 0.1, before
    assert before["property_rate"] <= 0.1 and before["content_kept"] >= 0.8, before
    assert after["rewards/accuracies"] >= 0.9 and after["prefers_chosen"] >= 0.9, after
    assert after["property_rate"] >= 0.8 and after["content_kept"] >= 0.8, after
    print(f"vlm preference demo, {result['num_pairs']} held-out pairs: before {before}, after {after}")
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == 50 and all((out / "images" / r["images"][0].replace("/", "_")).is_file() for r in rows)
    table = (out / "generations.md").read_text()
    assert table.startswith("| held-out prompt | before (supervised) | after (DPO) |\n|---|---|---|\n| ![](images/val_")
    missing = run_python([sys.executable, "scripts/preference_demo.py", *cmd, "--images", str(tmp_path)], timeout=120)
    lines = [line for line in missing.stderr.splitlines() if line.strip()]
    assert missing.returncode == 2 and len(lines) == 1 and "no such image" in lines[0], missing.stderr
