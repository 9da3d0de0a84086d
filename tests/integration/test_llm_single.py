"""llm_tiny in one process: activation checkpointing (full, selective) recomputes exactly, so the
losses equal the run without it; the loss is the global token mean however the batch is accumulated."""

from __future__ import annotations

import pytest

from tests.conftest import losses, run_train

pytestmark = pytest.mark.integration
BASE = [
    "recipe=llm_tiny",
    "trainer.max_steps=5",
    "trainer.log_every=1",
    "trainer.progress_bar=false",
    "checkpoint.final=false",
]


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


def test_the_loss_is_the_global_token_mean_however_the_batch_is_accumulated(tmp_path):
    """One definition of the loss (common/trainer.py): the sum over the global batch divided by its labelled
    tokens, and the gradient of exactly that. The same 8 documents per step as one micro-batch or as two of 4
    (packed into other rows: document masking keeps the math) give the same losses step after step, the
    later steps through the first steps' gradients. A mean of per-micro-batch means would not: their token
    counts differ."""
    one, two = tmp_path / "one", tmp_path / "two"
    run_train([*BASE, "trainer.max_steps=3", "trainer.micro_batch_size=8", f"run.dir={one}"])
    run_train([*BASE, "trainer.max_steps=3", "trainer.micro_batch_size=4", "trainer.grad_accum=2", f"run.dir={two}"])
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
