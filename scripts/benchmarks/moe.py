"""Mixture of Experts on CPU: the experts' grouped GEMM against a loop over experts on the same shapes and
routing (forward + backward), and moe_tiny on 2 gloo ranks with the experts split (parallel.ep=2) against
replicated (ep=1, FSDP2 over both ranks), in training tokens/s. A smoke figure: on CPU the all-to-all is a
gloo copy between two processes, so it says that expert parallelism runs, not what it buys on GPUs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from scripts.benchmarks.harness import fresh_dir, train_run
from scripts.benchmarks.report import Section, md_table, say


@dataclass(frozen=True)
class Config:
    shapes: tuple[tuple[int, int, int, int, int], ...] = ((1024, 128, 128, 8, 2), (4096, 256, 512, 16, 4))  # T, D, F, E, k
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
        rows.append([f"{tokens} x {dim}, F {ffn}, {experts} experts, top-{top_k}", f"{grouped * 1e3:.1f}",
                     f"{looped * 1e3:.1f}", f"{looped / grouped:.2f}x"])
        data.append({"tokens": tokens, "dim": dim, "ffn": ffn, "experts": experts, "top_k": top_k,
                     "grouped_s": grouped, "loop_s": looped})
    s.tables.append(md_table(["experts' shapes (tokens x dim)", "grouped GEMM ms", "loop over experts ms",
                              "loop / grouped"], rows))
    s.notes.append(f"Experts' forward + backward (SwiGLU, fp32, random routing), best of {cfg.repeat}: "
                   "torch._grouped_mm (one call per projection) against one F.linear per expert.")
    s.data["grouped_gemm"] = data


def ep_table(opts, cfg: Config, work: Path, s: Section) -> None:
    rates = {}
    for ep in (1, 2):
        records = train_run(opts, "moe_tiny", [f"trainer.max_steps={cfg.steps}", "trainer.log_every=1",
                                               "parallel.dp=2", f"parallel.ep={ep}"], work / f"ep{ep}", nproc=2)
        later = [r["tokens_per_s"] for r in records if r["step"] > 2]  # past the first steps (FLOP counting, warm-up)
        rates[ep] = sorted(later)[len(later) // 2]
        say(f"moe: moe_tiny dp=2 ep={ep}: {rates[ep]:.0f} tokens/s (median)")
    s.tables.append(md_table(["moe_tiny on 2 ranks", "tokens/s (median step)", "vs ep=1"],
                             [[f"parallel.ep={ep}", f"{rates[ep]:.0f}", f"{rates[ep] / rates[1]:.2f}x"] for ep in (1, 2)]))
    s.notes.append(f"moe_tiny, 2 gloo ranks (parallel.dp=2), {cfg.steps} steps, median tokens/s after step 2: ep=2 "
                   f"holds 4 of 8 experts per rank and exchanges tokens by all-to-all; ep=1 holds all 8 (FSDP2).")
    s.data["ep"] = {str(k): v for k, v in rates.items()}


def run(opts, cfg: Config | None = None) -> Section:
    cfg = cfg or opts.pick(Config(), QUICK)
    work = fresh_dir(opts.work / "moe")
    s = Section("moe", "Mixture of Experts: grouped GEMM vs a loop over experts; expert parallelism on 2 CPU ranks")
    gemm_table(cfg, s)
    ep_table(opts, cfg, work, s)
    return s
