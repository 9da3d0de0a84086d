#!/usr/bin/env python
"""Measure the pipeline bubble of the LLM recipe's schedules on CPU (gloo), beside the theory.

    python scripts/bench_pipeline.py [--schedules gpipe 1f1b] [--microbatches 2 4 8] [--rows 16]

Starts ``p = 2`` processes itself (no torchrun needed). Each builds the same Llama, keeps its
stage (recipes/llm/pipeline.py's split), and runs ``schedule.step`` on a fixed global batch of
``--rows`` x ``--seq`` tokens split into ``m`` microbatches. Every stage's forward_one_chunk /
backward_one_chunk is timed (compute only: the schedule waits for its P2P receives outside those
calls), and the step wall time runs from a barrier before ``schedule.step`` to one after it
(the same interval for every stage), so per stage

    idle = 1 - busy / step wall time

is the time it spent waiting for the other stage: the bubble, plus communication and skew. The
theoretical bubble of GPipe and 1F1B with equal stages and free communication is
``(p - 1) / (m + p - 1)``. Stages here are not perfectly equal (stage 0 holds the embedding,
the last stage the output projection and the loss), so the measurement differs per stage.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def _worker(rank: int, world: int, port: int, opts: argparse.Namespace, queue) -> None:
    import torch
    import torch.distributed as tdist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from recipes.llm.model import LlamaArgs, Transformer
    from recipes.llm.pipeline import _stage_view, split_for_rank, stage_layer_ids

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(opts.threads)
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    args = LlamaArgs(dim=opts.dim, n_layers=opts.layers, n_heads=4, n_kv_heads=2, vocab_size=opts.vocab,
                     ffn_dim=int(8 * opts.dim / 3 + 7) // 8 * 8, max_seq_len=opts.seq)
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
    tokens = torch.randint(0, args.vocab_size, (opts.rows, opts.seq), generator=g)
    results = []
    for sched_name in opts.schedules:
        for m in opts.microbatches:
            stage = PipelineStage(view, rank, world, torch.device("cpu"))
            cls = ScheduleGPipe if sched_name == "gpipe" else Schedule1F1B
            schedule = cls(stage, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
            busy: list[float] = []
            walls, fractions = [], []
            for it in range(opts.warmup + opts.iters):
                busy.clear()
                tdist.barrier()
                t0 = time.perf_counter()
                schedule.step(*((tokens,) if rank == 0 else ()), target=tokens if rank == world - 1 else None,
                              return_outputs=False)
                tdist.barrier()  # one wall clock for all stages: the last one done ends the step
                wall = time.perf_counter() - t0
                if it == 0:
                    _timed(stage, busy)  # after the first step: it also ran shape inference
                if it >= opts.warmup:
                    walls.append(wall)
                    fractions.append(1 - sum(busy) / wall)
                model.zero_grad(set_to_none=True)
            results.append((sched_name, m, rank, sum(walls) / len(walls), sorted(fractions)[len(fractions) // 2]))
    queue.put(results)
    tdist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=["gpipe", "1f1b"])
    ap.add_argument("--microbatches", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--rows", type=int, default=16, help="global batch rows (fixed over m)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256, help="small: keeps the last stage (output + loss) near the first's cost")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per stage process")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    opts = ap.parse_args(argv)
    for m in opts.microbatches:
        if opts.rows % m:
            ap.error(f"--rows {opts.rows} must be divisible by every microbatch count (got {m})")

    import torch.multiprocessing as mp

    from common.distributed import free_port

    p = 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, p, port, opts, queue)) for r in range(p)]
    for proc in procs:
        proc.start()
    rows = [r for _ in procs for r in queue.get()]
    for proc in procs:
        proc.join()
        if proc.exitcode:
            print(f"bench_pipeline: a stage process failed ({proc.exitcode})", file=sys.stderr)
            return 1
    by_key = {(s, m, r): (wall, idle) for s, m, r, wall, idle in rows}
    print(f"p={p}, batch {opts.rows} x {opts.seq} tokens, dim {opts.dim}, {opts.layers} layers, "
          f"{opts.threads} thread(s)/stage; median of {opts.iters} steps")
    print(f"{'schedule':<9} {'m':>3} {'step s':>8} {'idle stage0':>12} {'idle stage1':>12} {'theory (p-1)/(m+p-1)':>21}")
    for s in opts.schedules:
        for m in opts.microbatches:
            wall = max(by_key[(s, m, r)][0] for r in range(p))
            idle = [by_key[(s, m, r)][1] for r in range(p)]
            print(f"{s:<9} {m:>3} {wall:>8.3f} {idle[0]:>12.1%} {idle[1]:>12.1%} {(p - 1) / (m + p - 1):>21.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
