"""scripts/train.py in a subprocess, started as a user starts it (python, or torchrun for N ranks): the one
launcher that tests and benchmarks share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from common.distributed import free_port

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "scripts" / "train.py")
# A launcher's own process-group variables must not leak into the job it starts.
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch_env(nproc: int = 1, threads: int | None = None, **extra: str) -> dict[str, str]:
    """This environment without process-group variables. Intra-op threads: `threads`, else the
    caller's OMP_NUM_THREADS, else 1 per rank for several ranks and 2 for one (float sums depend on
    the thread count, so runs that are compared must agree on it)."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("OMP_NUM_THREADS", "1" if nproc > 1 else "2")
    return {**env, **extra}


def train_command(args: list[str], nproc: int = 1, *torchrun_args: str) -> list[str]:
    """`python scripts/train.py ARGS`, or under torchrun on a free port for nproc > 1."""
    if nproc == 1:
        return [sys.executable, TRAIN, *args]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
            *torchrun_args, TRAIN, *args]


def run_train(args: list[str], nproc: int = 1, *, timeout: float = 600, check: bool = True, threads: int | None = None,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a training job to its end; `check`: raise with its output's tail if it exits non-zero."""
    cmd = train_command(args, nproc)
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env(nproc, threads, **(env or {})), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc
