"""The step loop every recipe runs: timing, metrics, profiling, checkpoint cadence, and the
fault handling that must not differ between recipes (stop signals, non-finite steps).

A recipe's Trainer supplies the parts that differ (its `train_step`, what to do after a
step); this function owns the rest.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as tdist

from common import faults
from common.config import TrainConfig
from common.distributed import DistInfo, heartbeat
from common.errors import UserError
from common.metrics import MetricsLogger
from common.profiling import StepTimer, maybe_profile


class LoopTrainer(Protocol):
    cfg: TrainConfig
    dist: DistInfo
    run_dir: object
    step: int
    loader: object  # common/data/webdataset.ResumableLoader; the loop sets `batches = iter(loader)`

    def train_step(self, timer: StepTimer) -> dict:
        """One optimizer step. Returns loggable stats; `samples` / `tokens` (global counts this
        step) become samples_per_s / tokens_per_s. A non-finite `loss` or `grad_norm` (the same
        on every rank) means the recipe left the weights untouched: the loop counts it."""

    def save_checkpoint(self) -> None: ...

    # Optional hooks: after_first_step() (e.g. measure optimizer state), after_step() (e.g. samples).


class Stopped(Exception):
    """The run stopped early after writing a checkpoint; `exit_code` is what the process returns."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class TooManyBadSteps(UserError):
    pass


def run_training_loop(trainer: LoopTrainer) -> None:
    cfg, t = trainer.cfg, trainer.cfg.trainer
    metrics = MetricsLogger(trainer.run_dir, trainer.dist, max_steps=t.max_steps, start_step=trainer.step,
                            progress_bar=t.progress_bar)
    timer = StepTimer()
    start_step = trainer.step
    trainer.batches = iter(trainer.loader)
    after_first_step = getattr(trainer, "after_first_step", lambda: None)
    after_step = getattr(trainer, "after_step", lambda: None)
    flops = StepFlops(cfg, trainer.dist, metrics, trainer.run_dir, fresh=start_step == 0)
    bad_in_row, bad_total, saved_at = 0, 0, None
    try:
        with maybe_profile(cfg.profile, trainer.run_dir, trainer.dist.rank) as prof:
            while trainer.step < t.max_steps:
                heartbeat(trainer.step + 1)
                faults.before_step(trainer.step + 1)
                log_now = (trainer.step + 1) % t.log_every == 0 or trainer.step + 1 == t.max_steps
                timer.enabled = log_now or cfg.profile.enabled
                first = trainer.step == start_step
                start = time.perf_counter()
                with flops.counter(first) as counter:
                    stats = trainer.train_step(timer)
                step_time = time.perf_counter() - start
                phases = timer.pop()
                flops.counted(counter, stats)
                trainer.step += 1
                prof.step()
                metrics.advance()
                bad = not (math.isfinite(stats.get("loss", 0.0)) and math.isfinite(stats.get("grad_norm", 0.0)))
                bad_in_row, bad_total = (bad_in_row + 1 if bad else 0), bad_total + bad
                if trainer.step == start_step + 1:
                    after_first_step()
                if log_now or bad:
                    rates = {} if first else flops.rates(stats, step_time)  # counting slows its step
                    metrics.log(trainer.step, step_record({**stats, "skipped_steps": bad_total, **rates}, step_time, phases))
                if t.max_bad_steps and bad_in_row >= t.max_bad_steps:
                    # Skipped steps never touched the weights: this checkpoint holds the last good ones.
                    trainer.save_checkpoint()
                    raise TooManyBadSteps(
                        f"{bad_in_row} steps in a row had a non-finite loss or gradient (steps "
                        f"{trainer.step - bad_in_row + 1}-{trainer.step}, trainer.max_bad_steps={t.max_bad_steps}); "
                        f"stopped with the weights of step {trainer.step - bad_in_row} saved as checkpoint step "
                        f"{trainer.step} in {trainer.run_dir}/checkpoints")
                if not bad:
                    after_step()
                if cfg.checkpoint.every and trainer.step % cfg.checkpoint.every == 0:
                    trainer.save_checkpoint()
                    saved_at = trainer.step
                signum = STOP_SIGNALS.agreed(trainer.dist)
                if signum:
                    if saved_at != trainer.step:
                        trainer.save_checkpoint()
                    raise STOP_SIGNALS.stop(signum, trainer.step, trainer.run_dir, trainer.dist)
        if cfg.checkpoint.final:
            trainer.save_checkpoint()
    finally:
        trainer.loader.close()
        metrics.close()


class StepFlops:
    """FLOPs per step counted once, on a fresh run's first step (common/flops.py: counting
    dispatches every op through Python), then achieved TFLOP/s per device and MFU per logged step.

    Counting can change the last bits of that step's gradients (ops dispatch differently under
    the counting mode), so a resumed run does not count again, which would break bitwise resume:
    it reads the count from run.dir/flops.json. Packed LLM/VLM steps vary in rows: their work
    scales with token slots (tokens over utilization).
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

    @staticmethod
    def _work(stats: dict) -> float:
        return stats["tokens"] / stats["token_utilization"] if stats.get("token_utilization") else 1.0

    def counted(self, counter, stats: dict) -> None:
        if counter is None:
            return
        self.flops, self.work = counter.global_flops(), self._work(stats)  # collective
        if self.is_main:
            self.path.write_text(json.dumps({"flops_per_step": self.flops, "work": self.work}))

    def rates(self, stats: dict, step_time: float) -> dict:
        if not self.flops:
            return {}
        flops = self.flops * self._work(stats) / self.work
        out = {"flops_per_step": flops, "achieved_tflops": flops / step_time / self.world / 1e12}
        if self.peak:
            out["mfu"] = flops / (step_time * self.peak * self.world)
        return out


class StopSignals:
    """SIGTERM / SIGUSR1 (SLURM preemption and time-limit warnings; torchrun forwards them):
    finish the step, checkpoint, exit. Installed by the launcher before the run is set up, so an
    early signal is not lost. Ranks may get the signal at different steps, so they agree through
    an all-reduce after each step and all stop after the same one."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received = 0

    def install(self) -> None:
        for s in self.SIGNALS:
            signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def agreed(self, dist: DistInfo) -> int:
        if dist.world_size == 1:
            return self.received
        flag = torch.tensor([self.received], dtype=torch.int64, device=dist.device)
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
        return int(flag.item())

    def stop(self, signum: int, step: int, run_dir, dist: DistInfo) -> Stopped:
        """Say so (before a requeue can kill the job), requeue on SLURM's time-limit warning."""
        name = signal.Signals(signum).name
        job = os.environ.get("SLURM_JOB_ID")
        if dist.is_main:
            print(f"kiln: {name} received: stopped after step {step} with a checkpoint in {run_dir}/checkpoints; "
                  "run.resume=auto continues from it", flush=True)
            if signum == signal.SIGUSR1 and job:
                # #SBATCH --signal=USR1@...: put the job back in the queue; it restarts with the same
                # job id, hence the same run.dir, and resumes from this checkpoint.
                print(f"kiln: requeueing SLURM job {job}", flush=True)
                done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
                if done.returncode:
                    print(f"kiln: scontrol requeue {job} failed: {done.stderr.strip()}", flush=True)
        return Stopped(f"stopped by {name}", 128 + signum)


STOP_SIGNALS = StopSignals()


def step_record(stats: dict, step_time: float, phases: dict[str, float]) -> dict:
    """stats + step_time_s, data_wait_s, per-phase seconds, and throughput."""
    record = dict(stats)
    for count in ("samples", "tokens"):
        if count in record:
            record[f"{count}_per_s"] = record.pop(count) / step_time
    record["step_time_s"] = step_time
    record["data_wait_s"] = phases.pop("data_wait_s", 0.0)
    record.update(phases)
    return record
