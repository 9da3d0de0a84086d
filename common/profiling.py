"""Profiling hooks: a per-phase step timer and a torch.profiler wrapper writing per-rank traces."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from pathlib import Path

import torch

from common.config import ProfileConfig


class StepTimer:
    """Wall time per phase (data, forward, backward, optimizer) of the current step.

    On CUDA the device is synchronized at phase edges so a phase owns its kernels; that
    costs a little overlap, which is why it only runs on logging steps (`enabled`).
    """

    def __init__(self) -> None:
        self.times: dict[str, float] = defaultdict(float)
        self.enabled = True

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times[name] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out = {f"{k}_s": v for k, v in self.times.items()}
        self.times = defaultdict(float)
        return out


class _NullProfiler:
    def step(self) -> None:
        pass


@contextlib.contextmanager
def maybe_profile(cfg: ProfileConfig, run_dir: str | Path, rank: int):
    """torch.profiler over the training loop when `profile.enabled`; call `.step()` per step.

    Each active window writes `profile/rank{R}_step{N}.json` (Chrome/Perfetto trace format).
    """
    if not cfg.enabled:
        yield _NullProfiler()
        return
    out = Path(run_dir) / "profile"
    out.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def on_trace_ready(prof: torch.profiler.profile) -> None:
        prof.export_chrome_trace(str(out / f"rank{rank}_step{prof.step_num}.json"))

    schedule = torch.profiler.schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=cfg.repeat)
    with torch.profiler.profile(
        activities=activities,
        schedule=schedule,
        on_trace_ready=on_trace_ready,
        record_shapes=cfg.record_shapes,
        profile_memory=cfg.profile_memory,
        with_stack=cfg.with_stack,
    ) as prof:
        yield prof
