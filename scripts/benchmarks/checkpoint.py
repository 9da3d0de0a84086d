"""Checkpoint stall: how long a save holds up the training loop, checkpoint.async_save=false vs true (the LLM, DCP),
on a model whose checkpoint takes over a second to write; and what the manifest's checksum costs per 100 MB."""

from __future__ import annotations

import hashlib
import json
import time
import zlib
from pathlib import Path

from common.metrics import read_metrics
from recipes.llm.train import LLMTrainer
from scripts.benchmarks.harness import build_trainer, quiet, take
from scripts.benchmarks.report import Section, Target, md_table, median, ms, say

TARGET_STALL = 0.5  # the async loop's stall per save <= this x the sync loop's
TARGET_SAVE_S = 1.0  # a sync save of the model takes at least this long (else the model is too small to say much)
# ~56M parameters (checkpoint ~0.67 GB with AdamW's two moments); quick: ~4M.
MODEL = {
    False: ["model.dim=1024", "model.n_heads=8", "model.n_kv_heads=8", "model.ffn_dim=2816"],
    True: ["model.dim=256", "model.n_heads=4", "model.n_kv_heads=4", "model.ffn_dim=688"],
}
EVERY = 3


class TimedSaves(LLMTrainer):
    """llm_tiny's Trainer, timing what holds up its loop for checkpoints: `save_checkpoint` (a sync save; an async
    save's host copy, or its wait for the previous one) and `ckpt.poll` (an async save's commit); and noting which
    steps ran while an async write was in flight."""

    def __init__(self, cfg, dist, run_dir):
        super().__init__(cfg, dist, run_dir)
        self.saves, self.polls, self.in_flight = [], [], set()
        poll = self.ckpt.poll

        def timed_poll() -> None:
            if self.ckpt.writing:
                self.in_flight.add(self.state.step)
            start = time.perf_counter()
            poll()
            self.polls.append(time.perf_counter() - start)

        self.ckpt.poll = timed_poll

    def save_checkpoint(self) -> None:
        start = time.perf_counter()
        super().save_checkpoint()
        self.saves.append(time.perf_counter() - start)


def checksum_costs(path: Path) -> dict[str, float]:
    """Seconds per 100 MB of each candidate checksum over `path` (read from the page cache: the file was just
    written)."""
    algos = {
        "crc32 (zlib)": lambda f: _chunks(f, zlib.crc32, 0),
        "sha256 (hashlib)": lambda f: hashlib.file_digest(f, "sha256").digest(),
    }
    try:
        import xxhash

        algos["xxh3_64 (xxhash)"] = lambda f: hashlib.file_digest(f, xxhash.xxh3_64).digest()
    except ImportError:
        pass
    size, out = path.stat().st_size, {}
    for name, digest in algos.items():
        with open(path, "rb") as f:
            start = time.perf_counter()
            digest(f)
            out[name] = (time.perf_counter() - start) * 100e6 / size
    return out


def _chunks(f, update, state):
    while chunk := f.read(1 << 22):
        state = update(chunk, state)
    return state


def run(opts, model: list[str] | None = None) -> Section:
    steps = opts.pick(4 * EVERY + 1, 2 * EVERY + 1)
    model = MODEL[opts.quick] if model is None else model
    docs, results = None, {}
    for mode in (False, True):
        run_dir = opts.work / f"checkpoint_{'async' if mode else 'sync'}"
        say(f"checkpoint: llm_tiny {' '.join(model)}, {steps} steps, a save every {EVERY}, async_save={mode}")
        trainer = build_trainer(
            opts,
            "llm_tiny",
            [
                *model,
                "trainer.micro_batch_size=2",
                "trainer.log_every=1",
                f"trainer.max_steps={steps}",
                f"checkpoint.every={EVERY}",
                "checkpoint.keep=2",
                f"checkpoint.async_save={str(mode).lower()}",
                "profile.count_flops=false",
            ],
            run_dir,
            cls=TimedSaves,
        )
        docs = docs or take(trainer, steps)
        with quiet(opts.log):
            trainer.fit(batches=docs)
        records = read_metrics(run_dir / "metrics.jsonl")
        latest = trainer.ckpt.latest()
        results[mode] = {
            "trainer": trainer,
            "step_s": {r["step"]: r["step_time_s"] for r in records},
            "bytes": sum(e["size"] for e in json.loads((latest / "manifest.json").read_text())["files"].values()),
            "shard": max((latest / "dcp").glob("*.distcp"), key=lambda p: p.stat().st_size),
        }
    return section(results, steps)


def section(results: dict, steps: int) -> Section:
    sync, asyn = results[False]["trainer"], results[True]["trainer"]
    saves = len(sync.saves)
    stall = {False: median(sync.saves), True: (sum(asyn.saves) + sum(asyn.polls)) / len(asyn.saves)}
    steps_async = results[True]["step_s"]
    busy = [t for s, t in steps_async.items() if s - 1 in asyn.in_flight]  # step s ran after the poll at step s-1
    idle = [t for s, t in steps_async.items() if s - 1 not in asyn.in_flight and s > 1]
    ratio = stall[True] / stall[False]
    gb = results[False]["bytes"] / 1e9
    s = Section("checkpoint", "Checkpoint stall: sync vs async saves (llm_tiny widened, DCP)")
    s.tables.append(
        md_table(
            [
                "checkpoint.async_save",
                "loop blocked per save (s)",
                "vs sync",
                "median step ms (no save in flight)",
                "median step ms (write in flight)",
            ],
            [
                [
                    "false",
                    f"{stall[False]:.3f}",
                    "1.00",
                    ms(median(v for k, v in results[False]["step_s"].items() if k > 1)),
                    "-",
                ],
                ["true", f"{stall[True]:.3f}", f"{ratio:.2f}", ms(median(idle)), ms(median(busy)) if busy else "-"],
            ],
        )
    )
    costs = checksum_costs(results[False]["shard"])
    s.tables.append(md_table(["manifest checksum", "seconds per 100 MB"], [[k, f"{v:.3f}"] for k, v in costs.items()]))
    s.targets.append(
        Target(
            f"a sync save takes >= {TARGET_SAVE_S:.0f} s (a model big enough to measure)",
            f"{stall[False]:.2f} s for {gb:.2f} GB",
            stall[False] >= TARGET_SAVE_S,
        )
    )
    s.targets.append(
        Target(
            f"async stall per save <= {TARGET_STALL:.2f}x sync",
            f"{ratio:.2f}x ({stall[True]:.3f} s vs {stall[False]:.3f} s)",
            ratio <= TARGET_STALL,
        )
    )
    s.notes.append(
        f"one process, {saves} saves each of {gb:.2f} GB (weights + AdamW moments) over {steps} steps, the "
        "same documents for both runs (sync first, then async). 'Loop blocked': seconds inside "
        "save_checkpoint (sync: the whole write, its manifest and commit; async: the host copy, and any "
        "wait for the previous save) plus the async commits at step boundaries (ckpt.poll), per save; "
        "the end of run's wait for the last write is not counted."
    )
    s.notes.append(
        "on CPU the staging copy is a plain host copy (pinned memory needs CUDA); the background write "
        "shares the cores with training: the two step columns of the async run show what that costs."
    )
    s.data = {
        "stall_s": {"sync": stall[False], "async": stall[True]},
        "ratio": ratio,
        "checkpoint_bytes": results[False]["bytes"],
        "sync_saves_s": sync.saves,
        "async_saves_s": asyn.saves,
        "async_polls_s": asyn.polls,
        "step_s": {"sync": results[False]["step_s"], "async": results[True]["step_s"]},
        "async_in_flight_steps": sorted(asyn.in_flight),
        "checksum_s_per_100mb": costs,
    }
    return s
