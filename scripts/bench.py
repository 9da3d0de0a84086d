#!/usr/bin/env python
"""Kiln's benchmarks, measured side by side in one run, written as markdown tables with their targets."""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout

from scripts.benchmarks import (
    ac,
    checkpoint,
    cp,
    data_wait,
    dit,
    export,
    grpo,
    loading,
    lora,
    moe,  # noqa: E402
    overhead,
    packing,
    pipeline,
    preference,
    qwen,
    report,
    scaling,
    serving,
    t2i,
    triton,
    video,
    zero,
)
from scripts.benchmarks.harness import Options  # noqa: E402

# Each section is a module of scripts/benchmarks/ with `run(opts) -> report.Section`; one alone: --only NAME.
SECTIONS = {
    "overhead": overhead.run,
    "ac": ac.run,
    "zero": zero.run,
    "data": data_wait.run,
    "scaling": scaling.run,
    "packing": packing.run,
    "pipeline": pipeline.run,
    "cp": cp.run,
    "serving": serving.run,
    "loading": loading.run,
    "dit": dit.run,
    "moe": moe.run,
    "checkpoint": checkpoint.run,
    "export": export.run,
    "lora": lora.run,
    "preference": preference.run,
    "grpo": grpo.run,
    "t2i": t2i.run,
    "video": video.run,
    "qwen": qwen.run,
    "triton": triton.run,
}
# A quick run is a smoke test: it keeps its own folder so that it never replaces a full run's report.
FULL_OUT, QUICK_OUT = REPO / "outputs" / "bench", REPO / "outputs" / "bench" / "quick"


def parse_args(argv: list[str]) -> tuple[Options, list[str]]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer steps and smaller runs (the smoke test's mode)")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections: {','.join(SECTIONS)}")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads per process, for every benchmark (default 1: on a shared machine "
        "OpenMP's barriers stall whenever another job takes a core)",
    )
    p.add_argument(
        "--out",
        help=f"where bench.md, bench.json and runs go (default {FULL_OUT.relative_to(REPO)}, "
        f"with --quick {QUICK_OUT.relative_to(REPO)})",
    )
    args = p.parse_args(argv)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    out = Path(args.out).resolve() if args.out else QUICK_OUT if args.quick else FULL_OUT
    return Options(quick=args.quick, threads=args.threads, out=out), sections


def run_section(opts: Options, name: str) -> report.Section:
    start = time.perf_counter()
    report.say(f"{name}: start")
    try:
        section = SECTIONS[name](opts)
    except Exception as exc:  # one broken benchmark must not cost the others their results
        with open(opts.log, "a") as f:
            traceback.print_exc(file=f)
        section = report.Section(name, name, error=f"{type(exc).__name__}: {str(exc)[:500]} (traceback in {opts.log})")
    section.data["seconds"] = time.perf_counter() - start
    report.say(f"{name}: done in {section.data['seconds']:.0f} s")
    print("\n" + section.markdown(), flush=True)
    return section


def main(argv: list[str] | None = None) -> int:
    import torch

    opts, names = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(opts.threads)
    opts.work.mkdir(parents=True, exist_ok=True)
    opts.log.write_text("")
    start = time.perf_counter()
    sections = [run_section(opts, name) for name in SECTIONS if name in names]
    markdown = report.render(sections, quick=opts.quick, seconds=time.perf_counter() - start)
    written = report.write(opts.out, markdown, sections)
    print("\n" + markdown, flush=True)
    report.say(f"wrote {', '.join(str(p) for p in written)}; subprocess output and tracebacks in {opts.log}")
    return 1 if any(s.error for s in sections) else 0


if __name__ == "__main__":
    from common.known_warnings import silence_known_warnings

    silence_known_warnings()  # before the recipes import transformers/peft/diffusers (and torchao with them)
    sys.exit(main())
