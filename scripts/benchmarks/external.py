"""The benchmarks that are scripts of their own (scripts/bench_packing.py, bench_pipeline.py, bench_serve.py,
bench_loading.py, bench_dit.py), run as subprocesses and folded into the report."""

from __future__ import annotations

import re

from scripts.benchmarks.harness import run_script
from scripts.benchmarks.report import Section, Target, md_table, say


def _tables_and_targets(s: Section, out: str, note_prefixes: tuple[str, ...] = ()) -> Section:
    """A script's markdown table rows (consecutive `|` lines) and its `target: WHAT: VALUE -> MET|NOT MET`
    lines (also `- target: ... -> **met**` and `..., met` forms) into `s`."""
    table: list[str] = []
    for line in [*out.splitlines(), ""]:
        if line.startswith("|"):
            table.append(line)
            continue
        if table:
            s.tables.append("\n".join(table))
            table = []
        m = re.match(r"-? ?target: (.*?): (.*?)(?: -> |, )\**(MET|NOT MET|met|NOT met)\**$", line)
        if m:
            s.targets.append(Target(m[1], m[2], m[3].lower() == "met"))
        elif note_prefixes and line.startswith(note_prefixes):
            s.notes.append(line)
    return s


def packing(opts) -> Section:
    args = opts.pick([], ["--steps", "2", "--samples-per-step", "32", "--max-seq-len", "256"])
    s = Section("packing", "Sequence packing vs padding (scripts/bench_packing.py)")
    for distribution in ("lognormal", "llava"):  # a long-tailed text stream; LLaVA-1.5-shaped conversations
        say(f"packing: scripts/bench_packing.py --distribution {distribution} {' '.join(args)}")
        out = run_script(opts, "bench_packing.py", ["--threads", str(opts.threads), "--distribution", distribution, *args])
        s.notes.append(f"--distribution {distribution}:")
        _tables_and_targets(s, out, ("check:", "bench_packing:"))
    return s


def loading(opts) -> Section:
    args = opts.pick([], ["--quick"])
    say(f"loading: scripts/bench_loading.py {' '.join(args)}")
    out = run_script(opts, "bench_loading.py", args, timeout=1800)
    return _tables_and_targets(Section("loading", "Loading a Llama checkpoint: host memory per rank "
                                                  "(scripts/bench_loading.py)"), out)


def dit(opts) -> Section:
    args = opts.pick([], ["--quick"])
    say(f"dit: scripts/bench_dit.py {' '.join(args)}")
    out = run_script(opts, "bench_dit.py", ["--threads", str(opts.threads), "--work", str(opts.out / "dit"), *args],
                     timeout=1800)
    s = _tables_and_targets(Section("dit", "DiT: selective activation checkpointing; cached vs on-the-fly latents "
                                           "(scripts/bench_dit.py)"), out)
    s.notes += [line[2:] for line in out.splitlines() if line.startswith("- ") and "target:" not in line]
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
