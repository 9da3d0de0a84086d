"""dit_tiny on 2 gloo ranks under torchrun: ZeRO stages 0-3 with activation checkpointing agree."""

from __future__ import annotations

import json

import pytest

from tests.conftest import FAST_DIT, losses, run_train

pytestmark = pytest.mark.distributed
STEPS = 6


@pytest.fixture(scope="module")
def stage_runs(tmp_path_factory):
    runs = {}
    for stage in (0, 1, 2, 3):
        run_dir = tmp_path_factory.mktemp(f"zero{stage}")
        run_train(
            [
                *FAST_DIT,
                f"run.dir={run_dir}",
                f"parallel.zero_stage={stage}",
                f"trainer.max_steps={STEPS}",
                "toggles.activation_checkpointing=full",
                "trainer.micro_batch_size=16",
                "data.num_workers=1",
                "trainer.eval=false",
                "checkpoint.final=false",
            ],
            nproc=2,
            timeout=600,
        )
        runs[stage] = run_dir
    return runs


def test_losses_agree_across_zero_stages(stage_runs):
    reference = losses(stage_runs[0])
    assert sorted(reference) == list(range(1, STEPS + 1))
    for stage in (1, 2, 3):
        other = losses(stage_runs[stage])
        for step, loss in reference.items():
            assert other[step] == pytest.approx(loss, rel=1e-5), f"stage {stage} step {step}"
    assert reference[STEPS] < reference[1]  # it trains


def test_zero3_partitions_model_state(stage_runs):
    """Per-rank bytes of weights + grads + Adam state: stage 3 holds about half of stage 0 on 2 ranks."""
    state = {s: json.loads((stage_runs[s] / "memory.json").read_text()) for s in (0, 3)}
    for s in (0, 3):
        assert state[s]["world_size"] == 2
    ratio = state[3]["per_rank_state_bytes"][0] / state[0]["per_rank_state_bytes"][0]
    assert 0.45 < ratio < 0.6, ratio
