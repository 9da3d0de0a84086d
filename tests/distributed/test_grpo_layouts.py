"""GRPO on 2 gloo ranks under FSDP2 (dp=2, one prompt a rank) takes the one-rank run's steps, whose 2 prompts a step
go through 2 micro-batches (trainer.grad_accum=2, tests/fixtures/grpo.py; test_grpo_loop checks that run): one engine
on rank 0, fed the weights gathered from both ranks' shards, draws the same samples and rewards, and the losses,
gradient norms and the weights after step 2 agree within float32 rounding. The same 2-rank run breaks its step-3 sync
on purpose (KILN_FAULTS=stale_sync@3): both ranks stop, with one line, and none is left waiting.

Independent references: the one-rank run (another layout, another accumulation), the probe check's bound, and the
fault's known effect (a layer's tensor left out of the push)."""

from __future__ import annotations

import json

import pytest
import torch

from common.rollout.client import PROBE_BOUND
from scripts.kiln import processes
from tests.fixtures.grpo import ONE_RANK, grpo_args
from tests.fixtures.vllm import NEEDS_VLLM

pytestmark = [pytest.mark.distributed, *NEEDS_VLLM]

DP2 = ["parallel.dp=2", "trainer.micro_batch_size=1", "trainer.grad_accum=1"]
# Each forward holds one prompt's 4 samples in both layouts; what differs is the sum of the two prompts' gradients
# (FSDP's reduce-scatter against one rank's accumulation): float32 rounding. Measured: weights 1.2e-7 apart (docs/rl.md)
LOSS_BOUND = 1e-6  # absolute: GRPO's loss at ratio 1 is -mean(advantages), ~0 (the gap measured 0)
GRAD_NORM_BOUND = 1e-5  # relative
WEIGHT_BOUND = 1e-6  # absolute, weights up to ~5


def metrics(run_dir) -> dict[int, dict]:
    """The training steps' records by step (those with a loss: the held-out evaluation's step 0 is left out)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def samples(run_dir, step: int) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "rollout" / "samples.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] == step]


def model_at(run_dir, step: int, tmp_path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{run_dir.name}-{step}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step_{step:07d}" / "dcp", out)
    return torch.load(out, weights_only=False)["model"]


def test_grpo_on_two_fsdp_ranks_takes_the_one_rank_steps_and_a_failed_sync_stops_both(grpo_world, trained, tmp_path):
    one = trained(grpo_args(grpo_world, *ONE_RANK))
    two = tmp_path / "dp2"
    # torchrun itself, not the tests' preloaded launcher: when rank 1 stops first, torchrun sends rank 0 SIGTERM, which
    # Kiln's stop-signal handler takes, so rank 0 says its line; the preloaded launcher kills it at once.
    proc = processes.run_train(
        grpo_args(grpo_world, *DP2, f"run.dir={two}"), nproc=2, check=False, env={"KILN_FAULTS": "stale_sync@3"}
    )
    # Step 3's sync did not take: rank 0's error, raised on both ranks; rank 0 says it (torchrun's report follows).
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("kiln: error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert "the rollout engine did not take the trainer's weights" in errors[0], errors
    print(errors[0])
    first, second = metrics(one), metrics(two)
    assert sorted(second) == [1, 2]  # step 3 never trained
    for step in (1, 2):
        assert samples(two, step) == samples(one, step), step  # token ids, text and rewards
        a, b = first[step], second[step]
        assert b["sync/logprob_gap"] <= PROBE_BOUND
        for key in ("reward", "reward_std", "advantages/mean", "num_tokens_generated"):
            assert b[key] == a[key], (step, key)
        loss, norm = abs(b["loss"] - a["loss"]), abs(b["grad_norm"] / a["grad_norm"] - 1)
        print(
            f"step {step}: |loss gap| {loss:.2g}, grad_norm {a['grad_norm']:.7g} vs {b['grad_norm']:.7g} (relative "
            f"{norm:.2g}), sync/logprob_gap {b['sync/logprob_gap']:.3g}"
        )
        assert loss <= LOSS_BOUND and norm <= GRAD_NORM_BOUND, step
    w1, w2 = model_at(one, 2, tmp_path), model_at(two, 2, tmp_path)
    assert w1.keys() == w2.keys()
    worst = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    largest = max(w.abs().max().item() for w in w1.values())
    print(f"weights after step 2: max |1 rank - dp=2| {worst:.2g} (the largest weight {largest:.2g})")
    assert worst <= WEIGHT_BOUND
