"""scripts/train.py in a subprocess, started as a user starts it (python, or torchrun for N ranks): the one
launcher that tests and benchmarks share."""

from __future__ import annotations

import atexit
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
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
) -> subprocess.CompletedProcess:
    """Run a training job to its end; `check`: raise with its output's tail if it exits non-zero."""
    cmd = train_command(args, nproc)
    run_env = launch_env(nproc, threads, **(env or {}))
    if _PRELOADED:
        proc = _run_preloaded(cmd, args, nproc, run_env, timeout)
    else:
        proc = subprocess.run(cmd, cwd=REPO, env=run_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def spawn_ranks(fn: Callable, args: tuple, world: int, out_dir: str | Path, threads: int = 1) -> list:
    """``fn(*args)`` on ``world`` ranks of one process group (gloo on CPU), started with
    torch.multiprocessing.spawn: for tests and benchmarks that drive the recipes' parts in-process.
    ``fn`` must be importable (module level); its JSON-able results come back by rank."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _rank_main,
        args=(world, free_port(), fn, args, str(out_dir), threads),
        nprocs=world,
        start_method="forkserver" if _PRELOADED else "spawn",
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


# Preloaded processes, for the test suite. Most of a short CPU run's seconds go to importing torch,
# transformers, diffusers and DeepSpeed (a 1-step llm_tiny run: ~6 of ~10 s). After `preload()`,
# run_train and spawn_ranks fork their processes from multiprocessing's fork server, which imported those
# once: the same scripts/train.py as __main__, with the same arguments, working directory, environment and
# intra-op thread count, on one rank or as torchrun's N ranks (its RANK/WORLD_SIZE/MASTER_* variables; any
# failed rank ends the others, exit status 1 as torchrun's). Only third-party modules are preloaded: Kiln's
# own are imported fresh by each process (some read the environment at import). Tests of the launch itself
# (torchrun's restarts, signals, timeouts, import-time output) start real processes with train_command.
PRELOAD = (
    "numpy",
    "PIL.Image",
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "torch.nn.attention.varlen",
    "safetensors.torch",
    "tokenizers",
    "omegaconf",
    "hydra",
    "webdataset",
    "tqdm",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "diffusers",
    "deepspeed",
    "peft",
    "matplotlib.pyplot",
)
_PRELOADED = False


def preload() -> None:
    """Fork run_train's and spawn_ranks' processes from a server that imported PRELOAD (CPU only: a
    process forked after CUDA is initialised cannot use it)."""
    global _PRELOADED
    import multiprocessing as mp

    import torch

    if torch.cuda.is_available():
        return
    os.environ.setdefault("MPLBACKEND", "Agg")
    mp.set_forkserver_preload(list(PRELOAD))
    _PRELOADED = True


def _run_preloaded(
    cmd: list[str], args: list[str], nproc: int, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("forkserver")
    port = str(free_port())
    with tempfile.TemporaryDirectory(prefix="kiln-run-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        procs = []
        for rank in range(nproc):
            rank_env = dict(env)
            if nproc > 1:  # what torchrun gives each worker
                rank_env.update(
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(nproc),
                    GROUP_RANK="0",
                    LOCAL_WORLD_SIZE=str(nproc),
                    ROLE_RANK=str(rank),
                    ROLE_WORLD_SIZE=str(nproc),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=port,
                    TORCHELASTIC_RESTART_COUNT="0",
                    TORCHELASTIC_MAX_RESTARTS="0",
                )
            p = ctx.Process(target=_train_main, args=(args, rank_env, str(out), str(err)), daemon=False)
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout
        running = list(procs)
        while running and not any(p.exitcode for p in procs if p.exitcode is not None):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            wait([p.sentinel for p in running], timeout=left)
            running = [p for p in running if p.exitcode is None]
        timed_out = bool(running) and time.monotonic() >= deadline
        for p in running:  # a rank failed (torchrun ends the others) or the time is up
            p.kill()
            p.join()
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    codes = [p.exitcode for p in procs]
    code = codes[0] if nproc == 1 else next((1 for c in codes if c), 0)
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def _train_main(args: list[str], env: dict[str, str], out: str, err: str) -> None:
    """`python scripts/train.py ARGS` in a forked process: its exit status as Python's."""
    _platform_start_method()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for path, fd in ((out, 1), (err, 2)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # as the OpenMP runtime reads it at a process's start
    sys.argv = [TRAIN, *args]
    sys.path.insert(0, str(Path(TRAIN).parent))
    code = 0
    try:
        runpy.run_path(TRAIN, run_name="__main__")
    except SystemExit as e:
        code = _exit_status(e.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_status(code) -> int:
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _platform_start_method() -> None:
    """A process started by the fork server has it as its default start method; a process of its own has the
    platform's (fork on Linux), which its DataLoader workers then use."""
    import multiprocessing as mp

    if mp.get_start_method(allow_none=True) == "forkserver":
        mp.set_start_method(None, force=True)
