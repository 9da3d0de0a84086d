"""t2i_tiny on 2 gloo ranks at ZeRO-2 with activation checkpointing takes the steps of the 1-rank run: every random
draw (VAE posterior noise, flow noise, timestep, caption drop) comes from each sample's own generator, so the global
batch's loss is the same whatever rank computes which sample."""

from __future__ import annotations

import pytest

from tests.conftest import losses
from tests.fixtures.t2i import t2i_run_args

pytestmark = pytest.mark.distributed


def test_zero2_two_ranks_match_one_rank(trained, t2i_world):
    args = t2i_run_args(t2i_world)
    one = losses(trained(args))  # the integration test's run (micro-batch 8 on one rank)
    split = [a for a in args if not a.startswith("trainer.micro_batch_size=")]
    two = losses(
        trained(
            [
                *split,
                "trainer.micro_batch_size=4",
                "parallel.zero_stage=2",
                "toggles.activation_checkpointing=full",
                "trainer.eval=false",
            ],
            nproc=2,
        )
    )
    assert sorted(two) == sorted(one)
    for step, loss in one.items():
        assert two[step] == pytest.approx(loss, rel=1e-4), step
