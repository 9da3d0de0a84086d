"""The processes tests start see no GPU unless the test is gpu-marked (tests/conftest.py): on a GPU
host, CPU multi-rank tests would otherwise pick NCCL and cuda:<rank>."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.launcher import launch_env

PROBE = "import os, torch; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')), torch.cuda.is_available())"


def test_cpu_tests_launch_ranks_that_see_no_gpu():
    env = launch_env(2)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["OMP_NUM_THREADS"] and "RANK" not in env
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["''", "False"], out.stderr


@pytest.mark.gpu
def test_gpu_tests_launch_processes_that_see_the_gpu():
    out = subprocess.run([sys.executable, "-c", PROBE], env=launch_env(1), capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-1] == "True", out.stderr


def test_the_metrics_reader_fails_on_a_repeated_step(tmp_path):
    """tests/conftest.py's `metrics`/`losses`: a step logged twice (a resume that did not rewind metrics.jsonl) fails,
    where a dict by step would keep the last record and the 'no duplicated step' checks would pass."""
    from tests.conftest import losses, metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {s}, "loss": {s / 10}, "lr": 1}}\n' for s in (1, 2, 3)))
    assert losses(tmp_path) == {1: 0.1, 2: 0.2, 3: 0.3}
    assert metrics(tmp_path, "loss", "lr")[2] == (0.2, 1)
    for steps in ((1, 2, 2, 3), (1, 3, 2)):
        path.write_text("".join(f'{{"step": {s}, "loss": 1.0}}\n' for s in steps))
        with pytest.raises(AssertionError, match="repeated or out of order"):
            losses(tmp_path)
