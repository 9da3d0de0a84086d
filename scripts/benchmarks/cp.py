"""Context parallelism (parallel.cp) on CPU: llm_tiny at cp=1 (one process) and cp=2 (two gloo ranks, cp_method
allgather and alltoall) on the same rows: the bytes each rank sends in the cp exchange, counted from the collectives
themselves, against each method's formula; training tokens/s; the activation bytes each rank keeps for backward.

On CPU the exchange is a gloo copy between two processes on shared cores, so the tokens/s row checks that the
accounting holds (the same global tokens per step under every layout), not what cp buys on GPUs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from scripts.benchmarks.report import Section, Target, md_table, median, mib, ms, say

CP = 2
METHODS = ("allgather", "alltoall")
PASSES = ("forward", "backward")
TARGET_ACTIVATIONS = 0.6  # cp=2 keeps at most this fraction of cp=1's activation bytes per rank (goal: about half)


@dataclass(frozen=True)
class Config:
    steps: int = 10  # timed steps per layout
    warmup: int = 1  # steps before them; their exchange is the one counted
    micro_batch_size: int = 8  # rows per step (llm_tiny's own)


QUICK = Config(steps=2, micro_batch_size=4)


class SentBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes this rank sends in the functional collectives over one process group while the mode is on, per pass
    (backward: while autograd runs a node): an all-gather sends the rank's input to each of the other ``n - 1`` ranks;
    a reduce-scatter and an even all-to-all all of their input but the ``1/n`` the rank keeps (the volume of a ring or
    a direct exchange alike). Counted from the tensors the collectives are handed, at dispatch (autograd runs the
    backward's on this thread), so FSDP2's own collectives (c10d ops, their own group) are not mixed in."""

    def __init__(self, group):
        super().__init__()
        self.group_name = group.group_name
        self.sent = dict.fromkeys(PASSES, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, sent = func._schema.name, 0
        if name == "_c10d_functional::all_gather_into_tensor" and args[2] == self.group_name:
            sent = args[0].nbytes * (args[1] - 1)
        elif name == "_c10d_functional::reduce_scatter_tensor" and args[3] == self.group_name:
            sent = args[0].nbytes * (args[2] - 1) // args[2]
        elif name == "_c10d_functional::all_to_all_single" and args[3] == self.group_name:
            n = len(args[2])  # input split sizes, one per rank: even in the cp exchange, one block kept
            assert len(set(args[2])) == 1, "an uneven all-to-all over the cp group"
            sent = args[0].nbytes * (n - 1) // n
        self.sent["backward" if torch._C._current_autograd_node() is not None else "forward"] += sent
        return func(*args, **(kwargs or {}))


def _layout(opts, cp: int, method: str, cfg: Config) -> dict:
    """One rank of llm_tiny at parallel.cp=cp, cp_method=method: the exchange of its warm-up steps (with their rows),
    its step times and global tokens after them, and the bytes one forward + loss keeps for backward (the AC bench's
    meter)."""
    import torch.distributed as tdist

    from scripts.benchmarks.ac import saved_bytes
    from scripts.benchmarks.harness import build_trainer, step_timer, take, timed_step

    rank = tdist.get_rank()
    trainer = build_trainer(
        opts,
        "llm_tiny",
        [f"parallel.cp={cp}", f"parallel.cp_method={method}", f"trainer.micro_batch_size={cfg.micro_batch_size}"],
        opts.work / f"cp{cp}_{method}_rank{rank}",
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


def formula_bytes(method: str, rows: int, row_len: int, cp: int) -> int:
    """What a rank must send per pass (forward; the backward sends the gradients of the same tensors, the same
    volume), summed over llm_tiny's layers, fp32, for ``rows x row_len/cp`` tokens of ``head_dim`` per head:
    allgather: its keys and values (n_kv_heads each) to each of the ``cp - 1`` other ranks;
    alltoall: ``(cp-1)/cp`` of its q and attention output (n_heads each) and of its k and v (n_kv_heads each)."""
    from scripts.kiln.launch import compose

    m = compose(["recipe=llm_tiny"]).model
    per_head = rows * row_len // cp * (m.head_dim or m.dim // m.n_heads) * 4
    if method == "allgather":
        return m.n_layers * 2 * m.n_kv_heads * per_head * (cp - 1)
    return m.n_layers * (2 * m.n_heads + 2 * m.n_kv_heads) * per_head * (cp - 1) // cp


def run(opts, cfg: Config | None = None) -> Section:
    from scripts.benchmarks.harness import fresh_dir
    from scripts.kiln.processes import spawn_ranks

    cfg = cfg or opts.pick(Config(), QUICK)
    s = Section("cp", f"Context parallelism: llm_tiny at cp=1 and cp={CP} (allgather, alltoall) on the same rows")
    layouts = {"cp=1": (1, "allgather"), **{f"cp={CP} {m}": (CP, m) for m in METHODS}}
    results = {}
    for name, (cp, method) in layouts.items():
        say(f"cp: llm_tiny {name} on {cp} rank(s), {cfg.warmup}+{cfg.steps} steps")
        work = fresh_dir(opts.work / f"cp{cp}_{method}_results")
        results[name] = spawn_ranks(_layout, (opts, cp, method, cfg), cp, work, opts.threads)

    ratios = _exchange(s, layouts, results)
    _rates_and_activations(s, layouts, results)
    s.notes.append(
        f"Exchange: the bytes each rank's functional collectives over the cp group sent in its {cfg.warmup} warm-up "
        "step(s), per pass (SentBytes, at dispatch; FSDP2's collectives excluded), against the method's volume on the "
        "rows of the same steps: allgather layers x 2 (K, V) x rows x L/cp x n_kv_heads x head_dim x 4 bytes x (cp-1) "
        "(backward: the reduce-scatter of dK, dV, the same); alltoall layers x (2 n_heads + 2 n_kv_heads) x rows x "
        "L/cp x head_dim x 4 bytes x (cp-1)/cp (q, k, v, output; backward: their gradients). With "
        "toggles.activation_checkpointing=full the backward's recomputed forward exchanges once more."
    )
    s.notes.append(
        f"tokens/s: global real tokens over the step time (cp={CP}: the slower rank's), {cfg.steps} steps after "
        f"{cfg.warmup} warm-up, one layout after the other (not interleaved: different process groups), "
        f"{opts.threads} thread(s) per process, on a shared CPU: an accounting check (equal tokens per step), not a "
        "speed claim."
    )
    s.notes.append(
        "Activations: storages created by one forward + loss (packing included) and alive when it returns "
        "(common/activations.py, as the ac section); weights (FSDP2's unsharded root weights under cp), the "
        "batch and the output excluded. Under cp a rank keeps its L/cp tokens' activations, plus per layer what its "
        "attention saves: allgather the whole row's gathered keys/values and its [L/cp x L] mask rows, alltoall its "
        "H/cp heads of the whole row's q, k, v and the whole [L x L] mask."
    )
    s.data["exchange_ratio"] = ratios
    return s


def _exchange(s: Section, layouts: dict, results: dict) -> list[float]:
    """The exchange's table and target; its counted / formula ratios."""
    # (a) the exchange, per rank and pass, beside the method's formula on the rows of the same steps
    exchange, ratios = [], []
    for name, (cp, method) in layouts.items():
        for r in results[name] if cp > 1 else []:
            want = sum(formula_bytes(method, n, r["row_len"], cp) for n in r["counted_rows"])
            for phase in PASSES:
                got = r["sent"][phase]
                ratios.append(got / want)
                exchange.append([method, r["rank"], phase, f"{got:,}", f"{want:,}", f"{got / want:.3f}"])
    s.tables.append(
        md_table(["cp_method", "rank", "pass", "counted bytes sent", "formula bytes", "counted / formula"], exchange)
    )
    s.targets.append(
        Target(
            f"cp={CP} exchange bytes per rank and pass = the method's formula",
            f"{min(ratios):.3f}-{max(ratios):.3f}",
            all(abs(x - 1) < 1e-9 for x in ratios),
        )
    )
    return ratios


def _rates_and_activations(s: Section, layouts: dict, results: dict) -> None:
    """The tokens/s and activation table, its targets, and each layout's data."""
    one = results["cp=1"][0]
    # (b) tokens/s on the same rows (the same global tokens per step) and (c) activation bytes per rank
    table, worst, same_tokens = [], 0.0, True
    base_rate = None
    for name, (cp, method) in layouts.items():
        ranks = results[name]
        step = [max(per_rank) for per_rank in zip(*(r["step_s"] for r in ranks))]  # the slower rank's
        rate = median(t / dt for t, dt in zip(one["tokens"], step))
        base_rate = base_rate or rate
        for r in ranks:
            same_tokens &= r["tokens"] == one["tokens"]
            share = r["saved_bytes"] / one["saved_bytes"]
            worst = max(worst, share) if cp > 1 else worst
            table.append(
                [name, r["rank"], ms(median(step)), f"{rate:,.0f}", f"{rate / base_rate:.2f}x", mib(r["saved_bytes"])]
                + [f"{share:.2f}"]
            )
        s.data[name] = {"ranks": ranks, "tokens_per_s": rate}
    s.tables.append(
        md_table(
            ["layout", "rank", "step ms (median)", "tokens/s (global)", "vs cp=1", "activations per rank", "vs cp=1"],
            table,
        )
    )
    s.targets.append(
        Target(
            f"cp={CP} keeps <= {TARGET_ACTIVATIONS:.0%} of cp=1's activation bytes per rank (goal about half)",
            f"{worst:.2f} (worst rank, either method)",
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
