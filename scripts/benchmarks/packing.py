"""Sequence packing vs padding: a tiny Llama trained on one long-tailed sample stream, padded vs packed, side by side.

Length distributions: `lognormal` (median `median_len`, `sigma`; every token labelled) and `llava`,
multi-turn image conversations shaped like LLaVA-1.5's instruct mix (`llava_stream`): an image's tokens
(576 of 2048 in LLaVA-1.5, scaled to `max_seq_len`), Geometric(0.4) rounds (1, 2, ...; mean 2.5) of a
short question and a longer answer (lognormal), every tenth conversation text-only; labels on the
answers only. Image tokens are plain tokens here: the tower's cost does not depend on the layout.

Both modes see the SAME samples at every step (same micro batch, same label tokens, so the same
loss); only the layout differs. Padded: one sample per row, rows padded to the longest sample of
the micro batch (pad_samples). Packed: FFD rows of exactly max_seq_len (pack_samples). Each mode
has its own copy of the same initial model and its own AdamW; steps alternate between the modes
(and which one goes first) so machine noise hits both alike. The timed step is forward + backward
+ optimizer; building the batch (done by data workers in a real run) is reported apart.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from dataclasses import dataclass

import torch

from scripts.benchmarks.report import Section, Target, md_table, say

TARGET_UTILIZATION = 0.95
TARGET_SPEEDUP = 1.5
LOSS_TOLERANCE = 1e-5  # same samples, same initial weights: step 0's loss agrees in both modes
DISTRIBUTIONS = ("lognormal", "llava")  # a long-tailed text stream; LLaVA-1.5-shaped conversations


@dataclass(frozen=True)
class Config:
    steps: int = 8  # timed steps per mode (after warm-up)
    warmup: int = 1
    max_seq_len: int = 512
    samples_per_step: int = 96  # same for both modes; large enough that the partly filled last packed row wastes little
    median_len: float = 64.0  # lognormal
    sigma: float = 1.0  # lognormal: larger = longer tail
    image_tokens: int | None = None  # llava; default: LLaVA-1.5's 576 per 2048, scaled to max_seq_len
    attention: str = "sdpa"
    hidden: int = 64
    layers: int = 2
    vocab: int = 512
    seed: int = 0


QUICK = Config(steps=2, samples_per_step=32, max_seq_len=256)


def sample_stream(steps: int, per_step: int, max_seq_len: int, median: float, sigma: float, vocab: int, seed: int):
    """Per step, a list of samples whose lengths are lognormal(median, sigma) clipped to [8, max_seq_len]."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        z = torch.randn(per_step, generator=g)
        lengths = (median * torch.exp(sigma * z)).round().clamp(8, max_seq_len).long().tolist()
        samples = []
        for n in lengths:
            ids = torch.randint(1, vocab, (n,), generator=g)
            samples.append({"input_ids": ids, "labels": ids.clone()})
        yield samples


def llava_stream(steps: int, per_step: int, max_seq_len: int, image_tokens: int, vocab: int, seed: int):
    """Per step, LLaVA-style conversations (module docstring), cut at max_seq_len as the recipe cuts them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        samples = []
        for _ in range(per_step):
            ids, labels = [rng.integers(1, vocab, 12)], [np.full(12, -100)]  # system prompt + first header
            if rng.random() >= 0.1:
                ids.append(rng.integers(1, vocab, image_tokens))
                labels.append(np.full(image_tokens, -100))
            for _ in range(rng.geometric(0.4)):  # rounds: 1, 2, ... (mean 2.5)
                question = rng.integers(1, vocab, int(np.clip(rng.lognormal(np.log(14), 0.6), 3, 120)))
                answer = rng.integers(1, vocab, int(np.clip(rng.lognormal(np.log(40), 1.0), 1, 600)))
                ids += [question, answer]
                labels += [np.full(len(question), -100), answer]
            ids, labels = np.concatenate(ids)[:max_seq_len], np.concatenate(labels)[:max_seq_len]
            samples.append({"input_ids": torch.from_numpy(ids).long(), "labels": torch.from_numpy(labels).long()})
        yield samples


def stream(cfg: Config, distribution: str) -> tuple[str, object]:
    """(a description of the lengths, the per-step sample lists) of one distribution."""
    total = cfg.warmup + cfg.steps
    if distribution == "llava":
        image_tokens = cfg.image_tokens or round(576 * cfg.max_seq_len / 2048)
        return (
            f"LLaVA-style conversations ({image_tokens} image tokens, Geometric(0.4) rounds, 10% text-only, "
            f"labels on answers) cut at {cfg.max_seq_len}",
            llava_stream(total, cfg.samples_per_step, cfg.max_seq_len, image_tokens, cfg.vocab, cfg.seed),
        )
    return (
        f"lengths lognormal(median {cfg.median_len:g}, sigma {cfg.sigma:g}) in [8, {cfg.max_seq_len}]",
        sample_stream(total, cfg.samples_per_step, cfg.max_seq_len, cfg.median_len, cfg.sigma, cfg.vocab, cfg.seed),
    )


def measure(cfg: Config, distribution: str) -> dict:
    """Both modes stepped alternately on the same samples: per mode its step and collate times, real
    tokens per step, token slots, row shapes and losses (warm-up steps' losses included)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.data.packing import pack_samples, pad_samples

    torch.manual_seed(cfg.seed)
    config = LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=4 * cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=max(1, cfg.hidden // 32),
        num_key_value_heads=max(1, cfg.hidden // 64),
        max_position_embeddings=cfg.max_seq_len,
        pad_token_id=0,
        attn_implementation=cfg.attention,
    )
    base = LlamaForCausalLM(config).train()
    collate = {
        "padded": lambda s: pad_samples(s, pad_id=0),
        "packed": lambda s: pack_samples(s, cfg.max_seq_len, pad_id=0),
    }
    models = {mode: copy.deepcopy(base) for mode in collate}
    optims = {mode: torch.optim.AdamW(models[mode].parameters(), lr=1e-3) for mode in collate}
    stats = {
        mode: {"time": [], "collate": [], "real_steps": [], "slots": 0, "rows": [], "loss": []} for mode in collate
    }
    lengths, samples_per_step = stream(cfg, distribution)
    for step, samples in enumerate(samples_per_step):
        for mode in list(collate) if step % 2 == 0 else list(reversed(collate)):
            t0 = time.perf_counter()
            batch = collate[mode](samples)
            inputs = batch.model_inputs(cfg.attention)
            t1 = time.perf_counter()
            loss = models[mode](**inputs).loss
            loss.backward()
            optims[mode].step()
            optims[mode].zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            st = stats[mode]
            st["loss"].append(loss.item())
            if step >= cfg.warmup:
                st["time"].append(t2 - t1)
                st["collate"].append(t1 - t0)
                st["real_steps"].append(batch.num_real_tokens)
                st["slots"] += batch.input_ids.numel()
                st["rows"].append(tuple(batch.input_ids.shape))
    return {"lengths": lengths, "params": sum(p.numel() for p in base.parameters()), "modes": stats}


def add_distribution(s: Section, cfg: Config, distribution: str, measured: dict) -> None:
    stats = measured["modes"]
    # Median of per-step rates: robust to the odd slow step on a shared machine. Both modes run the
    # same samples, so their per-step real-token counts are equal and the ratio compares step times.
    rate = {m: statistics.median(r / t for r, t in zip(st["real_steps"], st["time"])) for m, st in stats.items()}
    util = {m: sum(st["real_steps"]) / st["slots"] for m, st in stats.items()}
    speedup = rate["packed"] / rate["padded"]
    rows = []
    for mode, st in stats.items():
        shape = f"{statistics.median(r for r, _ in st['rows']):g} x {statistics.median(n for _, n in st['rows']):g}"
        rows.append(
            [
                mode,
                shape,
                f"{util[mode]:.1%}",
                f"{statistics.median(st['time']) * 1e3:.0f} ms",
                f"{statistics.median(st['collate']) * 1e3:.1f} ms",
                f"{rate[mode]:,.0f}",
                f"{rate[mode] / rate['padded']:.2f}x",
            ]
        )
    l0 = stats["padded"]["loss"][0], stats["packed"]["loss"][0]
    rel = abs(l0[0] - l0[1]) / abs(l0[0])
    s.notes.append(
        f"--distribution {distribution}: {cfg.warmup + cfg.steps} steps/mode ({cfg.warmup} warm-up), "
        f"{cfg.samples_per_step} samples/step, {measured['lengths']}, Llama {measured['params'] / 1e6:.2f}M "
        f"params, attention={cfg.attention}, {torch.get_num_threads()} threads, load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    s.tables.append(
        md_table(
            [
                "mode",
                "rows x len (median)",
                "token utilization",
                "step time (median)",
                "collate (median)",
                "real tokens/s (median)",
                "vs padded",
            ],
            rows,
        )
    )
    s.targets.append(
        Target(
            f"{distribution}: packed utilization >= {TARGET_UTILIZATION:.0%}",
            f"{util['packed']:.1%}",
            util["packed"] >= TARGET_UTILIZATION,
        )
    )
    s.targets.append(
        Target(
            f"{distribution}: packed tokens/s >= {TARGET_SPEEDUP:.1f}x padded",
            f"{speedup:.2f}x",
            speedup >= TARGET_SPEEDUP,
        )
    )
    s.notes.append(
        f"{distribution} check: step-0 loss padded {l0[0]:.7f} vs packed {l0[1]:.7f} (rel diff {rel:.1e}) "
        f"-> {'OK' if rel <= LOSS_TOLERANCE else 'MISMATCH'}"
    )
    s.data[distribution] = {
        "utilization": util,
        "tokens_per_s": rate,
        "speedup": speedup,
        "step0_loss_rel_diff": rel,
        "step_s": {m: st["time"] for m, st in stats.items()},
    }
    if rel > LOSS_TOLERANCE:  # the two layouts did not compute the same step: the timings compare nothing
        raise RuntimeError(f"packing, {distribution}: step-0 losses differ by {rel:.1e} (relative) between modes")


def run(opts, cfg: Config | None = None) -> Section:
    cfg = cfg or opts.pick(Config(), QUICK)
    s = Section("packing", "Sequence packing vs padding")
    for distribution in DISTRIBUTIONS:
        say(
            f"packing: {distribution}, {cfg.warmup + cfg.steps} steps per mode, {cfg.samples_per_step} samples/step, "
            f"rows of {cfg.max_seq_len}"
        )
        add_distribution(s, cfg, distribution, measure(cfg, distribution))
    return s
