#!/usr/bin/env python
"""Benchmark sequence packing: train a tiny Llama on one long-tailed sample stream, padded vs packed, side by side.

    python scripts/bench_packing.py [--steps 8] [--warmup 1] [--max-seq-len 512] [--samples-per-step 96]
                                    [--attention sdpa] [--threads N] [--hidden 64] [--layers 2]
                                    [--distribution lognormal|llava] [--image-tokens 144]

Length distributions: `lognormal` (median --median-len, --sigma; every token labelled) or `llava`,
multi-turn image conversations shaped like LLaVA-1.5's instruct mix (`llava_stream`): an image's tokens
(576 of 2048 in LLaVA-1.5; --image-tokens, scaled to --max-seq-len by default), Geometric(0.4) rounds
(1, 2, ...; mean 2.5) of a short question and a longer answer (lognormal), every tenth conversation
text-only; labels on the answers only. Image tokens are plain tokens here: the tower's cost does not
depend on the layout.

Both modes see the SAME samples at every step (same micro batch, same label tokens, so the same
loss); only the layout differs. Padded: one sample per row, rows padded to the longest sample of
the micro batch (pad_samples). Packed: FFD rows of exactly max_seq_len (pack_samples). Each mode
has its own copy of the same initial model and its own AdamW; steps alternate between the modes
(and which one goes first) so machine noise hits both alike. The timed step is forward + backward
+ optimizer; building the batch (done by data workers in a real run) is reported apart.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TARGET_UTILIZATION = 0.95
TARGET_SPEEDUP = 1.5


def sample_stream(steps: int, per_step: int, max_seq_len: int, median: float, sigma: float, vocab: int, seed: int):
    """Per step, a list of samples whose lengths are lognormal(median, sigma) clipped to [8, max_seq_len]."""
    import torch

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
    import torch

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per mode (after warm-up)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per mode")
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument(
        "--samples-per-step", type=int, default=96,
        help="micro batch in samples, same for both modes; large enough that the partly filled last packed row wastes little",
    )
    ap.add_argument("--median-len", type=float, default=64.0, help="median sample length (lognormal)")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma: larger = longer tail")
    ap.add_argument("--distribution", choices=["lognormal", "llava"], default="lognormal")
    ap.add_argument("--image-tokens", type=int, default=None,
                    help="llava: tokens per image (default: LLaVA-1.5's 576 per 2048, scaled to --max-seq-len)")
    ap.add_argument("--attention", choices=["sdpa", "eager"], default="sdpa")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument(
        "--threads", type=int, default=None,
        help="torch intra-op threads (default: torch's); on a busy machine 1 avoids OpenMP stalls that blur the ratio",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.data.packing import pack_samples, pad_samples

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 32),
        num_key_value_heads=max(1, args.hidden // 64),
        max_position_embeddings=args.max_seq_len,
        pad_token_id=0,
        attn_implementation=args.attention,
    )
    base = LlamaForCausalLM(config).train()
    collate = {
        "padded": lambda s: pad_samples(s, pad_id=0),
        "packed": lambda s: pack_samples(s, args.max_seq_len, pad_id=0),
    }
    models = {mode: copy.deepcopy(base) for mode in collate}
    optims = {mode: torch.optim.AdamW(models[mode].parameters(), lr=1e-3) for mode in collate}
    stats = {mode: {"time": [], "collate": [], "real_steps": [], "slots": 0, "rows": [], "loss": []} for mode in collate}

    total = args.warmup + args.steps
    if args.distribution == "llava":
        image_tokens = args.image_tokens or round(576 * args.max_seq_len / 2048)
        lengths = (f"LLaVA-style conversations ({image_tokens} image tokens, Geometric(0.4) rounds, 10% text-only, "
                   f"labels on answers) cut at {args.max_seq_len}")
        stream = llava_stream(total, args.samples_per_step, args.max_seq_len, image_tokens, args.vocab, args.seed)
    else:
        lengths = f"lengths lognormal(median {args.median_len:g}, sigma {args.sigma:g}) in [8, {args.max_seq_len}]"
        stream = sample_stream(total, args.samples_per_step, args.max_seq_len, args.median_len, args.sigma, args.vocab, args.seed)
    print(
        f"bench_packing: {total} steps/mode ({args.warmup} warm-up), {args.samples_per_step} samples/step, {lengths}, "
        f"Llama {sum(p.numel() for p in base.parameters()) / 1e6:.2f}M params, attention={args.attention}, "
        f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    for step, samples in enumerate(stream):
        modes = list(collate) if step % 2 == 0 else list(reversed(collate))
        for mode in modes:
            t0 = time.perf_counter()
            batch = collate[mode](samples)
            inputs = batch.model_inputs(args.attention)
            t1 = time.perf_counter()
            loss = models[mode](**inputs).loss
            loss.backward()
            optims[mode].step()
            optims[mode].zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            st = stats[mode]
            st["loss"].append(loss.item())
            if step >= args.warmup:
                st["time"].append(t2 - t1)
                st["collate"].append(t1 - t0)
                st["real_steps"].append(batch.num_real_tokens)
                st["slots"] += batch.input_ids.numel()
                st["rows"].append(tuple(batch.input_ids.shape))
        losses = "  ".join(f"{mode} {stats[mode]['loss'][-1]:.6f}" for mode in collate)
        print(f"  step {step}: loss {losses}", flush=True)

    # Median of per-step rates: robust to the odd slow step on a shared machine. Both modes run the
    # same samples, so their per-step real-token counts are equal and the ratio compares step times.
    rate = {m: statistics.median(r / t for r, t in zip(st["real_steps"], st["time"])) for m, st in stats.items()}

    util = {m: sum(st["real_steps"]) / st["slots"] for m, st in stats.items()}
    speedup = rate["packed"] / rate["padded"]
    print()
    print("| mode | rows x len (median) | token utilization | step time (median) | collate (median) "
          "| real tokens/s (median) | vs padded |")
    print("|---|---|---|---|---|---|---|")
    for mode, st in stats.items():
        rows = statistics.median(r for r, _ in st["rows"])
        length = statistics.median(n for _, n in st["rows"])
        step_ms = statistics.median(st["time"]) * 1e3
        collate_ms = statistics.median(st["collate"]) * 1e3
        print(f"| {mode} | {rows:g} x {length:g} | {util[mode]:.1%} | {step_ms:.0f} ms | {collate_ms:.1f} ms "
              f"| {rate[mode]:,.0f} | {rate[mode] / rate['padded']:.2f}x |")

    def verdict(ok: bool) -> str:
        return "MET" if ok else "NOT MET"

    print()
    print(f"target: packed utilization >= {TARGET_UTILIZATION:.0%}: {util['packed']:.1%} "
          f"-> {verdict(util['packed'] >= TARGET_UTILIZATION)}")
    print(f"target: packed tokens/s >= {TARGET_SPEEDUP:.1f}x padded: {speedup:.2f}x -> {verdict(speedup >= TARGET_SPEEDUP)}")
    # Same samples, same initial weights: step 0 must give the same loss in both modes.
    l0 = stats["padded"]["loss"][0], stats["packed"]["loss"][0]
    rel = abs(l0[0] - l0[1]) / abs(l0[0])
    print(f"check: step-0 loss padded {l0[0]:.7f} vs packed {l0[1]:.7f} (rel diff {rel:.1e}) "
          f"-> {'OK' if rel <= 1e-5 else 'MISMATCH'}")
    return 0 if rel <= 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
