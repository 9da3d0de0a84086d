"""Activation checkpointing: bytes a forward keeps for backward and step time, AC none vs full (llm_tiny, dit_tiny)."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from common.activations import kept_for_backward
from scripts.benchmarks.harness import build_trainer, interleaved, model_tensors, take
from scripts.benchmarks.report import Section, Target, md_table, median, mib, ms, ratio, say

TARGET_AC_SAVED = 0.70  # full AC keeps at least this much fewer activation bytes ...
TARGET_AC_TIME = 1.40  # ... for at most this step-time factor
QUICK_BATCH = {"llm_tiny": "trainer.micro_batch_size=4", "dit_tiny": "trainer.micro_batch_size=16"}
MODES = ("none", "full")


def forward_loss(trainer, batch):
    """One forward + loss of the recipe's trainer, as its train_step computes it."""
    return trainer.loss(trainer.prepare(batch))


def saved_bytes(trainer, batch) -> int:
    """Everything one forward + loss keeps alive for backward except the weights and the batch (the
    LLM's packed inputs, its RoPE gather and the log-probabilities are counted: they are the same in
    both modes)."""

    def weights_and_batch():
        # Read after the forward: FSDP2 leaves the root module's weights unsharded for the backward (the module
        # then holds those tensors): weights, not activations.
        yield from model_tensors(trainer.model)
        yield from (t for t in tree_leaves(batch) if isinstance(t, torch.Tensor))

    n, out = kept_for_backward(lambda: forward_loss(trainer, batch), weights_and_batch())
    del out
    return n


def measure(opts, recipe: str, steps: int, warmup: int) -> tuple[dict, dict]:
    """Saved bytes per mode, and both modes' trainers interleaved on the same batches."""
    batch = opts.pick([], [QUICK_BATCH[recipe]])
    trainers = {
        mode: build_trainer(
            opts,
            recipe,
            [f"toggles.activation_checkpointing={mode}", *batch],
            opts.work / f"ac_{recipe.removesuffix('_tiny')}_{mode}",
        )
        for mode in MODES
    }
    batches = take(trainers["none"], warmup + steps)
    return {m: saved_bytes(t, batches[0]) for m, t in trainers.items()}, interleaved(trainers, batches, warmup)


def run(opts) -> Section:
    warmup, steps = 1, opts.pick(10, 2)
    s = Section("ac", "Activation checkpointing: saved activations and step time, none vs full")
    rows = []
    for recipe in ("llm_tiny", "dit_tiny"):
        say(f"ac: {recipe}, none vs full, {warmup + steps} steps each, interleaved")
        saved, steps_by_mode = measure(opts, recipe, steps, warmup)
        times = {m: median(r["times"]) for m, r in steps_by_mode.items()}
        # Per-step ratios: both modes ran the same batch at step i, and the batches' sizes differ.
        vs_none = {m: ratio(r["times"], steps_by_mode["none"]["times"]) for m, r in steps_by_mode.items()}
        fewer, slower = 1 - saved["full"] / saved["none"], vs_none["full"]
        for mode in MODES:
            rows.append(
                [
                    recipe,
                    mode,
                    mib(saved[mode]),
                    f"{saved[mode] / saved['none']:.2f}",
                    ms(times[mode]),
                    f"{vs_none[mode]:.2f}x",
                ]
            )
        s.targets.append(
            Target(
                f"{recipe}: full AC saves >= {TARGET_AC_SAVED:.0%} of activation bytes for <= "
                f"{TARGET_AC_TIME - 1:.0%} more step time",
                f"{fewer:.1%} fewer bytes, {slower:.2f}x time",
                fewer >= TARGET_AC_SAVED and slower <= TARGET_AC_TIME,
            )
        )
        s.data[recipe] = {"saved_bytes": saved, "step_s": {m: r["times"] for m, r in steps_by_mode.items()}}
    s.tables.append(md_table(["recipe", "AC", "saved for backward", "vs none", "step ms (median)", "vs none"], rows))
    s.notes.append(
        "saved bytes: storages created in one forward + loss of the recipe's trainer that are still alive "
        "when it returns (common/activations.py; weights, batch and output excluded; AC applied by "
        "the recipe's parallelize()). "
        "Full AC keeps each block's input; what remains is mostly outside the blocks: the LLM's fp32 "
        "log-probabilities over the vocabulary, the DiT's patch embedding and output head."
    )
    s.notes.append(
        f"step: the trainer's train_step (forward, backward, optimizer), the two modes alternating on the "
        f"same batches, {steps} steps each after {warmup} warm-up; time 'vs none' is the median of per-step "
        "ratios"
    )
    return s
