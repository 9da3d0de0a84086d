"""A run killed after its step-10 checkpoint and resumed with run.resume=auto logs, for steps
11-20, exactly the losses of an uninterrupted run (bit for bit)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import FAST_DIT, REPO, TRAIN, losses, run_train

pytestmark = pytest.mark.integration
ARGS = [*FAST_DIT, "trainer.max_steps=20", "checkpoint.every=10", "trainer.eval=false", "data.num_workers=2"]


def _kill_after_first_checkpoint(run_dir) -> None:
    """SIGKILL the run as soon as checkpoints/latest appears (step 10 of 20)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen(
        [sys.executable, TRAIN, *ARGS, f"run.dir={run_dir}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not latest.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert latest.read_text().strip() == "step_0000010", "the run got past step 10 before the kill"


def test_killed_and_resumed_run_matches_uninterrupted(tmp_path):
    full, broken = tmp_path / "full", tmp_path / "broken"
    run_train([*ARGS, f"run.dir={full}"])
    _kill_after_first_checkpoint(broken)
    resumed = run_train([*ARGS, f"run.dir={broken}", "run.resume=auto"])
    assert "resumed from" in resumed.stdout and "step 10" in resumed.stdout

    expected, got = losses(full), losses(broken)
    assert sorted(got) == list(range(1, 21))  # metrics.jsonl rewound: no duplicated steps
    for step in range(11, 21):
        assert got[step] == expected[step], f"step {step}: {got[step]!r} != {expected[step]!r}"
