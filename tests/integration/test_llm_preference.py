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


def test_precomputed_reference_logps_train_the_live_references_losses(pairs_root, trained, tmp_path):
    """preference.reference=precomputed: the starting weights' log-probs of every pair, computed once into
    <data.root>/reference_logps/<fingerprint>/ (a file per shard), train the losses of the live frozen reference;
    a second run reads them (nothing computed); a run resumed without them stops with one line."""
    import shutil

    root = tmp_path / "pairs"
    shutil.copytree(pairs_root, root)  # the cache is written beside the data: a copy keeps the shared shards clean
    live = metrics(trained(dpo_run_args(pairs_root)))
    args = [
        a for a in dpo_run_args(pairs_root) if not a.startswith(("data.root=", "trainer.max_steps=", "checkpoint."))
    ]
    args += [f"data.root={root}", "preference.reference=precomputed", "trainer.max_steps=4", "checkpoint.every=4"]
    proc = run_train([*args, f"run.dir={tmp_path / 'a'}"])
    assert "computing the reference's log-probs of 10 shard(s)" in proc.stdout, proc.stdout[-2000:]
    (folder,) = (root / "reference_logps").iterdir()
    assert sorted(p.name for p in folder.iterdir()) == [f"train-{i:06d}.npz" for i in range(8)] + [
        f"val-{i:06d}.npz" for i in range(2)
    ]
    got = metrics(tmp_path / "a")
    for step in range(1, 5):
        for key in ("loss", "rewards/margins"):
            assert got[step][key] == pytest.approx(live[step][key], rel=1e-5, abs=1e-7), (step, key)
    proc = run_train([*args, "trainer.max_steps=1", f"run.dir={tmp_path / 'b'}"])
    assert "computing" not in proc.stdout
    shutil.rmtree(folder)
    ckpt = tmp_path / "a" / "checkpoints" / "step_0000004"
    proc = run_train([*args, f"run.dir={tmp_path / 'c'}", f"run.resume={ckpt}"], check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "a run resumed at step 4 can no longer compute" in lines[0]
