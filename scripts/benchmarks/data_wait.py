"""Data wait at steady state: the share of a step the DiT and VLM loaders make the trainer wait (default workers)."""

from __future__ import annotations

import json
from pathlib import Path

from scripts.benchmarks.harness import train_run
from scripts.benchmarks.report import Section, Target, md_table, median, ms, say
from scripts.kiln.launch import compose

TARGET_DATA_WAIT = 0.02  # data wait / step time at steady state
WARMUP = 5


def steps_per_epoch(cfg) -> int:
    """Full batches per epoch of one rank with one reader (the partial last batch is dropped)."""
    meta = json.loads((Path(cfg.data.root) / "meta.json").read_text())
    return meta["splits"]["train"]["samples"] // cfg.trainer.micro_batch_size


def run(opts) -> Section:
    rows, s = [], Section("data", "Data wait at steady state (recipe loaders at their default data.num_workers)")
    for recipe, steps in (("dit_tiny", opts.pick(75, 30)), ("vlm_tiny", opts.pick(110, 30))):
        cfg = compose([f"recipe={recipe}"])
        say(f"data: {recipe}, {steps} steps, log_every=1, data.num_workers={cfg.data.num_workers}")
        records = train_run(
            opts, recipe, [f"trainer.max_steps={steps}", "trainer.log_every=1"], opts.work / f"data_{recipe}"
        )
        steady = [r for r in records if r["step"] > WARMUP]
        fraction = sum(r["data_wait_s"] for r in steady) / sum(r["step_time_s"] for r in steady)
        worst = max(steady, key=lambda r: r["data_wait_s"])
        rows.append(
            [
                recipe,
                cfg.data.num_workers,
                cfg.trainer.micro_batch_size,
                f"{WARMUP + 1}-{steps}",
                steps_per_epoch(cfg),
                f"{fraction:.2%}",
                f"{median(r['data_wait_s'] / r['step_time_s'] for r in steady):.2%}",
                f"{ms(worst['data_wait_s'])} ms (step {worst['step']})",
                ms(median(r["step_time_s"] for r in steady)),
            ]
        )
        s.targets.append(
            Target(
                f"{recipe}: data wait <= {TARGET_DATA_WAIT:.0%} of step time",
                f"{fraction:.2%}",
                fraction <= TARGET_DATA_WAIT,
            )
        )
        s.data[recipe] = {
            "fraction": fraction,
            "records": [{k: r[k] for k in ("step", "step_time_s", "data_wait_s")} for r in records],
        }
    s.tables.append(
        md_table(
            [
                "recipe",
                "workers",
                "micro batch",
                "steps",
                "steps per epoch",
                "data wait / step time",
                "median per step",
                "worst step",
                "step ms (median)",
            ],
            rows,
        )
    )
    s.notes.append(
        "from metrics.jsonl (trainer.log_every=1): sum of data_wait_s over sum of step_time_s, steps after "
        f"{WARMUP} warm-up; one process, {opts.threads} thread(s)"
    )
    return s
