"""The step loop every recipe runs: timing, metrics, profiling, and checkpoint cadence.

A recipe's Trainer supplies the parts that differ (its `train_step`, what to do after a
step); this function owns the parts that must not differ between recipes.
"""

from __future__ import annotations

import time
from typing import Protocol

from common.config import TrainConfig
from common.distributed import DistInfo
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
        step) become samples_per_s / tokens_per_s."""

    def save_checkpoint(self) -> None: ...

    # Optional hooks: after_first_step() (e.g. measure optimizer state), after_step() (e.g. samples).


def run_training_loop(trainer: LoopTrainer) -> None:
    cfg, t = trainer.cfg, trainer.cfg.trainer
    metrics = MetricsLogger(trainer.run_dir, trainer.dist, max_steps=t.max_steps, start_step=trainer.step,
                            progress_bar=t.progress_bar)
    timer = StepTimer()
    start_step = trainer.step
    trainer.batches = iter(trainer.loader)
    after_first_step = getattr(trainer, "after_first_step", lambda: None)
    after_step = getattr(trainer, "after_step", lambda: None)
    with maybe_profile(cfg.profile, trainer.run_dir, trainer.dist.rank) as prof:
        while trainer.step < t.max_steps:
            log_now = (trainer.step + 1) % t.log_every == 0 or trainer.step + 1 == t.max_steps
            timer.enabled = log_now or cfg.profile.enabled
            start = time.perf_counter()
            stats = trainer.train_step(timer)
            step_time = time.perf_counter() - start
            trainer.step += 1
            prof.step()
            metrics.advance()
            if trainer.step == start_step + 1:
                after_first_step()
            if log_now:
                metrics.log(trainer.step, step_record(stats, step_time, timer.pop()))
            after_step()
            if cfg.checkpoint.every and trainer.step % cfg.checkpoint.every == 0:
                trainer.save_checkpoint()
    if cfg.checkpoint.final:
        trainer.save_checkpoint()
    trainer.loader.close()
    metrics.close()


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
