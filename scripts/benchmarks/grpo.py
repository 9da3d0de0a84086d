"""GRPO's step, part by part (issue 46), on the CPU demo of docs/rl.md#the-demo: the weights pushed into the rollout
engine and checked by the probe (sync), the engine's generation, the rewards and the policy's forward, backward and
optimizer step (train), from the loop's own metrics.jsonl (recipes/llm/grpo.py: time/*_s, and the sync's parts
sync/gather_s, write_s, load_s, check_s), with vLLM's CPU build as the engine.

The demo as its commands build it: data.grpo_demo's chats, llm_tiny fine-tuned on them (100 steps; --quick: 20), then
recipe=llm_tiny_grpo_demo from that export (40 steps; --quick: 4) without its evaluations. Step 1 is left out of the
medians (the engine's first requests warm it up).

Target (issue 46): on CPU the sync takes <= 5% of the tiny demo's step.
"""

from __future__ import annotations

import sys

from scripts.benchmarks.harness import fresh_dir, train_run
from scripts.benchmarks.report import Section, Target, md_table, median, ms, say

TARGET_SYNC_SHARE = 0.05
PARTS = ("sync", "generate", "reward", "train")
SYNC_PARTS = ("gather", "write", "load", "check")


def demo_data(opts):
    """(the chats' shards, the prompts' shards) of the demo (data.grpo_demo, prepare_chat, prepare_prompts)."""
    from data import grpo_demo, prepare_chat, prepare_prompts

    work = fresh_dir(opts.work / "grpo_data")
    src, chat, prompts = work / "demo", work / "chat", work / "prompts"
    tokenizer = str(src / "tokenizer")
    steps = [
        (grpo_demo.main, ["--out", str(src)]),
        (prepare_chat.main, ["--tokenizer", tokenizer, "--input", str(src / "chat.jsonl"), "--out", str(chat)]),
        (
            prepare_prompts.main,
            ["--tokenizer", tokenizer, "--input", str(src / "prompts.jsonl"), "--out", str(prompts)],
        ),
    ]
    for main, argv in steps:
        if main(argv) not in (0, None):
            sys.exit(f"grpo bench: {main.__module__} failed")
    return chat, prompts


def run(opts) -> Section:
    from common.rollout.venv import serve_venv

    s = Section("grpo", "GRPO: the CPU demo's step, part by part, and the weight sync (vLLM's CPU build)")
    if not (serve_venv() / "bin" / "python").exists():
        s.error = f"needs vLLM's environment ({serve_venv()}): run make serve-env"
        return s
    sft_steps, steps = opts.pick(100, 20), opts.pick(40, 4)
    say("grpo: the demo's data, and its supervised warm start")
    chat, prompts = demo_data(opts)
    base = opts.work / "grpo_sft"
    sft = ["data=chat_shards", f"data.root={chat}", "data.max_seq_len=128", "optim.lr=6e-3", "checkpoint.final=true"]
    train_run(opts, "llm_tiny", [*sft, f"trainer.max_steps={sft_steps}"], base)
    say(f"grpo: {steps} GRPO steps of the demo")
    records = train_run(
        opts,
        "llm_tiny_grpo_demo",
        [f"model.init_from={base / 'export'}", f"data.root={prompts}", f"trainer.max_steps={steps}"],
        opts.work / "grpo_run",
    )
    timed = [r for r in records if "time/sync_s" in r][1:]  # step 1 warms the engine up
    step = [sum(r[f"time/{p}_s"] for p in PARTS) for r in timed]
    part = {p: median(r[f"time/{p}_s"] for r in timed) for p in PARTS}
    sync = {p: median(r[f"sync/{p}_s"] for r in timed) for p in SYNC_PARTS}
    total_share = sum(r["time/sync_s"] for r in timed) / sum(step)
    share = median(r["time/sync_s"] / t for r, t in zip(timed, step))
    nbytes = median(r["sync/bytes"] for r in timed)
    tokens_per_s = sum(r["num_tokens_generated"] for r in timed) / sum(r["time/generate_s"] for r in timed)
    gap = max(r["sync/logprob_gap"] for r in records if "sync/logprob_gap" in r)
    rows = [[p, ms(part[p]), f"{part[p] / median(step):.1%}"] for p in PARTS] + [["step", ms(median(step)), ""]]
    s.tables.append(md_table(["part", "median ms", "of the median step"], rows))
    s.tables.append(
        md_table(
            ["sync bytes", *(f"{p} ms" for p in SYNC_PARTS), "MB/s (write + load)", "generated tokens/s", "probe gap"],
            [
                [
                    f"{nbytes / 1e6:.2f} MB",
                    *(ms(sync[p]) for p in SYNC_PARTS),
                    f"{nbytes / 1e6 / (sync['write'] + sync['load']):.0f}",
                    f"{tokens_per_s:.0f}",
                    f"{gap:.2g}",
                ]
            ],
        )
    )
    s.targets.append(
        Target(
            f"the sync <= {TARGET_SYNC_SHARE:.0%} of the tiny demo's step (CPU)",
            f"{share:.1%} (median per step; {total_share:.1%} of all steps' time)",
            share <= TARGET_SYNC_SHARE,
        )
    )
    s.notes.append(
        f"medians of steps 2-{steps} of the demo (step 1 warms the engine up); a step's parts are the loop's own "
        "time/*_s in metrics.jsonl; the sync's: gather (the trainer's weights into Hugging Face names and its probe "
        "forward), write (one safetensors file), load (vLLM's in-place reload_weights), check (the engine scoring the "
        "probe)"
    )
    s.data = {
        "parts_s": part,
        "sync_parts_s": sync,
        "step_s": median(step),
        "sync_share": share,
        "sync_share_total": total_share,
        "sync_bytes": nbytes,
        "tokens_per_s": tokens_per_s,
    }
    return s
