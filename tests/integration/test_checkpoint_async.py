"""checkpoint.async_save=true (the LLM, DCP's async save): training goes on while a checkpoint is written; a save
that finds the previous one still writing waits with a line; a kill -9 during the background write leaves the
previous checkpoint as `latest`; the resumed run's losses are bitwise those of an uninterrupted run. A damaged
checkpoint makes a real resume fall back to the previous one (common/checkpoint.py). DeepSpeed recipes refuse
async_save with one line."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import pytest

from tests.conftest import losses, run_train
from tests.support.launcher import REPO, TRAIN, launch_env, train_command

pytestmark = pytest.mark.integration
ARGS = [
    "recipe=llm_tiny",
    "trainer.progress_bar=false",
    "trainer.log_every=1",
    "trainer.eval=false",
    "profile.count_flops=false",
    "trainer.max_steps=8",
    "checkpoint.every=2",
    "checkpoint.async_save=true",
]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted async run."""
    run_dir = tmp_path_factory.mktemp("full")
    run_train([*ARGS, "checkpoint.keep=5", f"run.dir={run_dir}"])
    return run_dir


def test_kill_during_an_async_write_keeps_the_previous_latest_and_resumes_bitwise(full, tmp_path):
    broken = tmp_path / "broken"
    # Step 4's write is held until step 6's save waits for it (faults: slow_checkpoint), then the process is killed
    # before the write is committed.
    proc = subprocess.run(
        train_command([*ARGS, f"run.dir={broken}"], 1),
        cwd=REPO,
        capture_output=True,
        text=True,
        env=launch_env(1, KILN_FAULTS="slow_checkpoint@4,kill_in_checkpoint@4"),
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert "kiln: checkpoint step_0000004 is still being written; step 6's save waits for it" in proc.stdout
    assert {5, 6} <= set(losses(broken))  # training went on while step 4 was being written
    ckpts = broken / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_0000002"
    assert not (ckpts / "step_0000004").exists()

    resumed = run_train([*ARGS, f"run.dir={broken}"])
    assert "at step 2" in resumed.stdout
    assert losses(broken) == losses(full)  # every step, bit for bit


def test_async_checkpoints_are_complete_and_verified(full):
    from common.checkpoint import verify

    ckpts = full / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", *(f"step_{s:07d}" for s in (2, 4, 6, 8))]
    assert (ckpts / "latest").read_text().strip() == "step_0000008"
    assert all(verify(ckpts / f"step_{s:07d}") is None for s in (2, 4, 6, 8))


def test_a_corrupted_shard_resumes_from_the_previous_checkpoint_bitwise(full, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(full, run_dir)
    shard = run_dir / "checkpoints" / "step_0000008" / "dcp" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x80
    shard.write_bytes(bytes(data))
    (run_dir / "checkpoints" / "step_0000006" / "trainer.pt").unlink()
    resumed = run_train([*ARGS, f"run.dir={run_dir}"])
    fallbacks = [line for line in resumed.stdout.splitlines() if "fails verification" in line]
    assert len(fallbacks) == 2
    assert "step_0000008" in fallbacks[0] and "dcp/__0_0.distcp is corrupted" in fallbacks[0]
    assert "step_0000006" in fallbacks[1] and "trainer.pt is missing" in fallbacks[1]
    assert "at step 4" in resumed.stdout
    assert losses(run_dir) == losses(full)


@pytest.mark.parametrize("recipe", ["dit_tiny", "vlm_tiny"])
def test_deepspeed_recipes_refuse_async_save_with_one_line(recipe, tmp_path):
    proc = subprocess.run(
        [sys.executable, TRAIN, f"recipe={recipe}", "checkpoint.async_save=true", f"run.dir={tmp_path / 'run'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("kiln: error: checkpoint.async_save=true is for the LLM")
    assert not (tmp_path / "run").exists()
