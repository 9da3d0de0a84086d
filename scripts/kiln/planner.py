"""The layout planner behind scripts/plan.py: every dp x tp x pp (x cp) x ZeRO stage x AC layout of a recipe's
model on N GPUs, the per-GPU estimate of each (common/memory.py), those that fit, best first."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from common.memory import Layout, ModelSpec, estimate


@dataclass(frozen=True)
class GPU:
    name: str
    memory: int  # bytes: memory.total as nvidia-smi reports it
    per_node: int = 8


GPUS = {
    g.name: g
    for g in (
        GPU("h100_80gb", 81559 * 2**20),
        GPU("h200_141gb", 143771 * 2**20),
        GPU("a100_80gb", 81920 * 2**20),
        GPU("a100_40gb", 40960 * 2**20),
    )
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(spec: ModelSpec, gpus: int, gpus_per_node: int = 8) -> list[Layout]:
    """dp·tp·pp·cp = gpus with tp inside a node and dividing the heads, pp dividing the layers, cp (where the recipe
    has context parallelism: the LLM, DiT and VLM; not text-to-image, whose `seq` counts the text tokens cp leaves
    whole) splitting each row as its method does (`_splits`) and not combined with ep (not enumerated); every ZeRO
    stage (FSDP: full shard whenever dp·cp > 1, as the LLM recipe does) and AC mode."""
    out = []
    for tp in _divisors(gpus):
        if tp > gpus_per_node or spec.block.heads % tp:
            continue
        for pp in _divisors(gpus // tp):
            if spec.layers % pp or (pp > 1 and spec.more_layers):  # several layer types: not split over stages
                continue
            cps = [c for c in _divisors(gpus // (tp * pp)) if _splits(spec, tp, c)] if spec.context_parallel else [1]
            for cp in cps:
                dp = gpus // (tp * pp * cp)
                eps = [e for e in _divisors(dp) if spec.experts % e == 0] if spec.experts and cp == 1 else [1]
                out += [
                    Layout(dp, tp, pp, stage, ac, ep, cp)
                    for stage in _zero_stages(spec, dp * cp)
                    for ac in spec.ac_modes
                    for ep in eps
                ]
    return out


def _splits(spec: ModelSpec, tp: int, cp: int) -> bool:
    """Whether `cp` ranks can split a row of `spec`: the LLM's allgather cuts it into 2·cp equal chunks (one early and
    one late per rank); an all-to-all (the LLM's alltoall, Ulysses in the DeepSpeed recipes) cuts it into cp pieces
    and hands each rank heads/(tp·cp) of the heads. The recipe's own validation refuses the rest (recipe_allows)."""
    if spec.cp_method == "allgather":
        return spec.seq % (2 * cp) == 0
    return spec.seq % cp == 0 and spec.block.heads % (tp * cp) == 0


def _zero_stages(spec: ModelSpec, dp: int) -> tuple[int, ...]:
    if dp == 1:
        return (0,)  # nothing to shard over
    return (3,) if spec.sharding == "fsdp" else (0, 1, 2, 3)


AC_COST = {"none": 0, "selective": 1, "full": 2}


def rank_key(layout: Layout, total: float) -> tuple:
    """Best first, by a simple throughput heuristic:
    1. less recomputation: full AC re-runs every forward (~+33% FLOPs), selective only cheap ops;
    2. a smaller model-parallel group tp·pp·cp: TP collectives sit on the critical path of every layer,
       PP adds the bubble (p-1)/(m+p-1) (Narayanan et al. 2021), CP all-gathers each layer's keys and values;
    3. at equal tp·pp·cp, less pp (the bubble costs more than intra-node TP), then less tp (CP moves a layer's
       K/V, narrower than TP's activations under GQA);
    4. a lower ZeRO stage: stage 3 gathers the weights in forward and backward, 1.5x the traffic
       of stages 0-2 (Rajbhandari et al. 2020 §7);
    5. less memory."""
    group = layout.tp * layout.pp * layout.cp
    return (AC_COST[layout.ac], group, layout.pp, layout.tp, layout.zero_stage, total, layout.ep)


def plan(
    spec: ModelSpec, gpus: int, gpu: GPU, headroom: float = 0.9, allowed: Callable[[Layout], bool] = lambda layout: True
) -> list[dict]:
    """Every candidate layout the recipe allows, with its per-GPU estimate and whether it fits in
    headroom x the GPU's memory; fitting layouts first, best first."""
    budget = gpu.memory * headroom
    rows = []
    for layout in candidate_layouts(spec, gpus, gpu.per_node):
        if allowed(layout):
            est = estimate(spec, layout)
            rows.append({"layout": layout, **est, "fits": est["total"] <= budget})
    return sorted(rows, key=lambda r: (not r["fits"], rank_key(r["layout"], r["total"])))


FILL_MULTIPLE = 8  # micro batches the fill picks: multiples of 8 (whole tensor-core tiles of rows on any GPU)
FILL_LIMIT = 4096


def fill_micro_batch(spec: ModelSpec, layout: Layout, gpu: GPU, headroom: float = 0.9) -> int:
    """The largest micro batch (a multiple of FILL_MULTIPLE, at most FILL_LIMIT) at which `layout` of `spec` still fits
    in headroom x the GPU's memory, by the same estimate as `plan`; 0 where not even FILL_MULTIPLE fits. The estimate
    grows with the micro batch (activations), so a bisection finds it."""
    budget = gpu.memory * headroom

    def fits(units: int) -> bool:
        sized = dataclasses.replace(spec, micro_batch=units * FILL_MULTIPLE)
        return estimate(sized, layout)["total"] <= budget

    lo, hi = 0, FILL_LIMIT // FILL_MULTIPLE
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo * FILL_MULTIPLE
