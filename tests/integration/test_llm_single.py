"""llm_tiny in one process: activation checkpointing (full, selective) recomputes exactly, so the
losses equal the run without it."""

from __future__ import annotations

import pytest

from tests.conftest import losses, run_train

pytestmark = pytest.mark.integration
BASE = ["recipe=llm_tiny", "trainer.max_steps=5", "trainer.log_every=1", "trainer.progress_bar=false",
        "checkpoint.final=false"]


def test_activation_checkpointing_changes_memory_not_math(tmp_path):
    runs = {}
    for mode in ("none", "full", "selective"):
        runs[mode] = tmp_path / mode
        run_train([*BASE, f"toggles.activation_checkpointing={mode}", f"run.dir={runs[mode]}"])
    ref = losses(runs["none"])
    assert sorted(ref) == [1, 2, 3, 4, 5] and ref[5] < ref[1]
    for mode in ("full", "selective"):
        got = losses(runs[mode])
        for step in ref:
            assert got[step] == pytest.approx(ref[step], rel=1e-6), f"{mode} step {step}"
