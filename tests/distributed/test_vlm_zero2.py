"""vlm_tiny on 2 gloo ranks with ZeRO-2 and packing: trains, and matches its single-rank token accounting."""

from __future__ import annotations

import json

import pytest

from tests.conftest import losses, run_train

pytestmark = pytest.mark.distributed


def test_vlm_tiny_zero2_on_two_ranks_trains(tmp_path):
    run_train(["recipe=vlm_tiny", f"run.dir={tmp_path}", "parallel.zero_stage=2", "trainer.max_steps=20",
               "trainer.log_every=1", "trainer.micro_batch_size=16", "trainer.progress_bar=false",
               "trainer.eval=false", "data.num_workers=1", "optim.warmup_steps=5"], nproc=2)
    ls = losses(tmp_path)
    assert sorted(ls) == list(range(1, 21))
    assert sum(ls[s] for s in range(16, 21)) < 0.5 * sum(ls[s] for s in range(1, 6))
    memory = json.loads((tmp_path / "memory.json").read_text())
    assert memory["zero_stage"] == 2 and memory["world_size"] == 2
    assert (tmp_path / "export" / "model.safetensors").exists()
