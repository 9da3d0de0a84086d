"""Mixture of Experts on CPU: the experts' grouped GEMM against a loop over experts on the same shapes and
routing (forward + backward), and moe_tiny on 2 gloo ranks with the experts split (parallel.ep=2) against
replicated (ep=1, FSDP2 over both ranks), in training tokens/s, and the all-to-all bytes of a step measured against
the formula. A smoke figure: on CPU the all-to-all is a gloo copy between two processes, so it says that expert
parallelism runs, not what it buys on GPUs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from scripts.benchmarks.harness import fresh_dir, train_run
from scripts.benchmarks.report import Section, md_table, say


@dataclass(frozen=True)
class Config:
    shapes: tuple[tuple[int, int, int, int, int], ...] = (
        (1024, 128, 128, 8, 2),
        (4096, 256, 512, 16, 4),
    )  # T, D, F, E, k
    repeat: int = 5
    steps: int = 20  # moe_tiny steps per layout


QUICK = Config(shapes=((1024, 128, 128, 8, 2),), repeat=2, steps=6)


def experts_fwd_bwd(grouped: bool, tokens: int, dim: int, ffn: int, experts: int, top_k: int, repeat: int) -> float:
    """Best seconds of forward + backward of one MoE layer's experts (SwiGLU) on routed rows, grouped or looped."""
    import torch
    import torch.nn.functional as F

    from recipes.llm.model import GroupedExperts

    g = torch.Generator().manual_seed(0)
    layer = GroupedExperts(dim, ffn, experts)  # rows arrive sorted by expert: `counts` per expert
    for w in (layer.w1, layer.w2, layer.w3):
        torch.nn.init.normal_(w, std=0.02, generator=g)
    choice = torch.randint(0, experts, (tokens * top_k,), generator=g)
    counts = torch.bincount(choice, minlength=experts)
    x = torch.randn(tokens * top_k, dim, generator=g, requires_grad=True)

    def looped(rows: torch.Tensor) -> torch.Tensor:
        out = []
        for e, part in enumerate(rows.split(counts.tolist())):
            out.append(F.linear(F.silu(F.linear(part, layer.w1[e])) * F.linear(part, layer.w3[e]), layer.w2[e]))
        return torch.cat(out)

    times = []
    for _ in range(repeat + 1):  # the first is a warm-up
        start = time.perf_counter()
        y = layer(x, counts) if grouped else looped(x)
        y.square().mean().backward()
        times.append(time.perf_counter() - start)
        x.grad = None
        layer.zero_grad()
    return min(times[1:])


def gemm_table(cfg: Config, s: Section) -> None:
    rows, data = [], []
    for tokens, dim, ffn, experts, top_k in cfg.shapes:
        grouped = experts_fwd_bwd(True, tokens, dim, ffn, experts, top_k, cfg.repeat)
        looped = experts_fwd_bwd(False, tokens, dim, ffn, experts, top_k, cfg.repeat)
        say(f"moe: grouped GEMM {grouped * 1e3:.1f} ms, loop {looped * 1e3:.1f} ms ({tokens}x{dim}, {experts} experts)")
        rows.append(
            [
                f"{tokens} x {dim}, F {ffn}, {experts} experts, top-{top_k}",
                f"{grouped * 1e3:.1f}",
                f"{looped * 1e3:.1f}",
                f"{looped / grouped:.2f}x",
            ]
        )
        data.append(
            {
                "tokens": tokens,
                "dim": dim,
                "ffn": ffn,
                "experts": experts,
                "top_k": top_k,
                "grouped_s": grouped,
                "loop_s": looped,
            }
        )
    s.tables.append(
        md_table(["experts' shapes (tokens x dim)", "grouped GEMM ms", "loop over experts ms", "loop / grouped"], rows)
    )
    s.notes.append(
        f"Experts' forward + backward (SwiGLU, fp32, random routing), best of {cfg.repeat}: "
        "torch._grouped_mm (one call per projection) against one F.linear per expert."
    )
    s.data["grouped_gemm"] = data


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def ep_table(opts, cfg: Config, work: Path, s: Section) -> None:
    rates = {}
    for ep in (1, 2):
        records = train_run(
            opts,
            "moe_tiny",
            [f"trainer.max_steps={cfg.steps}", "trainer.log_every=1", "parallel.dp=2", f"parallel.ep={ep}"],
            work / f"ep{ep}",
            nproc=2,
        )
        later = [r for r in records if r["step"] > 2]  # past the first steps (FLOP counting, warm-up)
        rates[ep] = median([r["tokens_per_s"] for r in later])
        say(f"moe: moe_tiny dp=2 ep={ep}: {rates[ep]:.0f} tokens/s (median)")
        if ep > 1:
            all_to_all_table(opts, later, ep, s)
    s.tables.append(
        md_table(
            ["moe_tiny on 2 ranks", "tokens/s (median step)", "vs ep=1"],
            [[f"parallel.ep={ep}", f"{rates[ep]:.0f}", f"{rates[ep] / rates[1]:.2f}x"] for ep in (1, 2)],
        )
    )
    s.notes.append(
        f"moe_tiny, 2 gloo ranks (parallel.dp=2), {cfg.steps} steps, median tokens/s after step 2: ep=2 "
        f"holds 4 of 8 experts per rank and exchanges tokens by all-to-all; ep=1 holds all 8 (FSDP2)."
    )
    s.data["ep"] = {str(k): v for k, v in rates.items()}


def all_to_all_table(opts, records: list[dict], ep: int, s: Section) -> None:
    """The bytes rank 0's forward all-to-alls sent to the other ranks per step, counted from their split sizes
    (metrics moe.all_to_all_bytes), against the uniform-routing formula: tokens x top_k x dim x dtype bytes x 2
    (dispatch, combine) x (ep - 1) / ep per MoE layer, with rank 0's tokens (its token slots, padding included: every
    slot is routed) from its dispatched rows (moe.dispatched_rows = tokens x top_k x MoE layers)."""
    from recipes.llm.train import llama_args
    from scripts.kiln.launch import compose

    cfg = compose(["recipe=moe_tiny"])
    m, args = cfg.model, llama_args(cfg, vocab_size=1)
    moe_layers = sum(map(args.is_moe_layer, range(args.n_layers)))
    dtype_bytes = 4  # fp32 on CPU
    rows, ratios = [], []
    for r in records:
        tokens = r["moe.dispatched_rows"] / (m.moe.top_k * moe_layers)
        formula = tokens * m.moe.top_k * m.dim * dtype_bytes * 2 * (ep - 1) / ep * moe_layers
        ratios.append(r["moe.all_to_all_bytes"] / formula)
        rows.append((r["moe.all_to_all_bytes"], formula, tokens))
    measured, formula, tokens = (median([row[i] for row in rows]) for i in range(3))
    ratio = median(ratios)
    say(
        f"moe: all-to-all bytes per step (rank 0, forward) measured {measured / 1e6:.3f} MB / formula "
        f"{formula / 1e6:.3f} MB = {ratio:.3f}"
    )
    s.tables.append(
        md_table(
            ["moe_tiny ep=2, rank 0, per step", "measured MB", "formula MB", "measured / formula"],
            [
                [
                    f"{tokens:.0f} tokens x top-{m.moe.top_k} x dim {m.dim} x {moe_layers} MoE layers",
                    f"{measured / 1e6:.3f}",
                    f"{formula / 1e6:.3f}",
                    f"{ratio:.3f}",
                ]
            ],
        )
    )
    s.notes.append(
        "All-to-all bytes: what rank 0's dispatch and combine all_to_all_single calls sent to the other rank "
        "in a step's forwards, counted from their split sizes (metrics moe.all_to_all_bytes; the backward "
        "sends as much again), against tokens x top_k x dim x 4 bytes x 2 directions x (ep-1)/ep per MoE "
        "layer, the uniform-routing estimate; medians over the steps after step 2. Off 1.0 by how unevenly "
        "the router splits rank 0's rows between its own experts and the other rank's."
    )
    s.data["all_to_all"] = {"measured_bytes": measured, "formula_bytes": formula, "ratio": ratio}


def run(opts, cfg: Config | None = None) -> Section:
    cfg = cfg or opts.pick(Config(), QUICK)
    work = fresh_dir(opts.work / "moe")
    s = Section("moe", "Mixture of Experts: grouped GEMM vs a loop over experts; expert parallelism on 2 CPU ranks")
    gemm_table(cfg, s)
    ep_table(opts, cfg, work, s)
    return s
