"""GRPO's step, part by part (issue 46): the weights pushed into the rollout engine and checked by the probe (sync),
the engine's generation, the rewards and the policy's forward, backward and optimizer step (train), from the
`time/*_s` of the loop's own metrics.jsonl (recipes/llm/grpo.py), on llm_tiny with vLLM's CPU build as the engine.

The policy: llm_tiny trained a few steps on the pydoc data (its tokenizer builds the prompts); the prompts: short
pydoc phrases, 2 a step x 4 samples of 16 tokens, scored by common.rewards:format_match. The first step is left
out of the medians (the engine's first requests warm it up).

Target (issue 46): on CPU the sync takes <= 5% of the step.
"""

from __future__ import annotations

import json

from scripts.benchmarks.harness import fresh_dir, train_run
from scripts.benchmarks.report import Section, Target, md_table, median, ms, say

TARGET_SYNC_SHARE = 0.05
PARTS = ("sync", "generate", "reward", "train")
WORDS = ["The with statement", "A list comprehension", "The import system", "Exceptions are", "A generator"]


def prompts(opts, export) -> str:
    """Prompt shards of the pydoc phrases (data/prepare_prompts.py), tokenized by the policy's export."""
    from data.prepare_prompts import main as prepare_prompts

    work = fresh_dir(opts.work / "grpo_prompts")
    rows = [{"prompt": w, "format_pattern": "^ "} for w in [*WORDS, *(w.lower() for w in WORDS)]]
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--tokenizer", str(export), "--input", str(work / "prompts.jsonl"), "--out", str(work / "shards")]
    if prepare_prompts(argv) != 0:
        raise RuntimeError("grpo bench: data.prepare_prompts failed")
    return str(work / "shards")


def run(opts) -> Section:
    from common.rollout.venv import serve_venv

    s = Section("grpo", "GRPO: the step's parts, the weight sync and the engine's generation (llm_tiny, vLLM CPU)")
    if not (serve_venv() / "bin" / "python").exists():
        s.error = f"needs vLLM's environment ({serve_venv()}): run make serve-env"
        return s
    steps = opts.pick(12, 3)
    say("grpo: training the policy's starting point (llm_tiny, 20 steps)")
    base = opts.work / "grpo_base"
    train_run(opts, "llm_tiny", ["trainer.max_steps=20", "checkpoint.final=true"], base)
    say(f"grpo: {steps} GRPO steps with the engine")
    records = train_run(
        opts,
        "llm_tiny",
        [
            "data=prompt_shards",
            f"data.root={prompts(opts, base / 'export')}",
            f"model.init_from={base / 'export'}",
            "grpo.enabled=true",
            "reward.functions=[common.rewards:format_match]",
            "grpo.num_generations=4",
            "grpo.max_completion_length=16",
            "data.max_seq_len=64",
            "data.num_workers=0",
            "trainer.micro_batch_size=2",
            f"trainer.max_steps={steps}",
            "trainer.log_every=1",
        ],
        opts.work / "grpo_run",
    )
    timed = [r for r in records if "time/sync_s" in r][1:]  # step 1 warms the engine up
    part = {p: median(r[f"time/{p}_s"] for r in timed) for p in PARTS}
    step = median(sum(r[f"time/{p}_s"] for p in PARTS) for r in timed)
    share = median(r["time/sync_s"] / sum(r[f"time/{p}_s"] for p in PARTS) for r in timed)
    nbytes = median(r["sync/bytes"] for r in timed)
    tokens_per_s = median(r["num_tokens_generated"] / r["time/generate_s"] for r in timed)
    gap = max(r["sync/logprob_gap"] for r in records if "sync/logprob_gap" in r)
    rows = [[p, ms(part[p]), f"{part[p] / step:.1%}"] for p in PARTS] + [["step", ms(step), "100%"]]
    s.tables.append(md_table(["part", "median ms", "of the step"], rows))
    s.tables.append(
        md_table(
            ["sync bytes", "sync ms", "sync MB/s", "generated tokens/s", "largest probe gap"],
            [
                [
                    f"{nbytes / 1e6:.2f} MB",
                    ms(part["sync"]),
                    f"{nbytes / 1e6 / part['sync']:.0f}",
                    f"{tokens_per_s:.0f}",
                    f"{gap:.2g}",
                ]
            ],
        )
    )
    s.targets.append(
        Target(f"the sync <= {TARGET_SYNC_SHARE:.0%} of the step (CPU)", f"{share:.1%}", share <= TARGET_SYNC_SHARE)
    )
    s.notes.append(
        f"medians of steps 2-{steps} (step 1 warms the engine up); sync: the trainer's weights written to one "
        "safetensors file, loaded in place by the engine (reload_weights), then the probe scored on both sides; a "
        "step's parts are the loop's own time/*_s in metrics.jsonl"
    )
    s.data = {"parts_s": part, "step_s": step, "sync_share": share, "sync_bytes": nbytes, "tokens_per_s": tokens_per_s}
    return s
