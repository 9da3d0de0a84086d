"""GRPO end to end (recipes/llm/grpo.py, grpo.enabled=true): llm_tiny's export (the run test_rollout_vllm serves)
trained 3 GRPO steps on 6 tiny prompts, 2 more held out (tests/fixtures/grpo.py), with a KL reference
(grpo.beta=0.04), its samples drawn by vLLM's CPU build with the trainer's weights pushed in before every step, each
step's 2 prompts in 2 micro-batches (trainer.grad_accum=2: one sync and one generation a step). Three runs for the
module (~15-25 s each on 2 cores, most of it the engine's start): 3 steps (in the run cache:
tests/distributed/test_grpo_layouts.py compares a 2-rank run with it), a resume of its step-2 checkpoint to step 3,
and 2 steps under finetune=lora (the adapter moves). The sync broken on purpose is test_grpo_layouts' 2-rank run.

Independent references: the export the run started from (the weights must have moved; transformers' forward of it is
the KL's reference), the probe check's bound (the engine computes what the trainer computes after every sync), and
the uninterrupted run's step 3 (a resume draws the same samples and rewards, against the same reference).
"""

from __future__ import annotations

import json

import pytest
import torch

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
    "kl",
]


@pytest.fixture(scope="module")
def export(grpo_world):
    return grpo_world["export"]


@pytest.fixture(scope="module")
def prompts(grpo_world):
    return grpo_world["prompts"]


@pytest.fixture(scope="module")
def run(grpo_world, trained):
    """The 3 steps with the held-out evaluation (trainer.eval): before step 1 and after step 3, on the val split."""
    return trained(grpo_args(grpo_world, *ONE_RANK))


def metrics(run_dir) -> list[dict]:
    """The training steps' records (the held-out evaluation's are eval_records')."""
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def eval_records(run_dir) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "eval/reward" in r]


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
    # the reference is the start, not the checkpoint resumed: the same KL as the run that went on
    assert again["kl"] == pytest.approx(first["kl"], rel=1e-5, abs=1e-9)


def hf_logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """transformers' log-probs of `completion`'s tokens after `prompt` (fp32, temperature 1)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_the_kl_is_to_the_starting_weights(run, export):
    """grpo.beta > 0: step 1's policy is its reference (KL 0); step 3's KL equals TRL's k3 estimate computed by
    transformers from the starting export (the reference) and the step-2 checkpoint (the policy that step 3 scored)
    on step 3's samples. The ratio to the rollout's log-probs, which TRL's KL is weighted by, is 1 within the probe's
    gap (temperature 1: the engine holds the same weights)."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes.llm import weights
    from recipes.llm.hf_adapter import to_hf_state_dict
    from recipes.llm.model import Transformer

    records = metrics(run)
    assert abs(records[0]["kl"]) <= 1e-6
    assert all(r["kl"] > 0 for r in records[1:])
    reference = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    policy = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    args = weights.checkpoint_args(export)
    state = {"model": Transformer(args).state_dict()}
    dcp.load(state, checkpoint_id=str(run / "checkpoints" / "step_0000002" / "dcp"))
    policy.load_state_dict(to_hf_state_dict(state["model"], args), strict=True)
    tokenizer = AutoTokenizer.from_pretrained(export)
    k3 = []
    for row in samples(run, 3):
        prompt = list(tokenizer(row["prompt"])["input_ids"])
        delta = hf_logps(reference, prompt, row["token_ids"]) - hf_logps(policy, prompt, row["token_ids"])
        k3.append(torch.exp(delta) - delta - 1)
    want = torch.cat(k3).mean().item()  # the step's completion tokens' mean (TRL's kl metric)
    gap = abs(records[2]["kl"] - want)
    kl1, kl3 = records[0]["kl"], records[2]["kl"]
    print(f"grpo kl: step 1 {kl1:.3g}; step 3 {kl3:.6g}, transformers' {want:.6g} (gap {gap:.2g})")
    assert gap <= 1e-5


def test_under_lora_the_adapter_moves_and_the_reference_is_the_base(grpo_world, tmp_path):
    """finetune=lora: the engine starts on model.init_from itself with LoRA enabled, each sync sends the adapter only
    (sync/bytes: the adapter file the export writes) and the probe check runs through it; grpo.beta's reference is the
    policy with its adapter off: kl 0 at step 1 (peft's B starts at 0), > 0 once the adapter moved."""
    run_dir = tmp_path / "run"
    export = grpo_world["export"]
    args = ["trainer.max_steps=2", "finetune=lora", "trainer.micro_batch_size=2", "trainer.eval=false"]
    run_train(grpo_args(grpo_world, *args, f"run.dir={run_dir}"))
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    adapter = (run_dir / "export" / "adapter_model.safetensors").stat().st_size
    for r in records:
        assert r["sync/logprob_gap"] <= PROBE_BOUND and r["sync/bytes"] == adapter, r
    gaps, kls = ([f"{r[k]:.3g}" for r in records] for k in ("sync/logprob_gap", "kl"))
    print(f"grpo lora: sync/bytes {adapter:,}; gap {', '.join(gaps)}; kl {', '.join(kls)} (steps 1, 2)")
    assert abs(records[0]["kl"]) <= 1e-6 and records[1]["kl"] > 0
    assert not (run_dir / "rollout" / "start").exists() and export.is_dir()  # no start export; the base stays


def test_the_held_out_reward_scores_greedy_answers_before_and_after_training(run, export, prompts):
    """trainer.eval under grpo.enabled: the engine's greedy answer to each val prompt, before step 1 (step 0) and after
    step 3, scored by the run's reward. References: format_match's rule applied here to the logged answers, and
    transformers' own greedy generation from the export the run started from (step 0's weights)."""
    import re

    import torch
    from transformers import AutoModelForCausalLM

    from common.data.dataset import load_dataset_meta
    from common.data.webdataset import iter_samples
    from recipes.llm.grpo import decode_prompt

    val = [decode_prompt(s) for s in iter_samples(load_dataset_meta(prompts)["val_urls"])]
    records = eval_records(run)
    assert [r["step"] for r in records] == [0, 3] and len(val) >= 2
    assert records[-1].items() >= json.loads((run / "eval.json").read_text()).items()  # merged into step 3's record
    rows = [json.loads(line) for line in (run / "rollout" / "eval_samples.jsonl").read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    for r in records:
        answers = [row for row in rows if row["step"] == r["step"]]
        assert [a["prompt"] for a in answers] == [p["prompt"] for p in val]
        rescored = [1.0 if re.match("^ ", a["completion"]) else 0.0 for a in answers]
        assert r["eval/reward"] == pytest.approx(sum(rescored) / len(rescored), abs=1e-6), (r, answers)
        assert r["eval/rewards/format_match/mean"] == r["eval/reward"] and r["eval/num_prompts"] == len(val)
        assert r["eval/sync/logprob_gap"] <= PROBE_BOUND
        print(f"step {r['step']}: eval/reward {r['eval/reward']:.3f} on {len(val)} held-out prompts")
    for p, a in zip(val, [row for row in rows if row["step"] == 0]):
        with torch.no_grad():
            out = model.generate(torch.tensor([p["ids"]]), max_new_tokens=8, do_sample=False)
        assert a["token_ids"] == out[0, len(p["ids"]) :].tolist()[: len(a["token_ids"])], (p["prompt"], a)
