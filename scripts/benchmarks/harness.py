"""How sections run Kiln: a recipe's Trainer built in-process as scripts/train.py builds it, timed steps
interleaved over the same batches, and scripts/train.py as a subprocess (through scripts/kiln/processes.py,
as the tests start them). The bytes a forward keeps for backward: common/activations.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from recipes.registry import recipe_spec
from scripts.kiln.processes import run_train

# Only what a timing run needs: no evaluation, samples or checkpoints beyond the loop itself.
RUN_ARGS = [
    "trainer.progress_bar=false",
    "trainer.eval=false",
    "checkpoint.every=0",
    "checkpoint.final=false",
    "run.resume=never",
]
RECIPE_ARGS = {
    "dit_tiny": ["diffusion.sample_every=0", "diffusion.sample_steps=2", "diffusion.samples_per_class=1"],
    "vlm_tiny": [],
    "llm_tiny": [],
    "llm_tiny_grpo_demo": [],
    "moe_tiny": [],
    "t2i_tiny": ["diffusion.sample_every=0", "diffusion.sample_steps=2"],
    "video_tiny": ["diffusion.sample_every=0", "diffusion.sample_steps=2"],
}


@dataclass
class Options:
    """What every section is handed: the mode (--quick), intra-op threads per process, and where files go."""

    quick: bool
    threads: int
    out: Path

    @property
    def work(self) -> Path:
        """Run directories of the in-process trainers and the subprocess runs."""
        return self.out / "runs"

    @property
    def log(self) -> Path:
        """Everything the trainers and subprocesses print, kept out of the report."""
        return self.out / "bench.log"

    def pick(self, full, quick):
        return quick if self.quick else full


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


@contextlib.contextmanager
def quiet(log: Path):
    """Send this process's stdout/stderr (DeepSpeed, warnings, progress lines) to `log`, at the file
    descriptor level so C++ and already-configured logging handlers are caught too."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "a") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


# ---- subprocesses --------------------------------------------------------------------------------


def logged(opts: Options, cmd: list[str], proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Append a finished subprocess's output to the log; raise with its stderr's tail if it failed."""
    with open(opts.log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}\n")
    if proc.returncode:
        raise RuntimeError(f"`{' '.join(cmd[-6:])}` exited {proc.returncode}: {proc.stderr.strip()[-600:]}")
    return proc


def train_run(opts: Options, recipe: str, overrides: list[str], run_dir: Path, nproc: int = 1) -> list[dict]:
    """scripts/train.py (under torchrun for nproc > 1) in a subprocess; returns its metrics.jsonl."""
    from common.metrics import read_metrics

    fresh_dir(run_dir)
    args = [f"recipe={recipe}", *RUN_ARGS, *RECIPE_ARGS[recipe], *overrides, f"run.dir={run_dir}"]
    proc = run_train(args, nproc, timeout=900, check=False, threads=opts.threads)
    logged(opts, proc.args, proc)
    return read_metrics(run_dir / "metrics.jsonl")


# ---- trainers in this process ----------------------------------------------------------------------

_DIST = None


def distributed():
    """This process as a group of one (the recipes' trainers want a process group, as under train.py)."""
    global _DIST
    if _DIST is None:
        from common.distributed import init_distributed

        _DIST = init_distributed()
    return _DIST


def build_trainer(opts: Options, recipe: str, overrides: list[str], run_dir: Path, cls: type | None = None):
    """The recipe's own Trainer (or `cls`, a subclass of it), built as scripts/train.py builds it: config,
    toggles, parallelize."""
    from common.toggles import apply_global_toggles
    from scripts.kiln.launch import compose

    cfg = compose([f"recipe={recipe}", *RUN_ARGS, *overrides, f"run.dir={run_dir}"])
    apply_global_toggles(cfg.toggles)
    family = cfg.recipe.family
    cls = cls or recipe_spec(family).train().TRAINER
    fresh_dir(run_dir)
    with quiet(opts.log):
        return cls(cfg, distributed(), run_dir)


def take(trainer, n: int) -> list:
    """The first n batches of the trainer's loader, in memory (then its workers stop)."""
    it = iter(trainer.state.loader)
    batches = [next(it) for _ in range(n)]
    trainer.state.loader.close()
    return batches


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_step(trainer, batch, timer):
    """(seconds, StepStats, CUDA bytes allocated above the step's start at its peak) of one train_step
    on `batch`, advancing the trainer's step counter as Kiln's loop does."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    stats = trainer.train_step(iter([batch]), timer)
    sync()
    seconds = time.perf_counter() - start
    trainer.state.step += 1
    return seconds, stats, (torch.cuda.max_memory_allocated() - base) if cuda else None


def step_timer():
    """A StepTimer as a non-logging step of the loop has it: phase timing off."""
    from common.profiling import StepTimer

    timer = StepTimer()
    timer.enabled = False
    return timer


def interleaved(trainers: dict, batches: list | dict[str, list], warmup: int, own_rng: bool = False) -> dict[str, dict]:
    """Every trainer runs a step on batch i before any runs batch i+1, in an order that rotates each
    step, so machine noise (other jobs on the cores) lands on all of them alike. Per trainer: step
    times, StepStats and CUDA step peaks after `warmup` steps.

    `batches`: one list for all, or a list per trainer (name -> its own copy of batch i, e.g. the same
    images as raw pixels for one and as cached latents for another). `own_rng`: each trainer keeps its
    own RNG stream (the process-global one, swapped in and out around its steps), so all of them draw
    the same noise and timesteps at step i, as separate runs with one seed would."""
    from common.seed import rng_state, set_rng_state

    timer = step_timer()
    names = list(trainers)
    per_trainer = batches if isinstance(batches, dict) else {n: batches for n in names}
    out = {n: {"times": [], "stats": [], "peaks": []} for n in names}
    start_rng = rng_state() if own_rng else None
    streams = {n: start_rng for n in names}
    for i in range(len(per_trainer[names[0]])):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            if own_rng:
                set_rng_state(streams[name])
            seconds, stats, peak = timed_step(trainers[name], per_trainer[name][i], timer)
            if own_rng:
                streams[name] = rng_state()
            if i >= warmup:
                out[name]["times"].append(seconds)
                out[name]["stats"].append(stats)
                out[name]["peaks"].append(peak)
    return out


def model_tensors(model) -> list:
    return [*model.parameters(), *model.buffers()]
