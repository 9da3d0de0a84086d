#!/usr/bin/env python
"""Kiln's benchmarks, measured side by side in one run, written as markdown tables with their targets."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout

TRAIN = REPO / "scripts" / "train.py"
SECTIONS = ("overhead", "ac", "zero", "data", "scaling", "packing", "pipeline", "serving")
CPUS = os.cpu_count() or 1
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

TARGET_OVERHEAD = 1.03  # Kiln loop iteration / bare PyTorch step
TARGET_AC_SAVED = 0.70  # full AC keeps at least this much fewer activation bytes ...
TARGET_AC_TIME = 1.40  # ... for at most this step-time factor
TARGET_DATA_WAIT = 0.02  # data wait / step time at steady state
TARGET_ZERO_MATCH = 0.10  # measured model-state bytes within this of the planner

# Only what a timing run needs: no evaluation, samples or checkpoints beyond the loop itself.
RUN_ARGS = ["trainer.progress_bar=false", "trainer.eval=false", "checkpoint.every=0", "checkpoint.final=false",
            "run.resume=never"]
RECIPE_ARGS = {"dit_tiny": ["trainer.sample_every=0", "diffusion.sample_steps=2", "diffusion.samples_per_class=1"],
               "vlm_tiny": [], "llm_tiny": []}
TRAINERS = {"llm": "LLMTrainer", "dit": "DiTTrainer", "vlm": "VLMTrainer"}


# ---- results ------------------------------------------------------------------------------------

@dataclass
class Target:
    what: str
    value: str
    met: bool


@dataclass
class Section:
    name: str
    title: str
    tables: list[str] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    error: str = ""

    def markdown(self) -> str:
        lines = [f"## {self.title}", ""]
        for table in self.tables:
            lines += [table.strip(), ""]
        lines += [f"- target: {t.what}: {t.value} -> **{'met' if t.met else 'NOT met'}**" for t in self.targets]
        lines += [f"- {note}" for note in self.notes]
        if self.error:
            lines.append(f"- **failed**: {self.error}")
        return "\n".join(lines).rstrip() + "\n"


def md_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def say(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def median(values) -> float:
    return statistics.median(values) if values else float("nan")


# ---- processes: in-process trainers and training runs as subprocesses ----------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


@contextlib.contextmanager
def quiet(log: Path):
    """Send this process's stdout/stderr (DeepSpeed, warnings, progress lines) to `log`, at the file
    descriptor level so C++ and already-configured logging handlers are caught too."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "a") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def child_env(threads: int) -> dict:
    """A clean launch environment: none of this process's own process-group variables, and the same
    intra-op thread count per process as the in-process benchmarks use."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_command(opts, cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(opts.threads), capture_output=True, text=True, timeout=timeout)
    with open(opts.log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}\n")
    if proc.returncode:
        raise RuntimeError(f"`{' '.join(cmd[-6:])}` exited {proc.returncode}: {proc.stderr.strip()[-600:]}")
    return proc


def train_run(opts, recipe: str, overrides: list[str], run_dir: Path, nproc: int = 1) -> list[dict]:
    """scripts/train.py (under torchrun for nproc > 1) in a subprocess; returns its metrics.jsonl."""
    from common.metrics import read_metrics

    fresh_dir(run_dir)
    launch = [sys.executable, str(TRAIN)] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
        str(TRAIN)]
    cmd = [*launch, f"recipe={recipe}", *RUN_ARGS, *RECIPE_ARGS[recipe], *overrides, f"run.dir={run_dir}"]
    run_command(opts, cmd, timeout=900)
    return read_metrics(run_dir / "metrics.jsonl")


_DIST = None


def distributed():
    """This process as a group of one (the recipes' trainers want a process group, as under train.py)."""
    global _DIST
    if _DIST is None:
        from common.distributed import init_distributed

        _DIST = init_distributed()
    return _DIST


def build_trainer(opts, recipe: str, overrides: list[str], run_dir: Path):
    """The recipe's own Trainer, built as scripts/train.py builds it (config, toggles, parallelize)."""
    from common.launch import compose
    from common.toggles import apply_global_toggles

    cfg = compose([f"recipe={recipe}", *RUN_ARGS, *overrides, f"run.dir={run_dir}"])
    apply_global_toggles(cfg.toggles)
    cls = getattr(importlib.import_module(f"recipes.{cfg.recipe.family}.train"), TRAINERS[cfg.recipe.family])
    fresh_dir(run_dir)
    with quiet(opts.log):
        trainer = cls(cfg, distributed(), run_dir)
    (getattr(trainer, "engine", None) or trainer.model).train()
    return trainer


class InMemoryLoader:
    """Stands in for a trainer's ResumableLoader: the same batches, already in memory."""

    corrupt_shards = 0

    def __init__(self, batches: list):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def close(self) -> None:
        pass


def take(loader, n: int) -> list:
    """The loader's first n batches, in memory (then its workers stop)."""
    it = iter(loader)
    batches = [next(it) for _ in range(n)]
    loader.close()
    return batches


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_step(trainer, batch, timer) -> tuple[float, dict, float | None]:
    """(seconds, stats, CUDA bytes allocated above the step's start at its peak) of one train_step."""
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    trainer.batches = iter([batch])
    start = time.perf_counter()
    stats = trainer.train_step(timer)
    sync()
    seconds = time.perf_counter() - start
    trainer.step += 1
    return seconds, stats, (torch.cuda.max_memory_allocated() - base) if cuda else None


def interleaved(trainers: dict, batches: list, warmup: int) -> dict[str, dict]:
    """Every trainer runs a step on batch i before any runs batch i+1, in an order that rotates each
    step, so machine noise (other jobs on the cores) lands on all of them alike. Per trainer: step
    times, stats and CUDA step peaks after `warmup` steps."""
    from common.profiling import StepTimer

    timer = StepTimer()
    timer.enabled = False  # phase timing is what a non-logging step of the loop does
    names = list(trainers)
    out = {n: {"times": [], "stats": [], "peaks": []} for n in names}
    for i, batch in enumerate(batches):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            seconds, stats, peak = timed_step(trainers[name], batch, timer)
            if i >= warmup:
                out[name]["times"].append(seconds)
                out[name]["stats"].append(stats)
                out[name]["peaks"].append(peak)
    return out


def saved_activation_bytes(run, exclude) -> tuple[int, object]:
    """Bytes of the unique storages autograd saves for backward while `run()` executes, leaving out
    `exclude` (weights, buffers, the batch). Returns `run()`'s output too: it keeps the graph alive,
    so no saved storage is freed and its address reused while counting."""
    import torch

    skip = {t.untyped_storage().data_ptr() for t in exclude}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(kept.values()), out


def model_tensors(model) -> list:
    return [*model.parameters(), *model.buffers()]


# ---- overhead: Kiln's loop vs a bare PyTorch loop ------------------------------------------------

def bare_llm(trainer):
    """A hand-written copy of what llm_tiny's step computes, on its own model with the same initial
    weights: pack, forward, token-mean cross-entropy, backward, clip, AdamW, LR schedule."""
    import functools

    import torch
    import torch.nn.functional as F

    from common.optim import lr_factor
    from recipes.llm.data import local_batch
    from recipes.llm.model import Transformer

    cfg, o = trainer.cfg, trainer.cfg.optim
    model = Transformer(trainer.args).to(trainer.device)
    model.init_weights(seed=cfg.trainer.seed)  # the recipe's seed checkpoint
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(lr_factor, cfg=o, max_steps=cfg.trainer.max_steps))
    pad = trainer.tokenizer.pad_token_id

    def step(documents) -> float:
        packed = local_batch(documents, dp_rank=0, dp=1, max_seq_len=cfg.data.max_seq_len, pad_id=pad)
        inputs = packed.model_inputs("sdpa", device=trainer.device)
        labels = inputs["labels"][:, 1:]
        logits = model(inputs["input_ids"], position_ids=inputs["position_ids"], attn_mask=inputs["attention_mask"])
        loss_sum = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                                   reduction="sum")
        loss = loss_sum / (labels != -100).sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip or float("inf"))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def bench_overhead(opts) -> Section:
    from common.metrics import read_metrics

    warmup, steps = opts.pick(3, 1), opts.pick(20, 3)
    total = warmup + steps
    run_dir = opts.work / "overhead"
    batch = opts.pick([], ["trainer.micro_batch_size=4"])
    trainer = build_trainer(opts, "llm_tiny", ["trainer.log_every=1", f"trainer.max_steps={total}", *batch], run_dir)
    # Both loops get the documents the recipe's loader yields, read into memory up front: this section
    # measures the loop and the trainer; the loader's own cost is the data-wait section's.
    documents = take(trainer.loader, total)
    trainer.loader = InMemoryLoader(documents)
    bare_step = bare_llm(trainer)
    marks, bare, bare_losses = [], [], []

    def after_step() -> None:
        # The loop's hook runs the bare steps between Kiln's, in the order K0 B0 B1 K1 K2 B2 B3 K3 ...
        # so each loop goes first half of the time. A Kiln loop iteration is what lies between two hooks.
        hook_start, i = time.perf_counter(), trainer.step - 1
        for j in (i, i + 1) if i % 2 == 0 else ():
            if j < total:
                start = time.perf_counter()
                bare_losses.append(bare_step(documents[j]))
                sync()
                bare.append(time.perf_counter() - start)
        marks.append((hook_start, time.perf_counter()))

    trainer.after_step = after_step
    say(f"overhead: llm_tiny, {total} steps each ({warmup} warm-up), Kiln and bare interleaved")
    with quiet(opts.log):
        trainer.train()
    records = read_metrics(run_dir / "metrics.jsonl")
    timed = range(max(1, warmup), total)  # loop iteration i runs from the end of hook i-1 to the start of hook i
    bare = bare[timed.start:]
    kiln_step = [records[i]["step_time_s"] for i in timed]
    kiln_loop = [marks[i][0] - marks[i - 1][1] for i in timed]
    loss_diff = max(abs(r["loss"] - b) / abs(b) for r, b in zip(records, bare_losses))
    return overhead_section(trainer, bare, kiln_step, kiln_loop, loss_diff)


def overhead_section(trainer, bare, kiln_step, kiln_loop, loss_diff) -> Section:
    import torch

    def paired(xs):  # per-step ratios: both loops ran the same documents at step i
        return median([x / b for x, b in zip(xs, bare)])

    cfg = trainer.cfg
    rows = [["bare PyTorch loop", "pack + forward + backward + clip + AdamW + LR step", ms(median(bare)), "1.000"],
            ["Kiln `train_step`", "+ batch iterator, phase timers, token all-reduce (gloo, group of one); "
             "metrics.jsonl `step_time_s`", ms(median(kiln_step)), f"{paired(kiln_step):.3f}"],
            ["Kiln loop iteration", "+ metrics.jsonl/TensorBoard record, heartbeat, fault and stop-signal "
             "checks (`run_training_loop`)", ms(median(kiln_loop)), f"{paired(kiln_loop):.3f}"]]
    s = Section("overhead", "Framework overhead: Kiln's training loop vs a bare PyTorch loop (llm_tiny)")
    s.tables.append(md_table(["loop", "a step includes", "median ms", "vs bare"], rows))
    s.targets.append(Target(f"Kiln loop iteration <= {TARGET_OVERHEAD:.2f}x bare step",
                            f"{paired(kiln_loop):.3f}x ({ms(median(kiln_loop))} vs {ms(median(bare))} ms)",
                            paired(kiln_loop) <= TARGET_OVERHEAD))
    s.notes.append(f"{len(bare)} steps each after warm-up, one process, {torch.get_num_threads()} torch threads for both; "
                   f"micro batch {cfg.trainer.micro_batch_size} documents x {cfg.data.max_seq_len} tokens, "
                   f"trainer.log_every=1 (every step logged: the worst case); steps interleaved K0 B0 B1 K1 K2 B2 ... "
                   f"(each loop first half the time), 'vs bare' is the median of per-step ratios (same documents "
                   f"at each step).")
    s.notes.append(f"same math: the two loops' per-step losses differ by at most {loss_diff:.1e} (relative)")
    s.data = {"bare_s": bare, "kiln_train_step_s": kiln_step, "kiln_loop_s": kiln_loop, "max_loss_rel_diff": loss_diff}
    return s


# ---- activation checkpointing --------------------------------------------------------------------

def ac_llm(opts, steps: int, warmup: int) -> dict:
    batch = opts.pick([], ["trainer.micro_batch_size=4"])
    trainers = {mode: build_trainer(opts, "llm_tiny", [f"toggles.activation_checkpointing={mode}", *batch],
                                    opts.work / f"ac_llm_{mode}") for mode in ("none", "full")}
    batches = take(trainers["none"].loader, warmup + steps)

    def saved(trainer):
        # Everything autograd keeps for backward except the weights (the packed inputs, the RoPE
        # gather and the logits' log-probabilities included: they are the same in both modes).
        n, out = saved_activation_bytes(lambda: trainer.micro_step_loss(batches[0]), model_tensors(trainer.model))
        del out
        return n

    return {"bytes": {m: saved(t) for m, t in trainers.items()}, "steps": interleaved(trainers, batches, warmup)}


def ac_dit(opts, steps: int, warmup: int) -> dict:
    batch = opts.pick([], ["trainer.micro_batch_size=16"])
    trainers = {mode: build_trainer(opts, "dit_tiny", [f"toggles.activation_checkpointing={mode}", *batch],
                                    opts.work / f"ac_dit_{mode}") for mode in ("none", "full")}
    batches = take(trainers["none"].loader, warmup + steps)

    def saved(trainer):
        exclude = [*model_tensors(trainer.model), *batches[0].values()]
        n, out = saved_activation_bytes(lambda: trainer.diffusion_loss(batches[0]), exclude)
        del out
        return n

    return {"bytes": {m: saved(t) for m, t in trainers.items()}, "steps": interleaved(trainers, batches, warmup)}


def bench_ac(opts) -> Section:
    warmup, steps = 1, opts.pick(10, 2)
    s = Section("ac", "Activation checkpointing: saved activations and step time, none vs full")
    rows = []
    for recipe, fn in (("llm_tiny", ac_llm), ("dit_tiny", ac_dit)):
        say(f"ac: {recipe}, none vs full, {warmup + steps} steps each, interleaved")
        result = fn(opts, steps, warmup)
        saved, steps_by_mode = result["bytes"], result["steps"]
        times = {m: median(r["times"]) for m, r in steps_by_mode.items()}
        # Per-step ratios: both modes ran the same batch at step i, and the batches' sizes differ.
        ratio = {m: median(t / n for t, n in zip(r["times"], steps_by_mode["none"]["times"]))
                 for m, r in steps_by_mode.items()}
        fewer, slower = 1 - saved["full"] / saved["none"], ratio["full"]
        for mode in ("none", "full"):
            rows.append([recipe, mode, mib(saved[mode]), f"{saved[mode] / saved['none']:.2f}", ms(times[mode]),
                         f"{ratio[mode]:.2f}x"])
        s.targets.append(Target(f"{recipe}: full AC saves >= {TARGET_AC_SAVED:.0%} of activation bytes for <= "
                                f"{TARGET_AC_TIME - 1:.0%} more step time", f"{fewer:.1%} fewer bytes, {slower:.2f}x time",
                                fewer >= TARGET_AC_SAVED and slower <= TARGET_AC_TIME))
        s.data[recipe] = {"saved_bytes": saved, "step_s": {m: r["times"] for m, r in result["steps"].items()}}
    s.tables.append(md_table(["recipe", "AC", "saved for backward", "vs none", "step ms (median)", "vs none"], rows))
    s.notes.append("saved bytes: unique storages that torch.autograd.graph.saved_tensors_hooks sees in one forward + "
                   "loss of the recipe's trainer (weights excluded; AC applied by the recipe's parallelize()). "
                   "Full AC keeps each block's input; what remains is mostly outside the blocks: the LLM's fp32 "
                   "log-probabilities over the vocabulary, the DiT's patch embedding and output head.")
    s.notes.append(f"step: the trainer's train_step (forward, backward, optimizer), the two modes alternating on the same "
                   f"batches, {steps} steps each after {warmup} warm-up; time 'vs none' is the median of per-step ratios")
    return s


# ---- ZeRO: measured per-rank model-state bytes vs the memory planner -----------------------------

def bench_zero(opts) -> Section:
    from common.launch import compose
    from common.memory import deepspeed_state_bytes, model_state_bytes

    stages, world = opts.pick([0, 1, 2, 3], [0, 3]), 2
    precision = compose(["recipe=dit_tiny"]).toggles.precision
    rows, data = [], {}
    for stage in stages:
        say(f"zero: dit_tiny, stage {stage}, {world} ranks (torchrun)")
        run_dir = opts.work / f"zero{stage}"
        train_run(opts, "dit_tiny", [f"parallel.zero_stage={stage}", "trainer.max_steps=2", "trainer.log_every=1"],
                  run_dir, nproc=world)
        info = json.loads((run_dir / "memory.json").read_text())
        # The planner's per-rank states: what it assumes DeepSpeed allocates at this stage and precision.
        plan = model_state_bytes(info["trainable_params"], stage, world, deepspeed_state_bytes(stage, precision))
        planned = plan["weights"] + plan["optimizer"]  # memory.json measures weights + optimizer, not grads
        measured = info["per_rank_state_bytes"]
        data[stage] = {"measured": measured, "planner": plan, "num_params": info["num_params"]}
        rows.append([stage, *(mib(m) for m in measured), mib(planned), f"{max(measured) / planned:.3f}",
                     mib(plan["grads"])])
    s = Section("zero", f"ZeRO per-rank model-state bytes, dit_tiny on {world} ranks: measured vs the planner")
    s.tables.append(md_table(["stage", *(f"measured rank {r}" for r in range(world)),
                              "planner: weights + optimizer", "measured / planner", "planner: grads (not measured)"],
                             rows))
    worst = max(abs(max(d["measured"]) / (d["planner"]["weights"] + d["planner"]["optimizer"]) - 1)
                for d in data.values())
    s.targets.append(Target(f"measured within {TARGET_ZERO_MATCH:.0%} of common/memory.py at every stage",
                            f"worst {worst:.1%} off", worst <= TARGET_ZERO_MATCH))
    s.notes.append(f"{data[stages[0]]['num_params']:,} parameters, {precision}. measured: run.dir/memory.json "
                   "(common/deepspeed.py record_state_bytes: unique storages of weights, ZeRO partitions, the "
                   "optimizer's fp32 params and Adam moments after the first step; gradients are freed between "
                   "steps, so not counted); planner: common/memory.py model_state_bytes with deepspeed_state_bytes "
                   "(in fp32, ZeRO-1/2 keep an extra fp32 weight partition for the step: DeepSpeed's "
                   "stage_1_and_2.py clones it even when the weights are fp32; ZeRO-3 steps its partition in place).")
    s.data = {str(k): v for k, v in data.items()}
    return s


# ---- data wait at steady state --------------------------------------------------------------------

def bench_data(opts) -> Section:
    from common.launch import compose

    warmup = 5
    rows, s = [], Section("data", "Data wait at steady state (recipe loaders at their default data.num_workers)")
    for recipe, steps in (("dit_tiny", opts.pick(75, 30)), ("vlm_tiny", opts.pick(110, 30))):
        cfg = compose([f"recipe={recipe}"])
        say(f"data: {recipe}, {steps} steps, log_every=1, data.num_workers={cfg.data.num_workers}")
        records = train_run(opts, recipe, [f"trainer.max_steps={steps}", "trainer.log_every=1"], opts.work / f"data_{recipe}")
        steady = [r for r in records if r["step"] > warmup]
        fraction = sum(r["data_wait_s"] for r in steady) / sum(r["step_time_s"] for r in steady)
        worst = max(steady, key=lambda r: r["data_wait_s"])
        per_epoch = steps_per_epoch(cfg)
        rows.append([recipe, cfg.data.num_workers, cfg.trainer.micro_batch_size, f"{warmup + 1}-{steps}", per_epoch,
                     f"{fraction:.2%}", f"{median(r['data_wait_s'] / r['step_time_s'] for r in steady):.2%}",
                     f"{ms(worst['data_wait_s'])} ms (step {worst['step']})", ms(median(r["step_time_s"] for r in steady))])
        s.targets.append(Target(f"{recipe}: data wait <= {TARGET_DATA_WAIT:.0%} of step time", f"{fraction:.2%}",
                                fraction <= TARGET_DATA_WAIT))
        s.data[recipe] = {"fraction": fraction, "records": [{k: r[k] for k in ("step", "step_time_s", "data_wait_s")}
                                                            for r in records]}
    s.tables.append(md_table(["recipe", "workers", "micro batch", "steps", "steps per epoch", "data wait / step time",
                              "median per step", "worst step", "step ms (median)"], rows))
    s.notes.append("from metrics.jsonl (trainer.log_every=1): sum of data_wait_s over sum of step_time_s, steps after "
                   f"{warmup} warm-up; one process, {opts.threads} thread(s)")
    return s


def steps_per_epoch(cfg) -> int:
    """Full batches per epoch of one rank with one reader (the partial last batch is dropped)."""
    meta = json.loads((Path(cfg.data.root) / "meta.json").read_text())
    return meta["splits"]["train"]["samples"] // cfg.trainer.micro_batch_size


# ---- scaling: step time vs width, 1 vs 2 ranks -----------------------------------------------------

WIDTHS = {  # model.* overrides at half, the recipe's own, and double width
    "llm_tiny": lambda f: [f"model.dim={int(128 * f)}", f"model.ffn_dim={int(344 * f)}"],
    "dit_tiny": lambda f: [f"model.attention_head_dim={int(16 * f)}"],
    "vlm_tiny": lambda f: [f"model.text_hidden_size={int(128 * f)}", f"model.text_intermediate_size={int(256 * f)}",
                           f"model.vision_hidden_size={int(64 * f)}", f"model.vision_intermediate_size={int(128 * f)}"],
}


def flops_module():
    """common/flops.py if present (MFU); the benchmark runs without it."""
    try:
        return importlib.import_module("common.flops")
    except ImportError:
        return None


def work(stats: dict) -> float:
    """What a step's FLOPs scale with: token slots of packed rows (LLM, VLM) or samples (DiT)."""
    if stats.get("token_utilization"):
        return stats["tokens"] / stats["token_utilization"]
    return stats.get("samples", 1)


def width_trainers(opts, recipe: str, factors: list[float], n_batches: int):
    """The recipe's trainer at each width; one warm-up step each (FLOPs counted there when common/flops.py
    is present) and, on CUDA, the bytes it keeps resident (weights, grads, Adam state)."""
    import torch

    from common.profiling import StepTimer

    flops_lib, cuda = flops_module(), torch.cuda.is_available()
    timer = StepTimer()
    timer.enabled = False
    trainers, extra, batches = {}, {}, None
    for f in factors:
        overrides = WIDTHS[recipe](f)
        name = overrides[0].removeprefix("model.")  # e.g. dim=64
        before = torch.cuda.memory_allocated() if cuda else 0
        trainers[name] = trainer = build_trainer(opts, recipe, overrides, opts.work / f"scale_{recipe}_{f:g}")
        batches = batches or take(trainer.loader, n_batches)
        trainer.batches = iter([batches[0]])
        flops = None
        with flops_lib.FlopCounter() if flops_lib else contextlib.nullcontext() as counter:
            stats = trainer.train_step(timer)
        if counter is not None:
            flops = (counter.flops, work(stats))
        extra[name] = {"flops": flops, "resident": (torch.cuda.memory_allocated() - before) if cuda else None,
                       "params": sum(p.numel() for p in trainer.model.parameters())}
    return trainers, extra, batches


def width_rows(recipe: str, result: dict, extra: dict, peak: float | None) -> list[list]:
    base = next(iter(result))
    rows = []
    for name, r in result.items():
        t = median(r["times"])
        unit, count = ("images/s", "samples") if recipe == "dit_tiny" else ("tokens/s", "tokens")
        rate = median(st[count] / dt for st, dt in zip(r["stats"], r["times"]))
        mfu = "n/a"
        if extra[name]["flops"] and peak:
            flops0, work0 = extra[name]["flops"]
            mfu = f"{median(flops0 * work(st) / work0 / dt for st, dt in zip(r['stats'], r['times'])) / peak:.2%}"
        memory = "n/a (CPU)"
        if extra[name]["resident"] is not None:
            memory = mib(extra[name]["resident"] + max(r["peaks"]))
        rows.append([recipe, name, f"{extra[name]['params']:,}", ms(t), f"{t / median(result[base]['times']):.2f}x",
                     f"{rate:,.0f} {unit}", mfu, memory])
    return rows


def device_peak_flops(trainer) -> tuple[float | None, str]:
    """Peak FLOP/s of this device at the trainer's precision (a datasheet on GPUs, a measured matmul on CPU)."""
    flops_lib = flops_module()
    if flops_lib is None:
        return None, "common/flops.py not available: no MFU"
    precision = flops_lib.precision_key(trainer.cfg.toggles)
    try:
        peak = flops_lib.peak_flops(trainer.device, precision)
    except ValueError as exc:
        return None, f"no MFU: {exc}"
    where = "datasheet" if trainer.device.type == "cuda" else "measured matmul on this CPU"
    return peak, f"MFU against {peak / 1e12:.3f} TFLOP/s ({precision}, {where}), FLOPs counted on the warm-up step"


def bench_widths(opts, s: Section) -> None:
    factors, steps, warmup = opts.pick([0.5, 1, 2], [0.5, 1]), opts.pick(6, 2), 1
    rows = []
    for recipe in WIDTHS:
        say(f"scaling: {recipe} at widths x{', x'.join(f'{f:g}' for f in factors)}, {steps} steps each, interleaved")
        trainers, extra, batches = width_trainers(opts, recipe, factors, warmup + steps)
        peak, peak_note = device_peak_flops(next(iter(trainers.values())))
        result = interleaved(trainers, batches, warmup)
        rows += width_rows(recipe, result, extra, peak)
        s.data[f"width_{recipe}"] = {n: {"step_s": r["times"], **extra[n]} for n, r in result.items()}
        del trainers
    s.tables.append(md_table(["recipe", "width", "parameters", "step ms (median)", "vs narrowest", "throughput",
                              "MFU", "peak memory"], rows))
    s.notes.append(f"widths: the recipes' trainers side by side in one process, steps interleaved on the same batches, "
                   f"{steps} steps each after {warmup} warm-up, {opts.threads} thread(s); {peak_note}")


def bench_ranks(opts, s: Section) -> None:
    import torch

    from common.launch import compose

    recipes, steps, warmup = opts.pick(["dit_tiny", "vlm_tiny", "llm_tiny"], ["dit_tiny"]), opts.pick(12, 6), 3
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        s.notes.append("ranks: skipped, 2 ranks need 2 GPUs")
        return

    rows = []
    for recipe in recipes:
        batch = compose([f"recipe={recipe}"]).trainer.micro_batch_size
        runs = {}
        for nproc in (1, 2):
            say(f"scaling: {recipe} on {nproc} rank(s), global batch {batch}, {steps} steps")
            records = train_run(opts, recipe, [f"trainer.max_steps={steps}", "trainer.log_every=1",
                                               f"trainer.micro_batch_size={batch // nproc}"],
                                opts.work / f"ranks_{recipe}_{nproc}", nproc=nproc)
            runs[nproc] = [r for r in records if r["step"] > warmup]
        t1, t2 = (median(r["step_time_s"] for r in runs[n]) for n in (1, 2))
        key = "samples_per_s" if recipe == "dit_tiny" else "tokens_per_s"
        rate = {n: median(r[key] for r in runs[n]) for n in (1, 2)}
        unit = key.replace("_per_s", "/s")
        rows.append([recipe, batch, ms(t1), ms(t2), f"{t1 / t2:.2f}x", f"{rate[1]:,.0f} {unit}",
                     f"{rate[2] / 2:,.0f} {unit}"])
        s.data[f"ranks_{recipe}"] = {"step_s_1": [r["step_time_s"] for r in runs[1]],
                                     "step_s_2": [r["step_time_s"] for r in runs[2]]}
    s.tables.append(md_table(["recipe", "global batch", "1 rank: step ms", "2 ranks: step ms", "speedup",
                              "1 rank: throughput", "2 ranks: throughput per rank"], rows))
    s.notes.append(f"ranks: scripts/train.py vs torchrun --nproc_per_node 2 (DiT/VLM: DeepSpeed data parallel; "
                   f"LLM: FSDP2), same global batch, {opts.threads} thread(s) per rank, median step_time_s of steps "
                   f"{warmup + 1}-{steps}; {CPUS} cores shared with other jobs, so 2 ranks cannot give more than ~{CPUS}x")


def bench_scaling(opts) -> Section:
    s = Section("scaling", "Scaling: step time vs model width, and 1 vs 2 ranks")
    bench_widths(opts, s)
    bench_ranks(opts, s)
    return s


# ---- the other benchmark scripts -------------------------------------------------------------------

def run_script(opts, script: str, args: list[str], timeout: float = 900) -> str:
    return run_command(opts, [sys.executable, str(REPO / "scripts" / script), *args], timeout).stdout


def bench_packing(opts) -> Section:
    args = opts.pick([], ["--steps", "2", "--samples-per-step", "32", "--max-seq-len", "256"])
    say(f"packing: scripts/bench_packing.py {' '.join(args)}")
    out = run_script(opts, "bench_packing.py", ["--threads", str(opts.threads), *args])
    s = Section("packing", "Sequence packing vs padding (scripts/bench_packing.py)")
    s.tables.append("\n".join(line for line in out.splitlines() if line.startswith("|")))
    for line in out.splitlines():
        m = re.match(r"target: (.*): (.*) -> (MET|NOT MET)$", line)
        if m:
            s.targets.append(Target(m[1], m[2], m[3] == "MET"))
        elif line.startswith(("check:", "bench_packing:")):
            s.notes.append(line)
    return s


def bench_pipeline(opts) -> Section:
    args = opts.pick([], ["--microbatches", "2", "4", "--rows", "8", "--seq", "64", "--dim", "64", "--warmup", "1",
                          "--iters", "2"])
    say(f"pipeline: scripts/bench_pipeline.py {' '.join(args)}")
    out = run_script(opts, "bench_pipeline.py", ["--threads", str(opts.threads), *args])
    lines = out.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("schedule"))
    rows = [line.split() for line in lines[header + 1:] if line.strip()]
    s = Section("pipeline", "Pipeline bubble, 2 stages (scripts/bench_pipeline.py)")
    s.tables.append(md_table(["schedule", "microbatches", "step s", "idle stage 0", "idle stage 1",
                              "theory (p-1)/(m+p-1)"], rows))
    s.notes.append(lines[header - 1])
    return s


def bench_serving(opts) -> Section:
    s = Section("serving", "Serving (scripts/bench_serve.py --quick)")
    script = REPO / "scripts" / "bench_serve.py"
    spec = importlib.util.spec_from_file_location("bench_serve", script) if script.exists() else None
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert callable(module.main) and "--quick" in script.read_text()
    except Exception as exc:  # written by another engineer; absent or half-written is not our failure
        say(f"serving: not available ({type(exc).__name__})")
        s.notes.append("serving: not available (scripts/bench_serve.py is missing or has no main(argv) with --quick)")
        return s
    tables = opts.out / "serving.md"
    tables.unlink(missing_ok=True)
    say("serving: scripts/bench_serve.py --quick")
    run_script(opts, "bench_serve.py", ["--quick", "--threads", str(opts.threads), "--markdown", str(tables)])
    s.tables.append(tables.read_text())
    return s


# ---- the run --------------------------------------------------------------------------------------

BENCHES = {"overhead": bench_overhead, "ac": bench_ac, "zero": bench_zero, "data": bench_data,
           "scaling": bench_scaling, "packing": bench_packing, "pipeline": bench_pipeline, "serving": bench_serving}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer steps and smaller runs (the smoke test's mode)")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections: {','.join(SECTIONS)}")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads per process, for every benchmark (default 1: on a shared machine "
                        "OpenMP's barriers stall whenever another job takes a core)")
    p.add_argument("--out", default=str(REPO / "outputs" / "bench"), help="where bench.md, bench.json and runs go")
    opts = p.parse_args(argv)
    opts.sections = [s.strip() for s in opts.only.split(",") if s.strip()]
    unknown = [s for s in opts.sections if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    opts.out = Path(opts.out).resolve()
    opts.work = opts.out / "runs"
    opts.log = opts.out / "bench.log"
    opts.pick = lambda full, quick: quick if opts.quick else full
    return opts


def run_section(opts, name: str) -> Section:
    start = time.perf_counter()
    say(f"{name}: start")
    try:
        section = BENCHES[name](opts)
    except Exception as exc:  # one broken benchmark must not cost the others their results
        import traceback

        with open(opts.log, "a") as f:
            traceback.print_exc(file=f)
        section = Section(name, name, error=f"{type(exc).__name__}: {str(exc)[:500]} (traceback in {opts.log})")
    section.data["seconds"] = time.perf_counter() - start
    say(f"{name}: done in {section.data['seconds']:.0f} s")
    print("\n" + section.markdown(), flush=True)
    return section


def report(opts, sections: list[Section], seconds: float) -> str:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({CPUS} cores)"
    head = [f"# Kiln benchmarks{' (--quick)' if opts.quick else ''}", "",
            f"{device}, torch {torch.__version__}, {torch.get_num_threads()} torch threads, "
            f"load average {os.getloadavg()[0]:.1f} at the end; {seconds / 60:.1f} min. "
            "Medians of interleaved repeats (the machine is shared: absolute times are noisy, ratios less so).", ""]
    summary = [[s.name, t.what, t.value, "met" if t.met else "**NOT met**"] for s in sections for t in s.targets]
    summary += [[s.name, "(section failed)", s.error, "**failed**"] for s in sections if s.error]
    if summary:
        head += [md_table(["section", "target", "measured", ""], summary), ""]
    return "\n".join(head) + "\n" + "\n".join(s.markdown() for s in sections)


def main(argv: list[str] | None = None) -> int:
    import torch

    opts = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(opts.threads)
    opts.work.mkdir(parents=True, exist_ok=True)
    opts.log.write_text("")
    start = time.perf_counter()
    sections = [run_section(opts, name) for name in SECTIONS if name in opts.sections]
    markdown = report(opts, sections, time.perf_counter() - start)
    (opts.out / "bench.md").write_text(markdown)
    (opts.out / "bench.json").write_text(json.dumps(
        {s.name: {"title": s.title, "targets": [vars(t) for t in s.targets], "notes": s.notes, "error": s.error,
                  "data": s.data} for s in sections}, indent=1, default=str))
    print("\n" + markdown, flush=True)
    say(f"wrote {opts.out / 'bench.md'} and bench.json")
    return 1 if any(s.error for s in sections) else 0


if __name__ == "__main__":
    sys.exit(main())
