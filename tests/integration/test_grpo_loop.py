"""GRPO end to end (recipes/llm/grpo.py, grpo.enabled=true): llm_tiny's export (the run test_rollout_vllm serves)
trained 3 GRPO steps on 8 tiny prompts, its samples drawn by vLLM's CPU build with the trainer's weights pushed in
before every step. Three runs for the module (~15-25 s each on 2 cores, most of it the engine's start): 3 steps, a
resume of its step-2 checkpoint to step 3, and a run whose step-2 sync is broken on purpose.

Independent references: the export the run started from (the weights must have moved), the probe check's bound
(the engine computes what the trainer computes after every sync), and the uninterrupted run's step 3 (a resume draws
the same samples and rewards).
"""

from __future__ import annotations

import json

import pytest

from common.rollout.client import PROBE_BOUND
from tests.fixtures.llm import tensors
from tests.fixtures.runs import LLM_SERVED
from tests.fixtures.vllm import NEEDS_VLLM
from tests.support.launcher import run_train

pytestmark = NEEDS_VLLM

WORDS = ["The with statement", "A list comprehension", "The import system", "Exceptions are"]
# format_match on "^ ": a completion that opens with a space. llm_tiny's samples do about half the time, so the groups'
# rewards differ and the advantages (and the gradient) are not zero.
PROMPTS = [{"prompt": w, "answer": "1", "format_pattern": "^ "} for w in [*WORDS, *(w.lower() for w in WORDS)]]
GRPO = [
    "recipe=llm_tiny",
    "data=prompt_shards",
    "grpo.enabled=true",
    "reward.functions=[common.rewards:format_match]",
    "grpo.num_generations=4",
    "grpo.max_completion_length=8",
    "data.max_seq_len=64",
    "data.num_workers=0",
    "trainer.micro_batch_size=2",
    "trainer.max_steps=3",
    "trainer.log_every=1",
    "trainer.eval=false",
    "trainer.progress_bar=false",
    "checkpoint.every=2",
    "optim.weight_decay=0",  # the weights move by the GRPO gradient only
    "optim.warmup_steps=0",
]
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
def export(trained):
    return trained(LLM_SERVED) / "export"


@pytest.fixture(scope="module")
def prompts(export, tmp_path_factory):
    from data.prepare_prompts import main

    folder = tmp_path_factory.mktemp("prompts")
    source = folder / "prompts.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    args = [
        "--tokenizer",
        str(export),
        "--input",
        str(source),
        "--out",
        str(folder / "shards"),
        "--val-fraction",
        "0.25",
    ]
    assert main(args) == 0
    return folder / "shards"


@pytest.fixture(scope="module")
def run(export, prompts, tmp_path_factory):
    """The 3 steps with the held-out evaluation (trainer.eval): before step 1 and after step 3, on the val split."""
    run_dir = tmp_path_factory.mktemp("grpo") / "run"
    args = [a for a in GRPO if a != "trainer.eval=false"] + ["trainer.eval=true"]
    run_train([*args, f"data.root={prompts}", f"model.init_from={export}", f"run.dir={run_dir}"])
    return run_dir


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


def test_a_resume_draws_the_same_samples_and_rewards(run, export, prompts, tmp_path):
    resumed = tmp_path / "resumed"
    ckpt = run / "checkpoints" / "step_0000002"
    run_train([*GRPO, f"data.root={prompts}", f"model.init_from={export}", f"run.dir={resumed}", f"run.resume={ckpt}"])
    assert [r["step"] for r in metrics(resumed)] == [3]
    assert samples(resumed, 3) == samples(run, 3)
    again, first = metrics(resumed)[0], metrics(run)[2]
    for key in ("reward", "reward_std", "rewards/format_match/mean", "completions/mean_length"):
        assert again[key] == first[key], key


def test_a_sync_that_did_not_take_stops_the_run_in_one_line(export, prompts, tmp_path):
    """KILN_FAULTS=stale_sync@2 (common/faults.py): step 2's push leaves out the largest tensor of a layer, which step 1
    moved; the probe check stops the run before step 2 trains."""
    args = [*GRPO, f"data.root={prompts}", f"model.init_from={export}", f"run.dir={tmp_path / 'run'}"]
    args = [a for a in args if not a.startswith("trainer.max_steps")] + ["trainer.max_steps=2"]
    proc = run_train(args, check=False, env={"KILN_FAULTS": "stale_sync@2"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("kiln: error:")]
    assert len(errors) == 1 and "the rollout engine did not take the trainer's weights" in errors[0], errors
    print(errors[0])
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1]  # step 2 never trained


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
