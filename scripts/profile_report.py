#!/usr/bin/env python
"""Step breakdown and bottleneck verdict of a profiled run (profile.enabled=true).

    python scripts/profile_report.py run.dir=outputs/llm_tiny/<run>     (or the path alone)

Per rank and overall (mean of ranks), every profiled step is split into rows that add up to it,
read from the per-rank traces in run.dir/profile/:
  data_wait, forward, backward, optimizer   inside StepTimer's phase/<name> range, and (except
                 data_wait) with an op running on the main thread / a kernel on the GPU
  communication  a collective runs and the rank waits on it (exposed; on GPU: NCCL kernels not
                 overlapped by compute kernels); taken out of the phase it happened in
  other          ops outside every phase (loss.item(), EMA, logging collectives)
  idle           nothing runs: no op on the main thread (CPU) / no kernel (GPU)
The breakdown is also written to run.dir/profile/summary.json.
metrics.jsonl gives the same phases for every logged step of the run (rank 0's timer) as a
cross-check of the profiled window. Verdict: input-bound, else communication-bound, else
launch/CPU-bound, else compute-bound (thresholds in scripts/kiln/traces.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout


def parse_run_dir(argv: list[str]) -> Path:
    paths = [a.split("=", 1)[1] if a.startswith("run.dir=") else a for a in argv]
    if len(paths) != 1 or paths[0] in ("-h", "--help") or "=" in paths[0]:
        raise SystemExit(__doc__)
    return Path(paths[0])


def check(run_dir: Path) -> None:
    profile = run_dir / "profile"
    if not run_dir.is_dir():
        raise ValueError(f"no such run directory: {run_dir}")
    if not profile.is_dir() or not any(profile.glob("rank*_step*.json")):
        raise ValueError(f"{run_dir} has no profile/rank*_step*.json traces (train with profile.enabled=true)")
    if not (run_dir / "metrics.jsonl").is_file():
        raise ValueError(f"{run_dir} has no metrics.jsonl (the run logged no step)")


def cell(seconds: float, step: float) -> str:
    return f"{seconds:9.4f} s {100 * seconds / step:5.1f}%" if step else f"{seconds:9.4f} s     -"


def report(run_dir: Path) -> str:
    from scripts.kiln.traces import ROWS, overhead_percent, write_summary  # after check(): errors come fast

    b = write_summary(run_dir)  # fresh from the traces (the run's own summary.json may predate a resume)
    columns = {f"rank {r}": v for r, v in b["ranks"].items()}
    columns["overall"] = b["overall"]
    o = b["overall"]
    lines = [
        f"profile report: {run_dir} ({len(b['ranks'])} rank(s), {o['device']}, "
        f"{b['ranks'][min(b['ranks'], key=int)]['steps']} profiled step(s) per rank)"
    ]
    if not o["phases_found"]:
        lines.append(
            "note: the traces have no phase/* ranges (recorded before StepTimer added them); "
            "phase time shows as 'other'"
        )
    lines.append(f"{'':14}" + "".join(f"{name:>20}" for name in columns))
    lines.append(f"{'step':14}" + "".join(f"{cell(c['step_s'], c['step_s']):>20}" for c in columns.values()))
    for row in ROWS:
        lines.append(f"{row:14}" + "".join(f"{cell(c['seconds'][row], c['step_s']):>20}" for c in columns.values()))
    unit = "kernels" if o["device"] == "cuda" else "ops"  # top-level ops of the main thread on CPU
    ops = [f"{c['ops_per_step']:.0f}/step, {c['median_op_us']:.1f} µs" for c in columns.values()]
    lines.append(f"{unit + ', median':14}" + "".join(f"{cell:>20}" for cell in ops))
    lines.append(f"{'overhead':14}" + "".join(f"{overhead_percent(c):>19.1f}%" for c in columns.values()))
    m = b["metrics"]
    if m is not None:
        parts = " ".join(f"{k} {v:.1f}%" for k, v in m["percent"].items())
        lines.append(
            f"metrics.jsonl (rank 0, mean of logged steps {m['steps'][0]}-{m['steps'][1]}): "
            f"step {m['step_s']:.4f} s = {parts}"
        )
        lines.append("  (the whole run by StepTimer; communication and idle are inside its phases)")
    v = b["verdict"]
    lines.append(f"verdict: {v['label']}: {v['reason']}")
    lines.append(f"evidence: {v['evidence']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    run_dir = parse_run_dir(argv)
    try:
        check(run_dir)
    except ValueError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2
    print(report(run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
