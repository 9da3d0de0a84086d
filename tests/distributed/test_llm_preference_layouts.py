"""DPO (preference.loss=sigmoid, a live frozen reference sharded as the policy) on 2 gloo ranks takes the 1-rank run's
steps: under FSDP2 over dp=2 (each rank packs half the pairs; the loss is a mean over the global count of pairs) and
under tensor parallelism tp=2 (the policy's and the reference's linears split alike): the same losses and reward
margins."""

from __future__ import annotations

import pytest

from tests.conftest import metrics
from tests.fixtures.preference import dpo_run_args

pytestmark = pytest.mark.distributed


# Each dp rank packs trainer.micro_batch_size rows: at dp=2 half the 1-rank run's 8, the same global batch of pairs.
@pytest.mark.parametrize(
    "layout", [["parallel.dp=2", "trainer.micro_batch_size=4"], ["parallel.tp=2"]], ids=["fsdp2_dp2", "tp2"]
)
def test_dpo_on_two_ranks_matches_one(pairs_root, trained, layout):
    one = metrics(trained(dpo_run_args(pairs_root)))
    two = metrics(trained([*dpo_run_args(pairs_root), *layout, "trainer.eval=false"], nproc=2))
    assert sorted(two) == sorted(one)
    for key in ("loss", "rewards/margins"):
        worst = max(abs(two[s][key] - one[s][key]) / max(abs(one[s][key]), 1e-3) for s in one)
        print(f"DPO {layout[0]} vs one rank: max relative {key} difference over {len(one)} steps {worst:.1e}")
        assert worst <= 1e-4, key
