"""The benchmarks that are scripts of their own (scripts/bench_packing.py, bench_pipeline.py, bench_serve.py), run as
subprocesses and folded into the report."""

from __future__ import annotations

import re

from scripts.benchmarks.harness import run_script
from scripts.benchmarks.report import Section, Target, md_table, say


def packing(opts) -> Section:
    args = opts.pick([], ["--steps", "2", "--samples-per-step", "32", "--max-seq-len", "256"])
    say(f"packing: scripts/bench_packing.py {' '.join(args)}")
    out = run_script(opts, "bench_packing.py", ["--threads", str(opts.threads), *args])
    s = Section("packing", "Sequence packing vs padding (scripts/bench_packing.py)")
    s.tables.append("\n".join(line for line in out.splitlines() if line.startswith("|")))
    for line in out.splitlines():
        m = re.match(r"target: (.*): (.*) -> (MET|NOT MET)$", line)
        if m:
            s.targets.append(Target(m[1], m[2], m[3] == "MET"))
        elif line.startswith(("check:", "bench_packing:")):
            s.notes.append(line)
    return s


def pipeline(opts) -> Section:
    args = opts.pick([], ["--microbatches", "2", "4", "--rows", "8", "--seq", "64", "--dim", "64", "--warmup", "1",
                          "--iters", "2"])
    say(f"pipeline: scripts/bench_pipeline.py {' '.join(args)}")
    out = run_script(opts, "bench_pipeline.py", ["--threads", str(opts.threads), *args])
    lines = out.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("schedule"))
    rows = [line.split() for line in lines[header + 1:] if line.strip()]
    s = Section("pipeline", "Pipeline bubble, 2 stages (scripts/bench_pipeline.py)")
    s.tables.append(md_table(["schedule", "microbatches", "step s", "idle stage 0", "idle stage 1",
                              "theory (p-1)/(m+p-1)"], rows))
    s.notes.append(lines[header - 1])
    return s


def serving(opts) -> Section:
    tables = opts.out / "serving.md"
    tables.unlink(missing_ok=True)
    say("serving: scripts/bench_serve.py --quick")
    run_script(opts, "bench_serve.py", ["--quick", "--threads", str(opts.threads), "--markdown", str(tables)])
    s = Section("serving", "Serving (scripts/bench_serve.py --quick)")
    s.tables.append(tables.read_text())
    return s
