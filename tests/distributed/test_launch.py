"""Kiln's launcher, `python scripts/train.py --nproc_per_node N ...` (scripts/kiln/launch.py: torchrun's launch through
torch's elastic agent), started as a user starts it, in real processes: a mistake in a multi-rank command is one
line on the console, the layout's first."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.launcher import TRAIN, launch_env

pytestmark = pytest.mark.distributed


def test_a_multi_rank_mistake_is_one_line_and_the_layout_is_checked_first(tmp_path):
    """cp=3 on 2 ranks: before, Kiln's line about data.max_seq_len (divisible by 2*cp; two more refusals followed
    as the user fixed each), then torchrun's OMP banner and its 40-line ChildFailedError report (45 lines).
    Now the layout's error alone: one line, exit status 2, nothing written."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in launch_env(2).items() if k != "OMP_NUM_THREADS"}  # as a user's shell has it
    cmd = [sys.executable, TRAIN, "--nproc_per_node", "2", "recipe=llm_tiny", "parallel.cp=3", f"run.dir={run_dir}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    console = (proc.stdout + proc.stderr).splitlines()
    assert console == ["kiln: error: parallel.cp=3 does not divide the 2 ranks this job started"], "\n".join(console)
    assert proc.returncode == 2
    assert not run_dir.exists()
