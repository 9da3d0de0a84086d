"""Shared test helpers: run the real entrypoint (python or torchrun) in a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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


def run_train(args: list[str], nproc: int = 1, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("OMP_NUM_THREADS", "1" if nproc > 1 else "2")
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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
