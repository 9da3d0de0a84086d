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
