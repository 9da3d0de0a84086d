"""scripts/train.py in a subprocess, started as a user starts it (python, or torchrun for N ranks), and a function
on N in-process ranks: what the benchmarks start. The tests' launcher (tests/support/launcher.py) is this one with a
fork server that imported the heavy third-party modules once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from common.distributed import free_port

REPO = Path(__file__).resolve().parents[2]  # scripts/kiln/processes.py
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
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        *torchrun_args,
        TRAIN,
        *args,
    ]


def run_train(
    args: list[str],
    nproc: int = 1,
    *,
    timeout: float = 600,
    check: bool = True,
    threads: int | None = None,
    env: dict[str, str] | None = None,
    runner: Callable[..., subprocess.CompletedProcess] | None = None,
) -> subprocess.CompletedProcess:
    """Run a training job to its end; `check`: raise with its output's tail if it exits non-zero. `runner` runs the
    command line (run_python's signature; the tests hand in their preloaded one)."""
    cmd = train_command(args, nproc)
    proc = (runner or run_python)(cmd, env=launch_env(nproc, threads, **(env or {})), timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def spawn_ranks(
    fn: Callable, args: tuple, world: int, out_dir: str | Path, threads: int = 1, start_method: str = "spawn"
) -> list:
    """``fn(*args)`` on ``world`` ranks of one process group (gloo on CPU), started with
    torch.multiprocessing.spawn: for tests and benchmarks that drive the recipes' parts in-process.
    ``fn`` must be importable (module level); its JSON-able results come back by rank."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _rank_main,
        args=(world, free_port(), fn, args, str(out_dir), threads),
        nprocs=world,
        start_method=start_method,
    )
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world)]


def _rank_main(rank: int, world: int, port: int, fn: Callable, args: tuple, out_dir: str, threads: int) -> None:
    import torch

    _platform_start_method()
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(threads)
    from common.distributed import init_distributed, teardown

    init_distributed()
    try:
        result = fn(*args)
    finally:
        teardown()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def run_python(
    cmd: list[str], *, env: dict[str, str] | None = None, cwd: str | Path = REPO, timeout: float = 600
) -> subprocess.CompletedProcess:
    """A command line run to its end, its output captured as text."""
    env = dict(os.environ if env is None else env)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _platform_start_method() -> None:
    """A process started by the fork server has it as its default start method; a process of its own has the
    platform's (fork on Linux), which its DataLoader workers then use."""
    import multiprocessing as mp

    if mp.get_start_method(allow_none=True) == "forkserver":
        mp.set_start_method(None, force=True)
