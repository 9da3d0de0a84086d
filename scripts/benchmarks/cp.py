"""Context parallelism (parallel.cp, cp_method=allgather) on CPU: llm_tiny at cp=1 (one process) and cp=2 (two gloo
ranks) on the same rows: the bytes each rank sends in the cp exchange, counted from the collectives themselves,
against the all-gather formula; training tokens/s; the activation bytes each rank keeps for backward.

On CPU the exchange is a gloo copy between two processes on shared cores, so the tokens/s row checks that the
accounting holds (the same global tokens per step under both layouts), not what cp buys on GPUs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from scripts.benchmarks.report import Section, Target, md_table, median, mib, ms, say

CP = 2
DIRECTIONS = (("all_gather", "forward: all-gather of K, V"), ("reduce_scatter", "backward: reduce-scatter of dK, dV"))
TARGET_ACTIVATIONS = 0.6  # cp=2 keeps at most this fraction of cp=1's activation bytes per rank (goal: about half)


@dataclass(frozen=True)
class Config:
    steps: int = 10  # timed steps per layout
    warmup: int = 1  # steps before them; their exchange is the one counted
    micro_batch_size: int = 8  # documents per step (llm_tiny's own)


QUICK = Config(steps=2, micro_batch_size=4)


class SentBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes this rank sends in the functional collectives over one process group while the mode is on: an
    all-gather sends the rank's input to each of the other ``n - 1`` ranks, a reduce-scatter all of its input but the
    ``1/n`` it keeps (the volume of a ring or a direct exchange alike). Counted from the tensors the collectives are
    handed, at dispatch (the backward's too: autograd runs them on this thread), so FSDP2's own collectives (c10d ops,
    their own group) are not mixed in."""

    def __init__(self, group):
        super().__init__()
        self.group_name = group.group_name
        self.sent = {"all_gather": 0, "reduce_scatter": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name == "_c10d_functional::all_gather_into_tensor" and args[2] == self.group_name:
            self.sent["all_gather"] += args[0].nbytes * (args[1] - 1)
        elif name == "_c10d_functional::reduce_scatter_tensor" and args[3] == self.group_name:
            self.sent["reduce_scatter"] += args[0].nbytes * (args[2] - 1) // args[2]
        return func(*args, **(kwargs or {}))


def _layout(opts, cp: int, cfg: Config) -> dict:
    """One rank of llm_tiny at parallel.cp=cp: the exchange of its warm-up steps (with their rows), its step times
    and global tokens after them, and the bytes one forward + loss keeps for backward (the AC bench's meter)."""
    import torch.distributed as tdist

    from scripts.benchmarks.ac import saved_bytes
    from scripts.benchmarks.harness import build_trainer, step_timer, take, timed_step

    rank = tdist.get_rank()
    trainer = build_trainer(
        opts,
        "llm_tiny",
        [f"parallel.cp={cp}", f"trainer.micro_batch_size={cfg.micro_batch_size}"],
        opts.work / f"cp{cp}_rank{rank}",
    )
    batches, timer = take(trainer, cfg.warmup + cfg.steps), step_timer()
    counter = SentBytes(trainer.mesh["cp"].get_group()) if cp > 1 else None
    rows, times, tokens = [], [], []
    for i, batch in enumerate(batches):
        if i < cfg.warmup:  # counted, not timed: the counter sees every op
            rows.append(trainer.prepare(batch).packed.num_rows)
            with counter or contextlib.nullcontext():
                timed_step(trainer, batch, timer)
            continue
        seconds, stats, _ = timed_step(trainer, batch, timer)
        times.append(seconds)
        tokens.append(int(stats.tokens))
    return {
        "rank": rank,
        "saved_bytes": saved_bytes(trainer, batches[0]),
        "counted_rows": rows,
        "row_len": trainer.cfg.data.max_seq_len,
        "sent": counter.sent if counter is not None else None,
        "step_s": times,
        "tokens": tokens,
    }


def formula_bytes(rows: int, row_len: int, cp: int) -> int:
    """What cp_method=allgather must send per rank and pass, summed over llm_tiny's layers: the rank's keys and
    values, ``rows x row_len/cp x n_kv_heads x head_dim`` fp32 each, to the ``cp - 1`` other ranks (forward: the
    all-gather; backward: the reduce-scatter of their gradients sends the same volume)."""
    from common.launch import compose

    m = compose(["recipe=llm_tiny"]).model
    per_tensor = rows * row_len // cp * m.n_kv_heads * (m.dim // m.n_heads) * 4
    return m.n_layers * 2 * per_tensor * (cp - 1)


def run(opts, cfg: Config | None = None) -> Section:
    from common.tools.launcher import spawn_ranks
    from scripts.benchmarks.harness import fresh_dir

    cfg = cfg or opts.pick(Config(), QUICK)
    s = Section("cp", f"Context parallelism: llm_tiny at cp=1 and cp={CP} on the same rows")
    results = {}
    for cp in (1, CP):
        say(f"cp: llm_tiny parallel.cp={cp} on {cp} rank(s), {cfg.warmup}+{cfg.steps} steps")
        results[cp] = spawn_ranks(_layout, (opts, cp, cfg), cp, fresh_dir(opts.work / f"cp{cp}_results"), opts.threads)
    one, split = results[1][0], results[CP]

    # (a) the exchange, per rank, beside the formula on the rows of the same steps
    exchange, ratios = [], []
    for r in split:
        want = sum(formula_bytes(n, r["row_len"], CP) for n in r["counted_rows"])
        for kind, direction in DIRECTIONS:
            got = r["sent"][kind]
            ratios.append(got / want)
            exchange.append([r["rank"], direction, f"{got:,}", f"{want:,}", f"{got / want:.3f}"])
    s.tables.append(
        md_table(["rank", "collective", "counted bytes sent", "formula bytes", "counted / formula"], exchange)
    )
    s.targets.append(
        Target(
            f"cp={CP} exchange bytes per rank = the all-gather formula (forward and backward)",
            ", ".join(f"{x:.3f}" for x in ratios),
            all(abs(x - 1) < 1e-9 for x in ratios),
        )
    )

    # (b) tokens/s on the same rows (the same global tokens per step) and (c) activation bytes per rank
    step = {1: one["step_s"], CP: [max(per_rank) for per_rank in zip(*(r["step_s"] for r in split))]}
    rate = {cp: median(t / dt for t, dt in zip(one["tokens"], step[cp])) for cp in step}
    same_tokens = all(r["tokens"] == one["tokens"] for r in split)
    rows = [["1 (1 process)", "0", ms(median(step[1])), f"{rate[1]:,.0f}", "1.00x", mib(one["saved_bytes"]), "1.00"]]
    for r in split:
        rows.append(
            [
                f"{CP} ({CP} gloo ranks)",
                r["rank"],
                ms(median(step[CP])),
                f"{rate[CP]:,.0f}",
                f"{rate[CP] / rate[1]:.2f}x",
                mib(r["saved_bytes"]),
                f"{r['saved_bytes'] / one['saved_bytes']:.2f}",
            ]
        )
    s.tables.append(
        md_table(
            ["cp", "rank", "step ms (median)", "tokens/s (global)", "vs cp=1", "activations per rank", "vs cp=1"], rows
        )
    )
    worst = max(r["saved_bytes"] for r in split) / one["saved_bytes"]
    s.targets.append(
        Target(
            f"cp={CP} keeps <= {TARGET_ACTIVATIONS:.0%} of cp=1's activation bytes per rank (goal about half)",
            f"{worst:.2f}",
            worst <= TARGET_ACTIVATIONS,
        )
    )
    s.targets.append(
        Target(
            f"cp={CP} trains the same global tokens per step as cp=1 (tokens/s is accounting on CPU, not speed)",
            f"{sum(one['tokens']):,} tokens over {len(one['tokens'])} steps, {'equal' if same_tokens else 'DIFFERENT'}",
            same_tokens,
        )
    )
    s.notes.append(
        f"Exchange: the bytes each rank's functional collectives over the cp group sent in its {cfg.warmup} warm-up "
        f"step(s) (forward and backward; SentBytes, at dispatch; FSDP2's collectives excluded), against layers x 2 "
        f"(K, V) x rows x L/cp x n_kv_heads x head_dim x 4 bytes x (cp-1) per pass, on the rows of the same steps. "
        "With toggles.activation_checkpointing=full the backward's recomputed forward all-gathers once more."
    )
    s.notes.append(
        f"tokens/s: global real tokens over the step time (cp={CP}: the slower rank's), {cfg.steps} steps after "
        f"{cfg.warmup} warm-up, cp=1 then cp={CP} (not interleaved: different process groups), {opts.threads} "
        f"thread(s) per process, on a shared CPU: an accounting check (equal tokens per step), not a speed claim."
    )
    s.notes.append(
        "Activations: storages created by one forward + loss (packing included) and alive when it returns "
        "(common/tools/activations.py, as the ac section); weights (FSDP2's unsharded root weights under cp), the "
        "batch and the output excluded. Under cp a rank keeps its L/cp tokens' activations and mask rows, plus the "
        "gathered keys/values of the whole row (SDPA's inputs) per layer: that is why it is not exactly half."
    )
    s.data = {
        "cp1": one,
        f"cp{CP}": split,
        "exchange_ratio": ratios,
        "tokens_per_s": {str(k): v for k, v in rate.items()},
    }
    return s
