"""Toggles on the real recipe: bf16 mixed precision under ZeRO-2, and torch.compile per block."""

from __future__ import annotations

import math

import pytest

from tests.conftest import FAST_DIT, losses, run_train

pytestmark = pytest.mark.integration
SHORT = [*FAST_DIT, "trainer.eval=false", "checkpoint.final=false", "trainer.micro_batch_size=32"]


def test_bf16_zero2_trains(tmp_path):
    run_train(
        [*SHORT, f"run.dir={tmp_path}", "trainer.max_steps=30", "toggles.precision=bf16", "parallel.zero_stage=2"]
    )
    ls = losses(tmp_path)
    assert all(math.isfinite(v) for v in ls.values())
    assert sum(ls[s] for s in range(26, 31)) < 0.7 * sum(ls[s] for s in range(1, 6))
    assert (tmp_path / "export" / "transformer" / "config.json").exists()


def test_compile_matches_eager(tmp_path):
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    run_train([*SHORT, f"run.dir={eager}", "trainer.max_steps=3"])
    run_train([*SHORT, f"run.dir={compiled}", "trainer.max_steps=3", "toggles.compile=true"])
    a, b = losses(eager), losses(compiled)
    for step in (1, 2, 3):
        assert b[step] == pytest.approx(a[step], rel=1e-4)
