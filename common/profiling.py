"""Profiling during a run: a per-phase step timer (also NVTX ranges on CUDA) and a torch.profiler
wrapper that writes per-rank traces. Merging them into one timeline and the step breakdown is a post-run step
above this library (scripts/kiln/traces.py): the wrapper leaves the traces it wrote in `take_traces()`, which the
launcher reads once the run is over.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from pathlib import Path

import torch

from common.config import ProfileConfig

MERGE_LIMIT_BYTES = 2**30  # per-rank traces merged at the end of a run only below this total
# (trace folder, run dir) of each profiled run in this process whose traces are left to merge (rank 0 only).
_TRACES: list[tuple[Path, Path]] = []


def take_traces() -> list[tuple[Path, Path]]:
    """The (trace folder, run dir) pairs a profiled run left for the post-run merge, handed over once."""
    taken = list(_TRACES)
    _TRACES.clear()
    return taken


class StepTimer:
    """Wall time per phase (data, forward, backward, optimizer) of the current step.

    On CUDA the device is synchronized at phase edges so a phase owns its kernels; that
    costs a little overlap, which is why it only runs on logging steps (`enabled`). Each phase is
    also a `phase/<name>` range in profiler traces (the step breakdown reads them per rank) and an
    NVTX range on CUDA (for Nsight Systems).
    """

    def __init__(self) -> None:
        self.times: dict[str, float] = defaultdict(float)
        self.enabled = True

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        cuda = torch.cuda.is_available()
        with contextlib.ExitStack() as ranges:
            ranges.enter_context(torch.profiler.record_function(f"phase/{name}"))
            if cuda:
                ranges.enter_context(torch.cuda.nvtx.range(name))
                torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                yield
            finally:
                if cuda:
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

    Each active window writes `profile/rank{R}_step{N}.json` (Chrome/Perfetto trace format). When
    the loop ends, rank 0 merges them into `profile/trace.json` and writes `profile/summary.json`.
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
    from common.distributed import barrier

    barrier()  # every rank's traces are on disk
    if rank != 0:
        return
    size = sum(p.stat().st_size for p in out.glob("rank*_step*.json"))
    if size > MERGE_LIMIT_BYTES:
        # The other ranks wait in their next collective meanwhile, and Perfetto cannot open a
        # timeline this big anyway: leave the per-rank files and the summary to the report script.
        print(
            f"kiln: profile traces total {size / 2**30:.1f} GiB: not merged; "
            f"scripts/profile_report.py run.dir={run_dir} writes the step breakdown",
            flush=True,
        )
        return
    _TRACES.append((Path(out), Path(run_dir)))
