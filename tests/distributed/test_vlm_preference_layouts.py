"""DPO on the VLM (recipes/vlm/preference.py; a tiny llava-hf base, digit pairs with images) under DeepSpeed: the
1-rank run's steps on 2 gloo ranks under ZeRO-3 with full activation checkpointing (the frozen reference sharded as
the policy, each rank half the pairs), a resume of that run on 1 rank (any layout: the reference is rebuilt from the
start weights, not from the checkpoint), and finetune=lora, whose reference is the base with the adapter disabled.
At step 1 the policy is its own reference: every reward is 0 and the loss is ln 2, whatever the reference's path."""

from __future__ import annotations

import math

import pytest

from tests.conftest import metrics
from tests.fixtures.preference import vlm_dpo_args

pytestmark = pytest.mark.distributed


def assert_same_steps(one: dict, two: dict, what: str) -> None:
    assert two and set(two) <= set(one)
    for key in ("loss", "rewards/margins"):
        worst = max(abs(two[s][key] - one[s][key]) / max(abs(one[s][key]), 1e-3) for s in two)
        print(f"VLM DPO {what} vs one rank: max relative {key} difference over {len(two)} steps {worst:.1e}")
        assert worst <= 1e-4, key


def test_vlm_dpo_under_zero3_and_its_resume_on_one_rank_take_the_one_rank_steps(vlm_pairs_world, trained):
    one_dir = trained(vlm_dpo_args(vlm_pairs_world))
    one = metrics(one_dir)
    assert one[1]["loss"] == pytest.approx(math.log(2), abs=1e-6) and one[1]["rewards/margins"] == 0
    assert one[4]["loss"] < one[1]["loss"] and one[4]["rewards/margins"] > 0 and one[4]["pairs"] == 8
    zero3 = ["parallel.zero_stage=3", "toggles.activation_checkpointing=full", "trainer.micro_batch_size=4"]
    two_dir = trained(vlm_dpo_args(vlm_pairs_world, *zero3), nproc=2)
    assert_same_steps(one, metrics(two_dir), "ZeRO-3 + AC full on 2 ranks")
    resumed = trained(vlm_dpo_args(vlm_pairs_world, f"run.resume={two_dir / 'checkpoints' / 'step_0000002'}"))
    assert sorted(metrics(resumed)) == [3, 4]
    assert_same_steps(one, metrics(resumed), "ZeRO-3 checkpoint resumed on 1 rank")
    assert (one_dir / "export" / "config.json").is_file()


def test_vlm_dpo_under_lora_takes_the_base_as_reference(vlm_pairs_world, trained):
    run = metrics(trained(vlm_dpo_args(vlm_pairs_world, "finetune=lora", "optim.lr=1e-2")))
    assert run[1]["loss"] == pytest.approx(math.log(2), abs=1e-6) and run[1]["rewards/margins"] == 0
    assert run[4]["loss"] < run[1]["loss"] and run[4]["rewards/accuracies"] > 0.5
