"""llm_tiny trained on preference pairs as a user runs it: data.prepare_preference on TRL's conversational layout,
then scripts/train.py with preference.loss=sigmoid (DPO, a live frozen reference). The first step's policy is its
reference (loss ln 2, every reward 0: the reference holds the start weights); the loss falls and the pairs' reward
accuracy rises, in training and on held-out pairs; metrics.jsonl carries TRL's names; the export is the SFT one. A run
resumed from its step-8 checkpoint takes the same steps 9 and 10: its reference is the start, not the checkpoint."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import metrics, run_train
from tests.fixtures.preference import dpo_run_args

pytestmark = pytest.mark.integration
TRL_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen")


def test_dpo_learns_the_preference(pairs_root, trained, tmp_path):
    args = dpo_run_args(pairs_root)
    run = trained(args)
    steps = metrics(run)
    first, last = steps[1], steps[10]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert all(first[k] == pytest.approx(0.0, abs=1e-4) for k in TRL_NAMES[:4]), first
    assert last["loss"] < 0.6 * math.log(2) and last["rewards/accuracies"] >= 0.9, last
    assert last["rewards/margins"] > 0.2 and last["rewards/rejected"] < last["rewards/chosen"]
    held_out = json.loads((run / "eval.json").read_text())
    assert held_out["num_pairs"] == 32 and held_out["rewards/accuracies"] >= 0.9, held_out
    assert (run / "export" / "config.json").exists() and (run / "export" / "tokenizer.json").exists()

    ckpt = run / "checkpoints" / "step_0000008"
    run_train([*args, "trainer.eval=false", f"run.dir={tmp_path / 'resumed'}", f"run.resume={ckpt}"])
    resumed = metrics(tmp_path / "resumed")
    assert sorted(resumed) == [9, 10]
    for step in (9, 10):
        assert resumed[step]["loss"] == pytest.approx(steps[step]["loss"], rel=1e-6), step
        assert resumed[step]["rewards/margins"] == pytest.approx(steps[step]["rewards/margins"], rel=1e-5), step
