"""Qwen2.5-VL under DeepSpeed ZeRO-3 with full activation checkpointing on 2 gloo ranks takes the steps of one
process at ZeRO-0 (test_vlm_qwen_train's cached run: the same 8 conversations a step, packed at native resolution;
fp32, 1e-5 relative: only the reduction order differs), keeps its frozen tower out of training (the export holds it
bit for bit, the optimizer holds the merger and the language model only), its checkpoint resumes in one process
at ZeRO-0 with the 2-rank run's losses (any-layout resume: DeepSpeed's universal checkpoint), and scripts/export.py
on its last checkpoint writes the end-of-run export bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import load_script, losses, run_train
from tests.fixtures import vlm as fx
from tests.fixtures.lora import assert_same_export

pytestmark = pytest.mark.distributed
SAVED = 1  # the resume starts after step 1: its step 3 depends on the AdamW moments restored from step 1


def zero3_args(world: dict) -> list[str]:
    """The reference's run on 2 ranks: 4 conversations each (the same global batch), ZeRO-3, full AC."""
    return [
        *fx.qwen_run_args(world),
        "trainer.micro_batch_size=4",
        "parallel.zero_stage=3",
        "toggles.activation_checkpointing=full",
        "trainer.eval=false",
        f"checkpoint.every={SAVED}",
        "checkpoint.keep=3",
    ]


@pytest.fixture(scope="module")
def runs(qwen_world, trained):
    return trained(fx.qwen_run_args(qwen_world)), trained(zero3_args(qwen_world), 2)


def assert_same_steps(got: dict, want: dict, steps: list[int], what: str) -> None:
    assert sorted(got) == steps, got
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in steps)
    print(f"{what}: losses {[round(got[s], 6) for s in steps]}, max relative difference {worst:.1e}")
    assert worst <= 1e-5, (got, want)


def test_zero3_with_ac_on_two_ranks_takes_one_process_steps(runs, qwen_world):
    one, two = runs
    assert_same_steps(losses(two), losses(one), [1, 2, 3], "Qwen2.5-VL ZeRO-3 + AC, 2 ranks vs ZeRO-0, 1 rank")
    # Frozen by construction under ZeRO-3 (partitioned with the rest): the tower is the release's bit for bit, the
    # merger and the language model moved, and only they have weights, gradients and Adam state in the engine.
    release, out = load_file(qwen_world["qwen"] / "model.safetensors"), load_file(two / "export" / "model.safetensors")
    tower = [k for k in release if k.startswith("visual.") and ".merger." not in k]
    trained = [k for k in release if k not in tower]
    assert tower and all(torch.equal(out[k], release[k]) for k in tower)
    assert all(not torch.equal(out[k], release[k]) for k in trained if k.endswith("proj.weight") or ".mlp." in k)
    numel = sum(release[k].numel() for k in trained)
    memory = json.loads((two / "memory.json").read_text())
    assert (memory["zero_stage"], memory["world_size"], memory["trainable_params"]) == (3, 2, numel)
    # The optimizer's fp32 partitions: the trained parameters' numel over the 2 ranks, nothing of the tower.
    held = 0
    for shard in sorted((two / "checkpoints" / "step_0000003").glob("*optim_states.pt")):
        state = torch.load(shard, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        held += sum(t.numel() for t in state["fp32_flat_groups"])
    assert numel <= held <= numel + 2 * 64, (held, numel)  # each rank's partition padded to alignment


def test_zero3_checkpoint_resumes_in_one_process_at_zero0(runs, qwen_world, tmp_path):
    one, two = runs
    ckpt = two / "checkpoints" / f"step_{SAVED:07d}"
    args = [*fx.qwen_run_args(qwen_world), "trainer.eval=false", f"run.resume={ckpt}", f"run.dir={tmp_path}"]
    proc = run_train(args, nproc=1)
    assert "converting it to a DeepSpeed universal checkpoint" in proc.stdout, proc.stdout[-2000:]
    assert f"resumed from {ckpt} at step {SAVED}" in proc.stdout
    resumed = losses(tmp_path)
    assert_same_steps(resumed, losses(two), [2, 3], "resumed at ZeRO-0 on 1 rank vs the 2-rank ZeRO-3 run")


def test_export_py_from_the_zero3_checkpoint_with_ac(runs, tmp_path, capsys):
    """The 2 ranks' ZeRO-3 files of a run under activation checkpointing, where DeepSpeed records the blocks'
    parameters (the tower's frozen fragments, the language model's flat groups) under checkpoint_wrapper's prefix:
    the end-of-run export, file for file, every tensor bit for bit."""
    _, two = runs
    assert load_script("export").main([str(two), "--out", str(tmp_path / "again")]) == 0, capsys.readouterr().err
    assert_same_export(two / "export", tmp_path / "again")
