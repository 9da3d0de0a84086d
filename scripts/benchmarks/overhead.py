"""Framework overhead: Kiln's training loop (`Trainer.fit`) vs a hand-written PyTorch loop on llm_tiny."""

from __future__ import annotations

import contextlib
import functools
import time

import torch
import torch.nn.functional as F

from common.metrics import read_metrics
from common.optim import lr_factor
from recipes.llm.data import local_batch
from recipes.llm.model import Transformer
from recipes.llm.train import LLMTrainer
from scripts.benchmarks.harness import build_trainer, quiet, sync, take
from scripts.benchmarks.report import Section, Target, md_table, median, ms, say

TARGET_OVERHEAD = 1.03  # Kiln loop iteration / bare PyTorch step


def bare_step(model, opt, *, grad_clip: float | None, sched=None, autocast: torch.dtype | None = None):
    """A hand-written training step of a Kiln Llama on packed rows (`PackedBatch.model_inputs("sdpa")`): forward
    (under `autocast` when given), token-mean cross-entropy, backward, clip, optimizer and LR step; returns the
    loss, detached. It shares none of Kiln's step code: it is the reference that this section and
    scripts/gpu_check.py's bare row (the ~1B model on a GPU) measure Kiln's step against."""

    def step(inputs: dict) -> torch.Tensor:
        device = inputs["input_ids"].device.type
        with torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext():
            logits = model(inputs["input_ids"], position_ids=inputs["position_ids"], attn_mask=inputs["attention_mask"])
        labels = inputs["labels"][:, 1:]
        loss_sum = F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        loss = loss_sum / (labels != -100).sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def bare_llm(trainer):
    """What llm_tiny's step computes, by hand (`bare_step`), on its own model with the same initial
    weights: pack, forward, token-mean cross-entropy, backward, clip, AdamW, LR schedule."""
    cfg, o = trainer.cfg, trainer.cfg.optim
    model = Transformer(trainer.args).to(trainer.device)
    model.init_weights(seed=cfg.trainer.seed)  # the recipe's seed checkpoint
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, foreach=True
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(lr_factor, cfg=o, max_steps=cfg.trainer.max_steps))
    train = bare_step(model, opt, grad_clip=o.grad_clip, sched=sched)
    pad = trainer.tokenizer.pad_token_id

    def step(documents) -> float:
        packed = local_batch(documents, dp_rank=0, dp=1, max_seq_len=cfg.data.max_seq_len, pad_id=pad)
        return train(packed.model_inputs("sdpa", device=trainer.device)).item()

    return step


class InterleavedTrainer(LLMTrainer):
    """llm_tiny's Trainer with the bare loop beside it: its after_step hook runs the bare steps between
    Kiln's, in the order K0 B0 B1 K1 K2 B2 B3 K3 ..., so each loop goes first half of the time. A Kiln
    loop iteration is what lies between two hooks."""

    def __init__(self, cfg, dist, run_dir):
        super().__init__(cfg, dist, run_dir)
        # Both loops get the documents the recipe's loader yields, read into memory up front: this section
        # measures the loop and the trainer; the loader's own cost is the data-wait section's.
        self.documents = take(self, self.cfg.trainer.max_steps)
        self.bare_step = bare_llm(self)
        self.marks, self.bare_times, self.bare_losses = [], [], []

    def after_step(self) -> None:
        super().after_step()
        hook_start, i = time.perf_counter(), self.state.step - 1
        for j in (i, i + 1) if i % 2 == 0 else ():
            if j < len(self.documents):
                start = time.perf_counter()
                self.bare_losses.append(self.bare_step(self.documents[j]))
                sync()
                self.bare_times.append(time.perf_counter() - start)
        self.marks.append((hook_start, time.perf_counter()))


def run(opts) -> Section:
    warmup, steps = opts.pick(3, 1), opts.pick(20, 3)
    total = warmup + steps
    run_dir = opts.work / "overhead"
    batch = opts.pick([], ["trainer.micro_batch_size=4"])
    trainer = build_trainer(
        opts, "llm_tiny", ["trainer.log_every=1", f"trainer.max_steps={total}", *batch], run_dir, cls=InterleavedTrainer
    )
    say(f"overhead: llm_tiny, {total} steps each ({warmup} warm-up), Kiln and bare interleaved")
    with quiet(opts.log):
        trainer.fit(batches=trainer.documents)
    records = read_metrics(run_dir / "metrics.jsonl")
    timed = range(max(1, warmup), total)  # loop iteration i runs from the end of hook i-1 to the start of hook i
    marks, bare = trainer.marks, trainer.bare_times[timed.start :]
    kiln_step = [records[i]["step_time_s"] for i in timed]
    kiln_loop = [marks[i][0] - marks[i - 1][1] for i in timed]
    loss_diff = max(abs(r["loss"] - b) / abs(b) for r, b in zip(records, trainer.bare_losses))
    return section(trainer, bare, kiln_step, kiln_loop, loss_diff)


def section(trainer, bare, kiln_step, kiln_loop, loss_diff) -> Section:
    def paired(xs):  # per-step ratios: both loops ran the same documents at step i
        return median(x / b for x, b in zip(xs, bare))

    cfg = trainer.cfg
    rows = [
        ["bare PyTorch loop", "pack + forward + backward + clip + AdamW + LR step", ms(median(bare)), "1.000"],
        [
            "Kiln `train_step`",
            "+ batch iterator, phase timers, token all-reduce (gloo, group of one); metrics.jsonl `step_time_s`",
            ms(median(kiln_step)),
            f"{paired(kiln_step):.3f}",
        ],
        [
            "Kiln loop iteration",
            "+ metrics.jsonl/TensorBoard record, heartbeat, fault and stop-signal checks (`Trainer.fit`)",
            ms(median(kiln_loop)),
            f"{paired(kiln_loop):.3f}",
        ],
    ]
    s = Section("overhead", "Framework overhead: Kiln's training loop vs a bare PyTorch loop (llm_tiny)")
    s.tables.append(md_table(["loop", "a step includes", "median ms", "vs bare"], rows))
    s.targets.append(
        Target(
            f"Kiln loop iteration <= {TARGET_OVERHEAD:.2f}x bare step",
            f"{paired(kiln_loop):.3f}x ({ms(median(kiln_loop))} vs {ms(median(bare))} ms)",
            paired(kiln_loop) <= TARGET_OVERHEAD,
        )
    )
    s.notes.append(
        f"{len(bare)} steps each after warm-up, one process, {torch.get_num_threads()} torch threads for "
        f"both; micro batch {cfg.trainer.micro_batch_size} rows x {cfg.data.max_seq_len} tokens, "
        f"trainer.log_every=1 (every step logged: the worst case); steps interleaved K0 B0 B1 K1 K2 B2 ... "
        f"(each loop first half the time), 'vs bare' is the median of per-step ratios (same documents "
        f"at each step)."
    )
    s.notes.append(f"same math: the two loops' per-step losses differ by at most {loss_diff:.1e} (relative)")
    s.data = {"bare_s": bare, "kiln_train_step_s": kiln_step, "kiln_loop_s": kiln_loop, "max_loss_rel_diff": loss_diff}
    return s
