"""parallel.cp=2 for a Qwen2.5-VL and a Qwen3-VL (recipes/vlm/context_parallel.py: Ulysses over the language model;
the tower and the merger(s) whole on both cp ranks, the merged embeddings and the mRoPE positions [3, R, L] split with
the tokens, and Qwen3-VL's DeepStack features with their image and video tokens) on 2 gloo ranks takes the steps of
one process: test_vlm_qwen_train's cached runs (the same 8 conversations a step, with images and videos, packed at
native resolution). The losses equal, the gradient norms within 5e-7 relative (fp32: only the reduction order
differs; AdamW hides a gradient's scale from the losses, a cp-fold error shows in the norm)."""

from __future__ import annotations

import pytest

from tests.conftest import metrics
from tests.fixtures import vlm as fx

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(("world", "name"), [("qwen_world", "Qwen2.5-VL"), ("qwen3_world", "Qwen3-VL")])
def test_qwen_at_cp2_takes_one_process_steps(request, world, name, trained):
    args = fx.qwen_run_args(request.getfixturevalue(world))
    one = metrics(trained(args), "loss", "grad_norm")
    cp = metrics(trained([*args, "parallel.cp=2", "trainer.eval=false"], 2), "loss", "grad_norm")
    assert sorted(cp) == sorted(one) == [1, 2, 3]
    worst = [max(abs(cp[s][i] - one[s][i]) / one[s][i] for s in one) for i in (0, 1)]
    print(f"{name} cp=2 vs 1 rank, 3 steps: max relative difference loss {worst[0]:.1e}, grad norm {worst[1]:.1e}")
    # README: one process's losses (equal) and gradient norms within 8.2e-8; the norms' bound is 6x that.
    assert all(cp[s][0] == one[s][0] for s in one), (cp, one)
    assert worst[1] <= 5e-7, (cp, one)
