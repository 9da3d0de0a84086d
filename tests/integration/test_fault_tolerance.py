"""Faults injected into real runs, and what each one loses (the goal: nothing).

- kill -9 at a random step, then run.resume=auto: every step's loss bitwise equal to an
  uninterrupted run (VLM; LLM under tp=2 x pp=2; the DiT case is tests/integration/test_dit_resume.py);
- kill -9 while a checkpoint is being written: `latest` still names the previous complete one;
- a rank crashing under torchrun --max-restarts=1: restarted, resumed, finished, same losses;
- NaN losses/gradients: the step is skipped (weights untouched) and counted; N in a row stop
  the run with one line and a checkpoint of the last good weights;
- a rank hanging: the collective timeout turns it into one line naming the stuck rank; so does
  Kiln's watchdog, which does it under NCCL (where no timeout exception reaches Python).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import pytest
import torch

from tests.conftest import FAST_DIT, losses, run_train
from tests.fixtures.runs import LLM_TP2_PP2
from tests.support.launcher import REPO, launch_env, train_command

pytestmark = pytest.mark.integration
DIT = [*FAST_DIT, "trainer.eval=false", "diffusion.samples_per_class=1", "diffusion.sample_steps=2"]


def _logged(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def kill_at_random_step(args: list[str], run_dir, nproc: int, first: int, last: int) -> int:
    """SIGKILL the whole process group once step k (random in [first, last]) is logged; returns k."""
    k = random.randint(first, last)
    print(f"killing at step {k}")
    proc = subprocess.Popen(
        train_command([*args, f"run.dir={run_dir}"], nproc),
        cwd=REPO,
        env=launch_env(nproc),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 600
    while _logged(run_dir) < k and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _logged(run_dir) < int(args_value(args, "trainer.max_steps")), "the run finished before the kill"
    return k


def args_value(args: list[str], key: str) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith(f"{key}="))


def assert_resumes_exactly(args: list[str], trained, tmp_path, nproc: int, first: int, last: int) -> None:
    full, broken = trained(args, nproc), tmp_path / "broken"
    kill_at_random_step(args, broken, nproc, first, last)
    resumed = run_train([*args, f"run.dir={broken}"], nproc=nproc, timeout=900)  # run.resume=auto is the default
    assert "resumed from" in resumed.stdout
    assert losses(broken) == losses(full)  # every step, bit for bit; no step missing or repeated


def test_vlm_killed_at_random_step_resumes_exactly(trained, tmp_path):
    args = [
        "recipe=vlm_tiny",
        "trainer.progress_bar=false",
        "trainer.log_every=1",
        "trainer.micro_batch_size=16",
        "trainer.max_steps=10",
        "checkpoint.every=3",
        "trainer.eval=false",
        "data.max_seq_len=128",
    ]
    # Killed at 4-8: resumed from the checkpoint of step 3 or 6, never the last step's.
    assert_resumes_exactly(args, trained, tmp_path, nproc=1, first=4, last=8)


@pytest.mark.distributed
def test_llm_tp2_pp2_killed_at_random_step_resumes_exactly(trained, tmp_path):
    # The uninterrupted run is test_llm_pipeline's tp2 x pp2 run (checkpoints at 5 and 10): killed at 6-8, the
    # run resumes from step 5.
    assert_resumes_exactly(LLM_TP2_PP2, trained, tmp_path, nproc=4, first=6, last=8)


def test_kill_during_checkpoint_write_keeps_the_previous_one(tmp_path):
    args = [*DIT, "trainer.max_steps=12", "checkpoint.every=4"]
    full, broken = tmp_path / "full", tmp_path / "broken"
    run_train([*args, f"run.dir={full}"])
    proc = subprocess.run(
        train_command([*args, f"run.dir={broken}"], 1),
        cwd=REPO,
        capture_output=True,
        text=True,
        env=launch_env(1, KILN_FAULTS="kill_in_checkpoint@8"),
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL
    ckpts = broken / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_0000004"
    assert not (ckpts / "step_0000008").exists() and (ckpts / ".tmp" / "step_0000008").is_dir()  # partial, unseen

    resumed = run_train([*args, f"run.dir={broken}"])
    assert "at step 4" in resumed.stdout
    assert not (ckpts / ".tmp" / "step_0000008").exists()  # the partial write was cleared
    assert losses(broken) == losses(full)


@pytest.mark.distributed
def test_crashed_rank_is_restarted_by_torchrun_and_resumes(tmp_path):
    args = [*DIT, "trainer.max_steps=10", "checkpoint.every=4", "parallel.zero_stage=1"]
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    run_train([*args, f"run.dir={full}"], nproc=2)
    proc = subprocess.run(
        train_command([*args, f"run.dir={crashed}"], 2, "--max-restarts=1"),
        cwd=REPO,
        capture_output=True,
        text=True,
        env=launch_env(2, KILN_FAULTS="crash@6:1"),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1 crashes at step 6" in proc.stdout and "resumed from" in proc.stdout and "at step 4" in proc.stdout
    assert losses(crashed) == losses(full)


def _dit_weights(run_dir, step: int) -> dict[str, torch.Tensor]:
    ckpt = run_dir / "checkpoints" / f"step_{step:07d}"
    return torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=False, map_location="cpu")["module"]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "nproc,zero_stage,fault", [(1, 0, "nan_loss@3,nan_loss@4"), (2, 2, "nan_loss@3:1,nan_loss@4:1")]
)
def test_nonfinite_steps_are_skipped_and_counted(tmp_path, nproc, zero_stage, fault):
    """ZeRO-0 (plain torch AdamW) and ZeRO-2 (DeepSpeed's own overflow check, NaN on one rank only)."""
    args = [
        *DIT,
        "trainer.max_steps=6",
        "checkpoint.every=1",
        "checkpoint.keep=10",
        f"parallel.zero_stage={zero_stage}",
        f"run.dir={tmp_path}",
    ]
    proc = subprocess.run(
        train_command(args, nproc),
        cwd=REPO,
        capture_output=True,
        text=True,
        env=launch_env(nproc, KILN_FAULTS=fault),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert [s for s, r in records.items() if r["loss"] != r["loss"]] == [3, 4]  # NaN exactly where injected
    assert records[6]["skipped_steps"] == 2 and all(r["loss"] < 10 for s, r in records.items() if s not in (3, 4))
    assert _same(_dit_weights(tmp_path, 2), _dit_weights(tmp_path, 4))  # skipped: weights untouched
    assert not _same(_dit_weights(tmp_path, 4), _dit_weights(tmp_path, 5))  # training went on


def test_too_many_bad_steps_stop_with_the_last_good_weights(tmp_path):
    args = [
        "recipe=llm_tiny",
        "trainer.progress_bar=false",
        "trainer.log_every=1",
        "trainer.max_steps=10",
        "checkpoint.every=2",
        "checkpoint.keep=5",
        "trainer.max_bad_steps=3",
        f"run.dir={tmp_path}",
    ]
    proc = subprocess.run(
        train_command(args, 1),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=launch_env(1, KILN_FAULTS="nan_loss@4,nan_loss@5,nan_loss@6"),
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("kiln: error: 3 steps in a row had a non-finite loss"), proc.stderr
    assert "weights of step 3" in errors[0]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_0000006"

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def model(step: int) -> dict:
        out = tmp_path / f"model{step}.pt"
        dcp_to_torch_save(tmp_path / "checkpoints" / f"step_{step:07d}" / "dcp", out)
        return torch.load(out, weights_only=False)["model"]

    # Steps 4-6 were skipped: the checkpoints of steps 4 and 6 both hold step 3's weights.
    assert _same(model(4), model(6)) and not _same(model(2), model(4))
    resumed = run_train([*args, "trainer.max_steps=7"])  # no faults now: it carries on
    assert "at step 6" in resumed.stdout and losses(tmp_path)[7] < 10


@pytest.mark.distributed
def test_hung_rank_becomes_a_timeout_naming_it(tmp_path):
    args = [*DIT, "trainer.max_steps=6", "parallel.timeout_s=10", f"run.dir={tmp_path}"]
    start = time.time()
    proc = run_train(args, 2, check=False, env={"KILN_FAULTS": "hang@3:1"}, timeout=300)
    assert proc.returncode != 0 and time.time() - start < 240
    assert (
        "kiln: error: rank 0: a collective timed out after 10 s (parallel.timeout_s) at step 3; "
        "not in the collective: rank 1 (last started step 3)" in proc.stderr
    ), proc.stderr[-3000:]


@pytest.mark.distributed
def test_hung_rank_is_named_by_the_watchdog(tmp_path):
    """The watchdog (on by default under NCCL; KILN_WATCHDOG=1 here on gloo) fires at parallel.timeout_s,
    before the process group's own timeout (timeout_s + WATCHDOG_MARGIN_S = 40 s here) would."""
    args = [*DIT, "trainer.max_steps=6", "parallel.timeout_s=10", f"run.dir={tmp_path}"]
    proc = run_train(args, 2, check=False, env={"KILN_FAULTS": "hang@3:1", "KILN_WATCHDOG": "1"}, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kiln: error:")]
    assert errors == [
        "kiln: error: rank 0: a collective timed out after 10 s (parallel.timeout_s, kiln watchdog) at "
        "step 3; not in the collective: rank 1 (last started step 3)"
    ], proc.stderr[-3000:]
