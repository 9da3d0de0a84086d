"""The one training step and the one loop under every recipe: `Trainer.train_step` and `Trainer.fit`.

Why a base class that owns the step and the loop, rather than one in each trainer: the subtle parts
of a step -- accumulation, the loss's normalisation, clipping, stepping, the skip decision, the host
read -- and what happens around it -- stop signals and the ranks' agreement on them, skipped
non-finite steps, checkpoint cadence, FLOPs and MFU, metrics, the profiler, the heartbeat that names a
hung rank, fault injection for the tests -- must not differ between recipes, and three copies drifted.
The engine (common/engine.py: DeepSpeed or PyTorch-native) runs backward, the optimizer and
checkpoints of the model and optimizer. What a recipe supplies:

    self.engine, self.state (`start`)   its model, parallelized, in an engine; its loader
    count(batch) -> int                 what the batch's loss is summed over: labelled tokens or samples
    loss(batch) -> Tensor               the forward: the loss summed over those tokens or samples
    tally(batch) -> dict                host counts logged per step (samples, tokens, packed slots, ...)
    prepare(batch)                      host work on a loader's batch (the LLM packs its share); optional
    prepare_step(batches)               the same on the step's micro-batches together; optional
    after_first_step(), after_step()    hooks; no-ops unless the recipe overrides them
    export() -> Path                    the servable artifact; after training, scripts/kiln/launch.py:run_recipe calls
                                        after_fit(), evaluate() + eval_summary(result), export(), after_export(out)

The logged loss, and the loss whose gradient the optimizer follows, is one definition for every
recipe: the sum over the global batch (every micro-batch on every data-parallel rank) divided by its
count. A recipe's trainer reads top to bottom: setup in __init__ (data, model, engine, `start`), the
loss, then evaluation/export. Benchmarks drive the same seams (`fit(batches=...)`, `train_step`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as tdist

from common import faults
from common.checkpoint import CheckpointManager, read_meta
from common.config import TrainConfig
from common.distributed import DistInfo, heartbeat
from common.engine import Engine
from common.errors import ConfigError, UserError
from common.metrics import MetricsLogger
from common.parallel_dims import ParallelDims
from common.profiling import StepTimer, maybe_profile
from common.seed import rng_state, seed_everything, set_rng_state

Scalar = float | int | torch.Tensor


@dataclasses.dataclass
class StepStats:
    """What one optimizer step reports, the same on every rank (sums over the global batch).

    Values may stay device tensors: the loop reads them (one copy to the host) on logging steps only,
    so a GPU step waits for the host once, in `Trainer.read_once`. `skipped`: the step left the
    weights untouched (a non-finite gradient norm); `signum`: the stop signal the ranks agreed on.
    """

    loss: Scalar
    grad_norm: Scalar
    lr: float
    samples: Scalar = 0  # global samples this step -> samples_per_s
    tokens: Scalar = 0  # global real (non-padding) tokens this step -> tokens_per_s
    token_utilization: Scalar | None = None  # packed rows: real tokens / token slots
    corrupt_shards: int | None = None  # distinct corrupt shards skipped so far (this rank)
    counts: dict[str, Scalar] = dataclasses.field(default_factory=dict)  # recipe-specific per-step counts, logged as is
    losses: dict[str, Scalar] = dataclasses.field(default_factory=dict)  # recipe-specific loss terms (global means)
    metrics: dict[str, Scalar] = dataclasses.field(default_factory=dict)  # recipe-specific global values, logged as is
    skipped: bool = False
    signum: int = 0

    @functools.cached_property
    def values(self) -> dict[str, float]:
        """The tensor fields (and counts) as Python numbers, in one device-to-host copy."""
        fields = {k: getattr(self, k) for k in ("loss", "grad_norm", "samples", "tokens", "token_utilization")}
        fields |= {f"counts.{k}": v for k, v in self.counts.items()}
        fields |= {f"losses.{k}": v for k, v in self.losses.items()}
        fields |= {f"metrics.{k}": v for k, v in self.metrics.items()}
        tensors = {k: v.detach().double().reshape(()) for k, v in fields.items() if isinstance(v, torch.Tensor)}
        if tensors:
            device = next(iter(tensors.values())).device
            fields.update(zip(tensors, torch.stack([t.to(device) for t in tensors.values()]).tolist()))
        return fields

    @property
    def work(self) -> float:
        """What a step's FLOPs scale with: token slots of packed rows (they vary per step), else 1."""
        v = self.values
        return v["tokens"] / v["token_utilization"] if v["token_utilization"] else 1.0

    def record(self, step_time: float) -> dict[str, Any]:
        """The metrics.jsonl fields: counts become rates, unset optional fields are left out."""
        v = self.values
        out: dict[str, Any] = {"loss": v["loss"], "lr": self.lr, "grad_norm": v["grad_norm"]}
        if v["samples"]:
            out["samples_per_s"] = v["samples"] / step_time
        if v["tokens"]:
            out["tokens_per_s"] = v["tokens"] / step_time
        if v["token_utilization"] is not None:
            out["token_utilization"] = v["token_utilization"]
        if self.corrupt_shards is not None:
            out["corrupt_shards"] = self.corrupt_shards
        return (
            out
            | {k: round(v[f"counts.{k}"]) for k in self.counts}
            | {k: v[f"losses.{k}"] for k in self.losses}
            | {k: v[f"metrics.{k}"] for k in self.metrics}
        )


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class TrainState:
    """The step counter and everything a resume restores besides the model and optimizer (which the
    engine -- DeepSpeed or DCP -- saves itself): the data position, the recipe's extras (an EMA, an LR
    scheduler), and the RNG streams when the recipe draws from them per rank.

    `state_dict()` is the same on every rank (one global data stream; extras whole, gathered if need be:
    it may be collective) and a checkpoint stores rank 0's copy; `rng` streams are per rank, stored per
    rank. `load_state_dict` puts them back, so a resumed run continues bit for bit.
    """

    def __init__(self, loader, *, rng: bool = True, extras: dict[str, Stateful] | None = None):
        self.step = 0
        self.loader = loader
        self.rng = rng
        self.extras = extras or {}

    def state_dict(self) -> dict:
        state = {"step": self.step, "data": self.loader.state_dict()}
        return state | {name: part.state_dict() for name, part in self.extras.items()}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.loader.load_state_dict(state["data"])
        for name, part in self.extras.items():
            part.load_state_dict(state[name])


class Stopped(Exception):
    """The run stopped early after writing a checkpoint; `exit_code` is what the process returns."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class TooManyBadSteps(UserError):
    pass


class Trainer(ABC):
    """Base of every recipe's trainer. Subclasses set `self.engine` and call `self.start(loader, ...)` in __init__.

    `dims`: the run's layout (common/parallel_dims.py), checked against the job's ranks when its config was composed
    and handed down by scripts/kiln/launch.py; built here from parallel.* only for a trainer constructed directly
    (tests, benchmarks). A recipe builds its mesh and cp groups from `self.dims`, never from parallel.* again."""

    state: TrainState
    engine: Engine

    def __init__(self, cfg: TrainConfig, dist: DistInfo, run_dir: Path, dims: ParallelDims | None = None):
        self.cfg, self.dist, self.run_dir = cfg, dist, run_dir
        self.dims = dims if dims is not None else ParallelDims.from_config(cfg.parallel, dist.world_size)
        self.device = dist.device
        self.ckpt = CheckpointManager(run_dir, cfg.checkpoint.keep, dist, async_save=cfg.checkpoint.async_save)
        self.resume_from = self.ckpt.resolve_resume(cfg.run.resume)  # None: a fresh run

    def start(self, loader, *, per_rank_rng: bool, extras: dict[str, Stateful] | None = None) -> None:
        """Seed the step's random streams, build `self.state`, resume when there is a checkpoint.

        `per_rank_rng`: the recipe draws random numbers per rank in its steps (dropout); each rank then has
        its own stream, saved per rank (and started afresh under another number of ranks). The rest of the
        state is the same on every rank (one global data stream), and rank 0's copy resumes any layout."""
        seed_everything(self.cfg.trainer.seed + 1 + (self.dist.rank if per_rank_rng else 0))
        self.state = TrainState(loader, rng=per_rank_rng, extras={**self.engine.extras, **(extras or {})})
        self.engine.scratch = self.ckpt.root / ".tmp"  # removed at start-up and after each save
        if self.resume_from is not None:
            self.load_checkpoint(self.resume_from)

    # ---- what a recipe implements --------------------------------------------------------------
    def prepare(self, batch):
        """Host-side work on one of the loader's batches before the step uses it (default: none)."""
        return batch

    def prepare_step(self, batches: list) -> list:
        """The step's `trainer.grad_accum` loader batches prepared together, before any forward (default: `prepare`
        on each). A recipe whose host work spans the step overrides it (GRPO generates once a step)."""
        return [self.prepare(b) for b in batches]

    @abstractmethod
    def count(self, batch) -> int:
        """What `loss(batch)` is summed over on this rank (labelled tokens or samples): a host number."""

    @abstractmethod
    def loss(self, batch) -> torch.Tensor:
        """The forward of one micro-batch: its loss summed over `count(batch)` tokens or samples."""

    def forward_backward(self, batch, inv_count: torch.Tensor, last: bool, timer: StepTimer) -> torch.Tensor:
        """One micro-batch's forward and backward: the engine's, on `loss(batch)` (common/engine.py). A recipe whose
        schedule runs both itself (the LLM's pipeline) overrides it, so the engine never gets a loss it won't call."""
        return self.engine.forward_backward(self.loss, batch, inv_count, last, timer)

    def loss_terms(self) -> dict[str, torch.Tensor]:
        """Named terms of the step's loss to log on their own (e.g. an MoE's auxiliary losses): device scalars
        summed over this rank's micro-batches like `loss(batch)`, so that the step divides them by the same
        global count; the recipe resets them here for the next step. Default: none."""
        return {}

    def step_metrics(self) -> dict[str, torch.Tensor]:
        """Named values of the step to log as they are (already global, e.g. an MoE's per-layer expert load):
        device scalars, read only on logging steps; the recipe resets its accumulators here. Default: none."""
        return {}

    def tally(self, batch) -> dict[str, int]:
        """Host counts of one micro-batch, summed over the global batch and logged: `samples`, `tokens`
        (real ones), `slots` (packed token slots: token_utilization = tokens / slots), and any other
        name as a count of its own."""
        return {}

    def checkpoint_meta(self) -> dict:
        """What the recipe records in a checkpoint's meta.json besides the recipe and the layout."""
        return {}

    def after_first_step(self) -> None:
        """Runs once after the first step of this process (e.g. measure the optimizer's state)."""

    def after_step(self) -> None:
        """Runs after every step that was not skipped (e.g. an EMA update, sample grids)."""

    # ---- what the run does after training (scripts/kiln/launch.py: run_recipe) ------------------------------
    def after_fit(self) -> None:
        """Runs once training ends, before evaluation (e.g. the final sample grid, a summary line)."""

    def evaluate(self) -> dict | None:
        """The held-out evaluation after training (trainer.eval): its result on rank 0, else None. Default: none."""
        return None

    def eval_summary(self, result: dict) -> str:
        """The line rank 0 prints for `evaluate`'s result."""
        return f"kiln: eval {result}"

    @abstractmethod
    def export(self) -> Path:
        """Collective: write the servable artifact to RUN_DIR/export; returns it."""

    def after_export(self, out: Path) -> None:
        """Runs on rank 0 after `export` (e.g. a sample generation from the exported folder)."""

    # ---- one optimizer step ----------------------------------------------------------------------
    def train_step(self, batches: Iterator, timer: StepTimer) -> StepStats:
        """One optimizer step over `trainer.grad_accum` micro-batches drawn from `batches`."""
        accum = self.cfg.trainer.grad_accum
        with timer.phase("data_wait"):
            micro = self.prepare_step([next(batches) for _ in range(accum)])
        tally: dict[str, float] = {}
        for batch in micro:
            for name, n in self.tally(batch).items():
                tally[name] = tally.get(name, 0) + n
        # The loss's global denominator (known before any forward: torchtitan's global valid tokens) and
        # the step's tallies: one all-reduce on the device, not read.
        totals = self.engine.all_reduce(on_device([sum(self.count(b) for b in micro), *tally.values()], self.device))
        inv_count = 1.0 / totals[0].clamp(min=1)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, batch in enumerate(micro):
            loss_sum += self.forward_backward(batch, inv_count, i == accum - 1, timer)
        with timer.phase("optimizer"):
            grad_norm = self.engine.clip_grad_norm()
            if grad_norm is not None:  # the host decides before the step
                skipped, signum = self.read_once(grad_norm)
                self.engine.step(skip=skipped)
            else:  # the optimizer checks its norm in its step (DeepSpeed's overflow check): the read reports it
                grad_norm = self.engine.step()
                skipped, signum = self.read_once(grad_norm)
        loss = self.engine.all_reduce(loss_sum, loss=True) * inv_count  # left on the device
        terms = self.loss_terms()
        if terms:  # one all-reduce for all of them, left on the device
            summed = self.engine.all_reduce(torch.stack([t.detach().double() for t in terms.values()]), loss=True)
            terms = dict(zip(terms, summed * inv_count))
        counts = dict(zip(tally, totals[1:]))
        samples, tokens, slots = (counts.pop(name, None) for name in ("samples", "tokens", "slots"))
        return StepStats(
            loss=loss,
            grad_norm=grad_norm,
            lr=self.engine.lr,
            samples=0 if samples is None else samples,
            tokens=0 if tokens is None else tokens,
            token_utilization=None if slots is None else tokens / slots.clamp(min=1),
            corrupt_shards=getattr(self.state.loader, "corrupt_shards", None),
            counts=counts,
            losses=terms,
            metrics=self.step_metrics(),
            skipped=skipped,
            signum=signum,
        )

    def read_once(self, grad_norm: Scalar) -> tuple[bool, int]:
        """(skip this step, the stop signal the ranks agree on), in the step's one device-to-host copy:
        a GPU step waits for the host here and nowhere else. The norm is global, so every rank decides alike."""
        finite = torch.isfinite(torch.as_tensor(grad_norm)).double().reshape(1)
        stop = STOP_SIGNALS.pending(self.dist)
        if stop is None:
            return not bool(finite), STOP_SIGNALS.received
        ok, signum = torch.cat([finite.to(stop.device), stop]).tolist()
        return not ok, int(signum)

    # ---- checkpoints: the engine's state + the TrainState ------------------------------------------
    def save_checkpoint(self) -> None:
        """Collective: the engine's model and optimizer, and the TrainState (per rank when its RNG
        streams are per rank, else rank 0's), atomically (common/checkpoint.py). With checkpoint.async_save
        the engine's share is written in the background and committed later (`self.ckpt.poll`/`wait`)."""

        def write(tmp: Path):
            # The TrainState first: an async engine save is complete only after every rank's other files are.
            state = self.state.state_dict()  # on every rank: an extra may gather (collective)
            if self.dist.is_main:
                torch.save(state, tmp / "trainer.pt")
            if self.state.rng:
                torch.save({"rng": rng_state()}, tmp / f"rank{self.dist.rank:05d}.pt")
            if self.ckpt.async_save:
                return self.engine.save_async(tmp, self.ckpt.async_group())
            self.engine.save(tmp)
            return None

        meta = {"recipe": self.cfg.recipe.name, **self.engine.layout(), **self.checkpoint_meta()}
        self.ckpt.save(self.state.step, write, meta=meta)

    def load_checkpoint(self, path: Path) -> None:
        saved = read_meta(path)
        if saved.get("recipe") != self.cfg.recipe.name:
            raise ConfigError(
                f"run.resume: {path} is a checkpoint of recipe {saved.get('recipe')}; this run is "
                f"{self.cfg.recipe.name}"
            )
        self.engine.load(path)
        self.state.load_state_dict(torch.load(path / "trainer.pt", weights_only=False))
        if self.state.rng:
            mine = path / f"rank{self.dist.rank:05d}.pt"
            if saved["world_size"] == self.dist.world_size and mine.exists():
                set_rng_state(torch.load(mine, weights_only=False)["rng"])
            else:  # another number of ranks: each rank's stream starts afresh, keyed by the step
                seed_everything(self.cfg.trainer.seed + 1 + self.dist.rank + 1_000_003 * self.state.step)
                if self.dist.is_main:
                    print(
                        f"kiln: {path} was written by {saved['world_size']} ranks: the per-rank random streams "
                        "(dropout) start afresh; the rest resumes exactly",
                        flush=True,
                    )
        if self.dist.is_main:
            print(f"kiln: resumed from {path} at step {self.state.step}", flush=True)

    # ---- the loop ---------------------------------------------------------------------------
    def fit(self, batches: Iterable | None = None) -> None:
        """Train from `self.state.step` to `trainer.max_steps`. `batches` defaults to the state's
        loader; a benchmark passes batches it holds in memory."""
        cfg, t, state = self.cfg, self.cfg.trainer, self.state
        batches = iter(state.loader if batches is None else batches)
        metrics = MetricsLogger(
            self.run_dir, self.dist, max_steps=t.max_steps, start_step=state.step, progress_bar=t.progress_bar
        )
        timer = StepTimer()
        start_step = state.step
        flops = StepFlops(cfg, self.dist, metrics, self.run_dir, fresh=start_step == 0)
        bad_in_row, bad_total, saved_at = 0, 0, None
        try:
            with maybe_profile(cfg.profile, self.run_dir, self.dist.rank) as prof:
                while state.step < t.max_steps:
                    step = state.step + 1  # the step being computed, 1-based as logged
                    heartbeat(step)
                    faults.before_step(step)
                    log_now = step % t.log_every == 0 or step == t.max_steps
                    timer.enabled = log_now or cfg.profile.enabled
                    first = state.step == start_step
                    start = time.perf_counter()
                    with flops.counter(first) as counter, faults.poisoned_losses(step):
                        stats = self.train_step(batches, timer)
                    step_time = time.perf_counter() - start
                    phases = timer.pop()
                    flops.counted(counter, stats)
                    state.step = step
                    prof.step()
                    metrics.advance()
                    bad, signum = stats.skipped, stats.signum  # read once, in train_step
                    bad_in_row, bad_total = (bad_in_row + 1 if bad else 0), bad_total + bad
                    if first:
                        self.after_first_step()
                    if log_now or bad:
                        rates = {} if first else flops.rates(stats, step_time)  # counting slows its step
                        record = {
                            **stats.record(step_time),
                            "skipped_steps": bad_total,
                            **rates,
                            "step_time_s": step_time,
                            "data_wait_s": phases.pop("data_wait_s", 0.0),
                            **phases,
                        }
                        metrics.log(step, record)
                    if t.max_bad_steps and bad_in_row >= t.max_bad_steps:
                        # Skipped steps never touched the weights: this checkpoint holds the last good ones.
                        self.save_checkpoint()
                        self.ckpt.wait()
                        raise TooManyBadSteps(
                            f"{bad_in_row} steps in a row had a non-finite loss or gradient (steps "
                            f"{step - bad_in_row + 1}-{step}, trainer.max_bad_steps={t.max_bad_steps}); "
                            f"stopped with the weights of step {step - bad_in_row} saved as checkpoint step "
                            f"{step} in {self.run_dir}/checkpoints"
                        )
                    if not bad:
                        self.after_step()
                    self.ckpt.poll()  # an async save whose write is done everywhere becomes `latest`
                    if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                        self.save_checkpoint()
                        saved_at = step
                    if signum:
                        if saved_at != step:
                            self.save_checkpoint()
                        self.ckpt.wait()
                        raise STOP_SIGNALS.stop(signum, step, self.run_dir, self.dist)
            if cfg.checkpoint.final:
                self.save_checkpoint()
            self.ckpt.wait()
        finally:
            state.loader.close()
            metrics.close()


def on_device(values: list[float], device: torch.device) -> torch.Tensor:
    """Host numbers as one float64 device tensor, copied without waiting (pinned memory on CUDA)."""
    host = torch.tensor([float(v) for v in values], dtype=torch.float64, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


class StepFlops:
    """FLOPs per step counted once, on a fresh run's first step (common/flops.py: counting
    dispatches every op through Python), then achieved TFLOP/s per device and MFU per logged step.

    Counting can change the last bits of that step's gradients (ops dispatch differently under
    the counting mode), so a resumed run does not count again, which would break bitwise resume:
    it reads the count from run.dir/flops.json. Packed LLM/VLM steps vary in rows: their work
    scales with token slots (`StepStats.work`).
    """

    def __init__(self, cfg: TrainConfig, dist: DistInfo, metrics: MetricsLogger, run_dir, fresh: bool):
        from common.flops import peak_flops, precision_key

        self.enabled, self.world, self.fresh = cfg.profile.count_flops, dist.world_size, fresh
        self.path, self.is_main = Path(run_dir) / "flops.json", dist.is_main
        self.flops = self.work = self.peak = None
        if self.enabled and not fresh and self.path.exists():
            saved = json.loads(self.path.read_text())
            self.flops, self.work = saved["flops_per_step"], saved["work"]
        if self.enabled:
            try:
                self.peak = peak_flops(dist.device, precision_key(cfg.toggles), cfg.profile.peak_tflops * 1e12 or None)
            except ValueError as exc:  # an unknown GPU: no MFU rather than a wrong one
                metrics.write(f"kiln: no MFU ({exc}; set profile.peak_tflops)")

    def counter(self, first_step: bool):
        from common.flops import FlopCounter

        return FlopCounter() if self.enabled and self.fresh and first_step else contextlib.nullcontext()

    def counted(self, counter, stats: StepStats) -> None:
        if counter is None:
            return
        self.flops, self.work = counter.global_flops(), stats.work  # collective
        if self.is_main:
            self.path.write_text(json.dumps({"flops_per_step": self.flops, "work": self.work}))

    def rates(self, stats: StepStats, step_time: float) -> dict:
        from common.flops import mfu

        if not self.flops:
            return {}
        flops = self.flops * stats.work / self.work
        out = {"flops_per_step": flops, "achieved_tflops": flops / step_time / self.world / 1e12}
        if self.peak:
            out["mfu"] = mfu(flops, step_time, self.peak, self.world)
        return out


class StopSignals:
    """SIGTERM / SIGUSR1 (SLURM preemption and time-limit warnings; torchrun forwards them):
    finish the step, checkpoint, exit. Installed by the launcher before the run is set up, so an
    early signal is not lost. Ranks may get the signal at different steps, so they agree through
    an all-reduce after each step (read with the step's finite check) and all stop after the same one."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received = 0

    def install(self) -> None:
        for s in self.SIGNALS:
            signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def pending(self, dist: DistInfo) -> torch.Tensor | None:
        """Multi-rank: the largest signal any rank received, all-reduced on the device and not read
        (`Trainer.read_once` reads it with the step's finite check). One rank: None, `received` is the answer."""
        if dist.world_size == 1:
            return None
        flag = torch.tensor([float(self.received)], dtype=torch.float64, device=dist.device)
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
        return flag

    def stop(self, signum: int, step: int, run_dir, dist: DistInfo) -> Stopped:
        """Say so (before a requeue can kill the job), requeue on SLURM's time-limit warning."""
        name = signal.Signals(signum).name
        job = os.environ.get("SLURM_JOB_ID")
        if dist.is_main:
            print(
                f"kiln: {name} received: stopped after step {step} with a checkpoint in {run_dir}/checkpoints; "
                "run.resume=auto continues from it",
                flush=True,
            )
            if signum == signal.SIGUSR1 and job:
                # #SBATCH --signal=USR1@...: put the job back in the queue; it restarts with the same
                # job id, hence the same run.dir, and resumes from this checkpoint.
                print(f"kiln: requeueing SLURM job {job}", flush=True)
                done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
                if done.returncode:
                    print(f"kiln: scontrol requeue {job} failed: {done.stderr.strip()}", flush=True)
        return Stopped(f"stopped by {name}", 128 + signum)


STOP_SIGNALS = StopSignals()
