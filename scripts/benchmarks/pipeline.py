"""The pipeline bubble of the LLM recipe's schedules on CPU (gloo), beside the theory.

Starts ``p = 2`` processes (torch.multiprocessing spawn; they hand their numbers back through a
queue). Each builds the same Llama, keeps its stage (recipes/llm/pipeline_parallel.py's split), and runs
``schedule.step`` on a fixed global batch of ``rows`` x ``seq`` tokens split into ``m``
microbatches. Every stage's forward_one_chunk / backward_one_chunk is timed (compute only: the
schedule waits for its P2P receives outside those calls), and the step wall time runs from a
barrier before ``schedule.step`` to one after it (the same interval for every stage), so per stage

    idle = 1 - busy / step wall time

is the time it spent waiting for the other stage: the bubble, plus communication and skew. The
theoretical bubble of GPipe and 1F1B with equal stages and free communication is
``(p - 1) / (m + p - 1)``. Stages here are not perfectly equal (stage 0 holds the embedding,
the last stage the output projection and the loss), so the measurement differs per stage.
"""

from __future__ import annotations

import os
import queue as queues
import time
from dataclasses import dataclass

from scripts.benchmarks.report import Section, md_table, say

STAGES = 2


@dataclass(frozen=True)
class Config:
    schedules: tuple[str, ...] = ("gpipe", "1f1b")
    microbatches: tuple[int, ...] = (2, 4, 8)
    rows: int = 16  # global batch rows (fixed over m)
    seq: int = 256
    dim: int = 256
    layers: int = 4
    vocab: int = 256  # small: keeps the last stage (output + loss) near the first's cost
    warmup: int = 2
    iters: int = 5


QUICK = Config(microbatches=(2, 4), rows=8, seq=64, dim=64, warmup=1, iters=2)


def _timed(stage, busy: list[float]) -> None:
    """Wrap the stage's compute calls; append their durations to ``busy``."""
    for name in ("forward_one_chunk", "backward_one_chunk"):
        fn = getattr(stage, name)

        def wrapper(*a, _fn=fn, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                busy.append(time.perf_counter() - t0)

        setattr(stage, name, wrapper)


def _worker(rank: int, world: int, port: int, cfg: Config, threads: int, results) -> None:
    """One stage: per (schedule, m), its mean step wall time and median idle fraction, put on `results`."""
    import torch
    import torch.distributed as tdist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from recipes.llm.model import LlamaArgs, Transformer
    from recipes.llm.pipeline_parallel import _stage_view, split_for_rank, stage_layer_ids

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    args = LlamaArgs(
        dim=cfg.dim,
        n_layers=cfg.layers,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=cfg.vocab,
        ffn_dim=int(8 * cfg.dim / 3 + 7) // 8 * 8,
        max_seq_len=cfg.seq,
    )
    with torch.device("meta"):
        model = Transformer(args)
    split_for_rank(model, rank, world, 1)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    layers = stage_layer_ids(args.n_layers, world)[rank]
    view = _stage_view(model, layers, rank == 0, rank == world - 1)

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / labels.numel()

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (cfg.rows, cfg.seq), generator=g)
    out = []
    for sched_name in cfg.schedules:
        for m in cfg.microbatches:
            stage = PipelineStage(view, rank, world, torch.device("cpu"))
            cls = ScheduleGPipe if sched_name == "gpipe" else Schedule1F1B
            schedule = cls(stage, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
            busy: list[float] = []
            walls, fractions = [], []
            for it in range(cfg.warmup + cfg.iters):
                busy.clear()
                tdist.barrier()
                t0 = time.perf_counter()
                schedule.step(
                    *((tokens,) if rank == 0 else ()),
                    target=tokens if rank == world - 1 else None,
                    return_outputs=False,
                )
                tdist.barrier()  # one wall clock for all stages: the last one done ends the step
                wall = time.perf_counter() - t0
                if it == 0:
                    _timed(stage, busy)  # after the first step: it also ran shape inference
                if it >= cfg.warmup:
                    walls.append(wall)
                    fractions.append(1 - sum(busy) / wall)
                model.zero_grad(set_to_none=True)
            out.append(
                {
                    "schedule": sched_name,
                    "microbatches": m,
                    "rank": rank,
                    "step_s": sum(walls) / len(walls),
                    "idle": sorted(fractions)[len(fractions) // 2],
                }
            )
    results.put(out)
    tdist.destroy_process_group()


def measure(cfg: Config, threads: int, timeout: float = 900) -> list[dict]:
    """Every stage's rows (``_worker``), from STAGES spawned processes."""
    import torch.multiprocessing as mp

    from common.distributed import free_port

    for m in cfg.microbatches:
        if cfg.rows % m:
            raise ValueError(f"rows {cfg.rows} must be divisible by every microbatch count (got {m})")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, STAGES, port, cfg, threads, results)) for r in range(STAGES)]
    for proc in procs:
        proc.start()
    rows, deadline = [], time.monotonic() + timeout
    try:
        while len(rows) < STAGES * len(cfg.schedules) * len(cfg.microbatches):
            try:
                rows += results.get(timeout=5)
            except queues.Empty:
                failed = [p.exitcode for p in procs if p.exitcode]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"a pipeline stage process failed (exit codes {failed})"
                        if failed
                        else f"the pipeline stages sent no result in {timeout:.0f} s"
                    ) from None
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return rows


def run(opts, cfg: Config | None = None) -> Section:
    cfg = cfg or opts.pick(Config(), QUICK)
    say(
        f"pipeline: {STAGES} stage processes, schedules {'/'.join(cfg.schedules)}, microbatches "
        f"{'/'.join(map(str, cfg.microbatches))}"
    )
    rows = measure(cfg, opts.threads)
    by_key = {(r["schedule"], r["microbatches"], r["rank"]): r for r in rows}
    table = []
    for s in cfg.schedules:
        for m in cfg.microbatches:
            wall = max(by_key[(s, m, r)]["step_s"] for r in range(STAGES))
            idle = [by_key[(s, m, r)]["idle"] for r in range(STAGES)]
            table.append([s, m, f"{wall:.3f}", *(f"{i:.1%}" for i in idle), f"{(STAGES - 1) / (m + STAGES - 1):.1%}"])
    section = Section("pipeline", f"Pipeline bubble, {STAGES} stages")
    section.tables.append(
        md_table(
            ["schedule", "microbatches", "step s", *(f"idle stage {r}" for r in range(STAGES)), "theory (p-1)/(m+p-1)"],
            table,
        )
    )
    section.notes.append(
        f"p={STAGES}, batch {cfg.rows} x {cfg.seq} tokens, dim {cfg.dim}, {cfg.layers} layers, "
        f"{opts.threads} thread(s)/stage; median of {cfg.iters} steps"
    )
    section.data["stages"] = rows
    return section
