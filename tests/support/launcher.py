"""The tests' process launcher: scripts/kiln/processes.py (scripts/train.py as a user starts it, a function on N
ranks) with its processes forked from a server that imported torch, transformers, diffusers and DeepSpeed once
(`preload()`, turned on by tests/conftest.py)."""

from __future__ import annotations

import atexit
import os
import runpy
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common.distributed import free_port
from scripts.kiln import processes
from scripts.kiln.processes import (  # noqa: F401  (the tests import them from here)
    DIST_VARS,
    REPO,
    TRAIN,
    _platform_start_method,
    launch_env,
    train_command,
)

# Preloaded processes, for the test suite. Most of a short CPU run's seconds go to importing torch,
# transformers, diffusers and DeepSpeed (a 1-step llm_tiny run: ~6 of ~10 s). After `preload()`,
# run_python (and run_train through it) and spawn_ranks fork their processes from multiprocessing's fork server,
# which imported those once: the same script or module as __main__, with the same arguments, working directory,
# environment and
# intra-op thread count, on one rank or as torchrun's N ranks (its RANK/WORLD_SIZE/MASTER_* variables; any
# failed rank ends the others, exit status 1 as torchrun's). Only third-party modules are preloaded: Kiln's
# own are imported fresh by each process (some read the environment at import). Tests of the launch itself
# (torchrun's restarts, signals, timeouts, import-time output) start real processes with subprocess.
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


def run_python(
    cmd: list[str], *, env: dict[str, str] | None = None, cwd: str | Path = REPO, timeout: float = 600
) -> subprocess.CompletedProcess:
    """A `python` command line run as `subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)` runs it: a script (`python scripts/x.py ARGS`), a module (`python -m data.x ARGS`), code
    (`python -c CODE`) or
    torchrun's N ranks of a script (`python -m torch.distributed.run --nproc_per_node=N --master_port=P
    script.py ARGS`, or Kiln's `python scripts/train.py --nproc_per_node N ARGS`). After preload() it is forked from
    the fork server; any other command line (another program, torchrun's own options) is a real process."""
    target = _python_target(cmd) if _PRELOADED and cmd[0] == sys.executable else None
    if target is None:
        return processes.run_python(cmd, env=env, cwd=cwd, timeout=timeout)
    nproc, kind, name, args = target
    return _run_preloaded(cmd, (kind, name, args, str(cwd)), nproc, dict(os.environ if env is None else env), timeout)


def python_ok(*cmd: str, timeout: float = 600) -> str:
    """`python CMD...` (run_python) that must succeed: its stdout, or the test fails with its stderr's tail."""
    proc = run_python([sys.executable, *cmd], timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def run_train(args: list[str], nproc: int = 1, **kw) -> subprocess.CompletedProcess:
    """scripts/kiln/processes.py's run_train, its command line run by run_python (forked preloaded after preload())."""
    return processes.run_train(args, nproc, runner=run_python, **kw)


def spawn_ranks(fn: Callable, args: tuple, world: int, out_dir: str | Path, threads: int = 1) -> list:
    """scripts/kiln/processes.py's spawn_ranks, its ranks forked from the fork server after preload()."""
    return processes.spawn_ranks(fn, args, world, out_dir, threads, "forkserver" if _PRELOADED else "spawn")


def _python_target(cmd: list[str]) -> tuple[int, str, str, list[str]] | None:
    """(ranks, "path" or "module", script or module, its arguments) of a command line run_python can fork."""
    if cmd[1:3] == ["-m", "torch.distributed.run"]:
        ranks = _rank_options(cmd, 3)
        if ranks is None:
            return None
        nproc, i = ranks
        return (nproc, "path", cmd[i], cmd[i + 1 :]) if cmd[i].endswith(".py") else None
    if cmd[1] in ("-m", "-c"):
        return 1, {"-m": "module", "-c": "code"}[cmd[1]], cmd[2], cmd[3:]
    if Path(cmd[1]).name == "train.py" and len(cmd) > 2 and cmd[2].startswith("--nproc"):
        # scripts/train.py --nproc_per_node N ARGS: Kiln's launcher starting N ranks of itself (scripts/kiln/launch.py)
        ranks = _rank_options(cmd, 2)
        return None if ranks is None else (ranks[0], "path", cmd[1], cmd[ranks[1] :])
    return (1, "path", cmd[1], cmd[2:]) if cmd[1].endswith(".py") else None


def _rank_options(cmd: list[str], i: int) -> tuple[int, int] | None:
    """(ranks, index of what follows) for torchrun's options at cmd[i:] that a fork can stand for (the rank count
    and a port); None for any other (restarts, rendezvous, ...: torchrun itself runs them)."""
    nproc = 1
    while i < len(cmd) and cmd[i].startswith("--"):
        flag, _, value = cmd[i].partition("=")
        if flag not in ("--nproc_per_node", "--nproc-per-node", "--master_port", "--master-port"):
            return None
        if not value:
            i, value = i + 1, cmd[i + 1]
        if flag.startswith("--nproc"):
            nproc = int(value)
        i += 1
    return nproc, i


def _run_preloaded(
    cmd: list[str], target: tuple[str, str, list[str], str], nproc: int, env: dict[str, str], timeout: float
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
                rank_env.setdefault("OMP_NUM_THREADS", "1")
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
            p = ctx.Process(target=_python_main, args=(target, rank_env, str(out), str(err)), daemon=False)
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


def _python_main(target: tuple[str, str, list[str], str], env: dict[str, str], out: str, err: str) -> None:
    """`python SCRIPT ARGS`, `python -m MODULE ARGS` or `python -c CODE ARGS` in a forked process: its exit status
    as Python's."""
    kind, name, args, cwd = target
    _platform_start_method()
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # TMPDIR as this process's environment has it (the server may have cached its own)
    os.chdir(cwd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for path, fd in ((out, 1), (err, 2)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
    import torch

    if "OMP_NUM_THREADS" in env:  # as the OpenMP runtime reads it at a process's start
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = ["-c" if kind == "code" else name, *args]
    # What the interpreter puts first on sys.path: the script's folder, or the working directory for -m and -c.
    sys.path.insert(0, str(Path(name).resolve().parent) if kind == "path" else os.getcwd())
    code = 0
    try:
        if kind == "path":
            runpy.run_path(name, run_name="__main__")
        elif kind == "module":
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            exec(compile(name, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
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
