"""Scaling: step time, throughput, MFU and (CUDA) peak memory vs model width; 1 vs 2 ranks at one global batch."""

from __future__ import annotations

import os

import torch

from common.flops import FlopCounter, mfu, peak_flops, precision_key
from scripts.benchmarks.harness import build_trainer, interleaved, step_timer, take, timed_step, train_run
from scripts.benchmarks.report import Section, md_table, median, mib, ms, say
from scripts.kiln.launch import compose

WIDTHS = {  # model.* overrides at a width factor of the recipe's own (1)
    "llm_tiny": lambda f: [f"model.dim={int(128 * f)}", f"model.ffn_dim={int(344 * f)}"],
    "dit_tiny": lambda f: [f"model.attention_head_dim={int(16 * f)}"],
    "vlm_tiny": lambda f: [
        f"model.text_hidden_size={int(128 * f)}",
        f"model.text_intermediate_size={int(256 * f)}",
        f"model.vision_hidden_size={int(64 * f)}",
        f"model.vision_intermediate_size={int(128 * f)}",
    ],
}


def width_trainers(opts, recipe: str, factors: list[float], n_batches: int):
    """The recipe's trainer at each width; one warm-up step each, its FLOPs counted, and on CUDA the
    bytes the trainer keeps resident (weights, grads, Adam state)."""
    cuda = torch.cuda.is_available()
    trainers, extra, batches = {}, {}, None
    for f in factors:
        overrides = WIDTHS[recipe](f)
        name = overrides[0].removeprefix("model.")  # e.g. dim=64
        before = torch.cuda.memory_allocated() if cuda else 0
        trainers[name] = trainer = build_trainer(opts, recipe, overrides, opts.work / f"scale_{recipe}_{f:g}")
        batches = batches or take(trainer, n_batches)
        with FlopCounter() as counter:
            _, stats, _ = timed_step(trainer, batches[0], step_timer())
        extra[name] = {
            "flops": (counter.flops, stats.work),
            "resident": (torch.cuda.memory_allocated() - before) if cuda else None,
            "params": sum(p.numel() for p in trainer.model.parameters()),
        }
    return trainers, extra, batches


def width_rows(recipe: str, result: dict, extra: dict, peak: float | None) -> list[list]:
    base = next(iter(result))
    unit, count = ("images/s", lambda st: st.samples) if recipe == "dit_tiny" else ("tokens/s", lambda st: st.tokens)
    rows = []
    for name, r in result.items():
        t = median(r["times"])
        rate = median(count(st) / dt for st, dt in zip(r["stats"], r["times"]))
        utilization = "n/a"
        if peak:
            # Packed rows vary per step: FLOPs scale with the step's work (StepStats.work) from the counted one.
            flops0, work0 = extra[name]["flops"]
            step_mfu = [mfu(flops0 * st.work / work0, dt, peak) for st, dt in zip(r["stats"], r["times"])]
            utilization = f"{median(step_mfu):.2%}"
        memory = "n/a (CPU)"
        if extra[name]["resident"] is not None:
            memory = mib(extra[name]["resident"] + max(r["peaks"]))
        rows.append(
            [
                recipe,
                name,
                f"{extra[name]['params']:,}",
                ms(t),
                f"{t / median(result[base]['times']):.2f}x",
                f"{rate:,.0f} {unit}",
                utilization,
                memory,
            ]
        )
    return rows


def device_peak_flops(trainer) -> tuple[float | None, str]:
    """Peak FLOP/s of this device at the trainer's precision (a datasheet on GPUs, a measured matmul on CPU)."""
    precision = precision_key(trainer.cfg.toggles)
    try:
        peak = peak_flops(trainer.device, precision)
    except ValueError as exc:
        return None, f"no MFU: {exc}"
    where = "datasheet" if trainer.device.type == "cuda" else "measured matmul on this CPU"
    return peak, f"MFU against {peak / 1e12:.3f} TFLOP/s ({precision}, {where}), FLOPs counted on the warm-up step"


def widths(opts, s: Section) -> None:
    factors, steps, warmup = opts.pick([0.5, 1, 2], [0.5, 1]), opts.pick(6, 2), 1
    rows = []
    for recipe in WIDTHS:
        say(f"scaling: {recipe} at widths x{', x'.join(f'{f:g}' for f in factors)}, {steps} steps each, interleaved")
        trainers, extra, batches = width_trainers(opts, recipe, factors, warmup + steps)
        peak, peak_note = device_peak_flops(next(iter(trainers.values())))
        result = interleaved(trainers, batches, warmup)
        rows += width_rows(recipe, result, extra, peak)
        s.data[f"width_{recipe}"] = {n: {"step_s": r["times"], **extra[n]} for n, r in result.items()}
        del trainers
    s.tables.append(
        md_table(
            ["recipe", "width", "parameters", "step ms (median)", "vs narrowest", "throughput", "MFU", "peak memory"],
            rows,
        )
    )
    s.notes.append(
        f"widths: the recipes' trainers side by side in one process, steps interleaved on the same batches, "
        f"{steps} steps each after {warmup} warm-up, {opts.threads} thread(s); {peak_note}"
    )


def ranks(opts, s: Section) -> None:
    recipes, steps, warmup = opts.pick(["dit_tiny", "vlm_tiny", "llm_tiny"], ["dit_tiny"]), opts.pick(12, 6), 3
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        s.notes.append("ranks: skipped, 2 ranks need 2 GPUs")
        return
    rows = []
    for recipe in recipes:
        batch = compose([f"recipe={recipe}"]).trainer.micro_batch_size
        runs = {}
        for nproc in (1, 2):
            say(f"scaling: {recipe} on {nproc} rank(s), global batch {batch}, {steps} steps")
            records = train_run(
                opts,
                recipe,
                [f"trainer.max_steps={steps}", "trainer.log_every=1", f"trainer.micro_batch_size={batch // nproc}"],
                opts.work / f"ranks_{recipe}_{nproc}",
                nproc=nproc,
            )
            runs[nproc] = [r for r in records if r["step"] > warmup]
        t1, t2 = (median(r["step_time_s"] for r in runs[n]) for n in (1, 2))
        key = "samples_per_s" if recipe == "dit_tiny" else "tokens_per_s"
        rate = {n: median(r[key] for r in runs[n]) for n in (1, 2)}
        unit = key.replace("_per_s", "/s")
        rows.append(
            [recipe, batch, ms(t1), ms(t2), f"{t1 / t2:.2f}x", f"{rate[1]:,.0f} {unit}", f"{rate[2] / 2:,.0f} {unit}"]
        )
        s.data[f"ranks_{recipe}"] = {
            "step_s_1": [r["step_time_s"] for r in runs[1]],
            "step_s_2": [r["step_time_s"] for r in runs[2]],
        }
    s.tables.append(
        md_table(
            [
                "recipe",
                "global batch",
                "1 rank: step ms",
                "2 ranks: step ms",
                "speedup",
                "1 rank: throughput",
                "2 ranks: throughput per rank",
            ],
            rows,
        )
    )
    s.notes.append(
        f"ranks: scripts/train.py vs torchrun --nproc_per_node 2 (DiT/VLM: DeepSpeed data parallel; "
        f"LLM: FSDP2), same global batch, {opts.threads} thread(s) per rank, median step_time_s of steps "
        f"{warmup + 1}-{steps}; {os.cpu_count()} cores shared with other jobs, so 2 ranks cannot give more "
        f"than ~{os.cpu_count()}x"
    )


def run(opts) -> Section:
    s = Section("scaling", "Scaling: step time vs model width, and 1 vs 2 ranks")
    widths(opts, s)
    ranks(opts, s)
    return s
