"""GRPO end to end (recipes/llm/grpo.py, grpo.enabled=true): llm_tiny's export (the run test_rollout_vllm serves)
trained 3 GRPO steps on 8 tiny prompts (tests/fixtures/grpo.py), its samples drawn by vLLM's CPU build with the
trainer's weights pushed in before every step, each step's 2 prompts in 2 micro-batches (trainer.grad_accum=2: one sync
and one generation a step). Three runs for the module (~15-25 s each on 2 cores, most of it the engine's start): 3
steps (in the run cache: tests/distributed/test_grpo_layouts.py compares a 2-rank run with it), a resume of its step-2
checkpoint to step 3, and a run whose step-2 sync is broken on purpose.

Independent references: the export the run started from (the weights must have moved), the probe check's bound
(the engine computes what the trainer computes after every sync), and the uninterrupted run's step 3 (a resume draws
the same samples and rewards).
"""

from __future__ import annotations

import json

import pytest

from common.rollout.client import PROBE_BOUND
from tests.fixtures.grpo import ONE_RANK, grpo_args
from tests.fixtures.llm import tensors
from tests.fixtures.vllm import NEEDS_VLLM
from tests.support.launcher import run_train

pytestmark = NEEDS_VLLM

# TRL's names (GRPOTrainer) and the loop's own: the sync's gap and bytes, seconds per part of the step
KEYS = [
    "loss",
    "reward",
    "reward_std",
    "rewards/format_match/mean",
    "rewards/format_match/std",
    "frac_reward_zero_std",
    "advantages/mean",
    "advantages/std",
    "clip_ratio/region_mean",
    "completions/mean_length",
    "completions/clipped_ratio",
    "num_tokens_generated",
    "sync/logprob_gap",
    "sync/bytes",
    "time/sync_s",
    "time/generate_s",
    "time/reward_s",
    "time/train_s",
]


@pytest.fixture(scope="module")
def export(grpo_world):
    return grpo_world["export"]


@pytest.fixture(scope="module")
def run(grpo_world, trained):
    return trained(grpo_args(grpo_world, *ONE_RANK))


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def samples(run_dir, step: int) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "rollout" / "samples.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] == step]


def test_three_grpo_steps_log_trl_metrics_sync_every_step_and_move_the_weights(run, export):
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert not [k for k in KEYS if k not in r], r
        assert r["sync/logprob_gap"] <= PROBE_BOUND
        print(f"step {r['step']}: sync/logprob_gap {r['sync/logprob_gap']:.3g}, reward {r['reward']:.3f}")
    # 2 prompts x 4 samples a step, each scored 0 or 1 by the reward; some group's rewards differ (else no gradient)
    assert all(len(samples(run, step)) == 8 for step in (1, 2, 3))
    assert min(r["frac_reward_zero_std"] for r in records) < 1.0
    start, end = tensors(export), tensors(run / "export")
    moved = [k for k in start if not (start[k] == end[k]).all()]
    assert moved, "no weight changed"
    assert not (run / "rollout" / "start").exists()  # the engine's starting export goes with it


def test_a_resume_draws_the_same_samples_and_rewards(run, grpo_world, tmp_path):
    resumed = tmp_path / "resumed"
    ckpt = run / "checkpoints" / "step_0000002"
    run_train(grpo_args(grpo_world, *ONE_RANK, f"run.dir={resumed}", f"run.resume={ckpt}"))
    assert [r["step"] for r in metrics(resumed)] == [3]
    assert samples(resumed, 3) == samples(run, 3)
    again, first = metrics(resumed)[0], metrics(run)[2]
    for key in ("reward", "reward_std", "rewards/format_match/mean", "completions/mean_length"):
        assert again[key] == first[key], key


def test_a_sync_that_did_not_take_stops_the_run_in_one_line(grpo_world, tmp_path):
    """KILN_FAULTS=stale_sync@2 (common/faults.py): step 2's push leaves out the largest tensor of a layer, which step 1
    moved; the probe check stops the run before step 2 trains."""
    args = grpo_args(grpo_world, *ONE_RANK, f"run.dir={tmp_path / 'run'}", "trainer.max_steps=2")
    proc = run_train(args, check=False, env={"KILN_FAULTS": "stale_sync@2"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("kiln: error:")]
    assert len(errors) == 1 and "the rollout engine did not take the trainer's weights" in errors[0], errors
    print(errors[0])
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1]  # step 2 never trained
