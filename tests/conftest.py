"""Shared test helpers: run the real entrypoint (python or torchrun) in a subprocess; keep GPUs
away from the processes CPU tests start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(REPO / "scripts" / "train.py")

# Small, fast DiT runs: few steps, tiny eval, no progress bar.
FAST_DIT = [
    "recipe=dit_tiny",
    "trainer.progress_bar=false",
    "trainer.sample_every=0",
    "trainer.log_every=1",
    "diffusion.sample_steps=5",
    "diffusion.samples_per_class=2",
    "diffusion.eval_samples_per_class=3",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(nproc: int, **extra: str) -> dict[str, str]:
    """The environment of a training run a test starts: this process's, without its rank variables,
    with a thread count that fixes float sums (they differ with it), and CUDA_VISIBLE_DEVICES=""
    unless the test is gpu-marked (the session fixture below)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("OMP_NUM_THREADS", "1" if nproc > 1 else "2")
    return {**env, **extra}


def run_train(args: list[str], nproc: int = 1, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    env = launch_env(nproc)
    if nproc == 1:
        cmd = [sys.executable, TRAIN, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={_free_port()}", TRAIN, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    from common.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")}


# ---- GPUs and CPU tests ------------------------------------------------------------------------
# CPU tests are written for gloo and the CPU: on a GPU host, a 2-rank run would pick NCCL and
# cuda:<local rank> (cuda:1 does not exist on a 1-GPU host), and single runs would lose the bitwise
# reproducibility the tests assert. So every process a test starts sees no GPU, unless the test is
# gpu-marked. The variable is set for the whole session (module-scoped fixtures start processes
# too) after this process has counted its GPUs: CUDA reads it once, at initialisation, so pytest
# itself still sees them and runs the gpu tests.
_VISIBLE_GPUS = os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture(scope="session", autouse=True)
def _child_processes_see_no_gpu():
    torch.cuda.is_available()  # initialise CUDA here with the real devices before hiding them
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")
        yield


def _show_gpus(mp: pytest.MonkeyPatch) -> None:
    if _VISIBLE_GPUS is None:
        mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        mp.setenv("CUDA_VISIBLE_DEVICES", _VISIBLE_GPUS)


@pytest.fixture(autouse=True)
def _gpu_tests_see_the_gpus(request, monkeypatch):
    if request.node.get_closest_marker("gpu") is not None:
        _show_gpus(monkeypatch)


@contextmanager
def gpus_visible():
    """For a fixture shared with gpu tests whose processes need the GPU (a TensorRT build)."""
    with pytest.MonkeyPatch.context() as mp:
        _show_gpus(mp)
        yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
