"""ZeRO: per-rank model-state bytes that dit_tiny measures at stages 0-3 on 2 ranks, vs common/memory.py's model."""

from __future__ import annotations

import json

from common.memory import deepspeed_state_bytes, model_state_bytes
from scripts.benchmarks.harness import train_run
from scripts.benchmarks.report import Section, Target, md_table, mib, say
from scripts.kiln.launch import compose

TARGET_ZERO_MATCH = 0.10  # measured model-state bytes within this of the memory model
WORLD = 2


def run(opts) -> Section:
    stages = opts.pick([0, 1, 2, 3], [0, 3])
    precision = compose(["recipe=dit_tiny"]).toggles.precision
    rows, data = [], {}
    for stage in stages:
        say(f"zero: dit_tiny, stage {stage}, {WORLD} ranks (torchrun)")
        run_dir = opts.work / f"zero{stage}"
        train_run(
            opts,
            "dit_tiny",
            [f"parallel.zero_stage={stage}", "trainer.max_steps=2", "trainer.log_every=1"],
            run_dir,
            nproc=WORLD,
        )
        info = json.loads((run_dir / "memory.json").read_text())
        # The model's per-rank states: what it says DeepSpeed allocates at this stage and precision.
        plan = model_state_bytes(info["trainable_params"], stage, info["dp"], deepspeed_state_bytes(stage, precision))
        planned = plan["weights"] + plan["optimizer"]  # memory.json measures weights + optimizer, not grads
        measured = info["per_rank_state_bytes"]
        data[stage] = {"measured": measured, "planner": plan, "num_params": info["num_params"]}
        rows.append(
            [stage, *(mib(m) for m in measured), mib(planned), f"{max(measured) / planned:.3f}", mib(plan["grads"])]
        )
    s = Section("zero", f"ZeRO per-rank model-state bytes, dit_tiny on {WORLD} ranks: measured vs the planner")
    s.tables.append(
        md_table(
            [
                "stage",
                *(f"measured rank {r}" for r in range(WORLD)),
                "planner: weights + optimizer",
                "measured / planner",
                "planner: grads (not measured)",
            ],
            rows,
        )
    )
    worst = max(
        abs(max(d["measured"]) / (d["planner"]["weights"] + d["planner"]["optimizer"]) - 1) for d in data.values()
    )
    s.targets.append(
        Target(
            f"measured within {TARGET_ZERO_MATCH:.0%} of common/memory.py at every stage",
            f"worst {worst:.1%} off",
            worst <= TARGET_ZERO_MATCH,
        )
    )
    s.notes.append(
        f"{data[stages[0]]['num_params']:,} parameters, {precision}. measured: run.dir/memory.json "
        "(common/deepspeed.py record_state_bytes: unique storages of weights, ZeRO partitions, the "
        "optimizer's fp32 params and Adam moments after the first step; gradients are freed between "
        "steps, so not counted); planner: common/memory.py model_state_bytes with deepspeed_state_bytes "
        "(in fp32, ZeRO-1/2 keep an extra fp32 weight partition for the step: DeepSpeed's "
        "stage_1_and_2.py clones it even when the weights are fp32; ZeRO-3 steps its partition in place)."
    )
    s.data = {str(k): v for k, v in data.items()}
    return s
