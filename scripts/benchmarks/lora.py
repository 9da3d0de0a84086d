"""LoRA against full fine-tuning of the same tiny model (llm_tiny from one base checkpoint) in one run: the trainable
fraction, step time, checkpoint bytes, model-state bytes and the process's peak memory.

The base is llm_tiny's seeded init exported as a Hugging Face folder (with the pydoc data's tokenizer); both runs
start from it (model.init_from), one with finetune=full, one with finetune=lora (rank 8 on the seven projections).
Step time: both trainers in this process, alternating steps on the same batches. Checkpoint bytes: the files of
one checkpoint each (DCP: weights + Adam state, of the adapter alone under LoRA). Model-state bytes: the tensors
of weights, gradients and optimizer state after a step, each storage once. Peak memory: CPU has no allocator
statistics, so each run trains in a fresh process (scripts/kiln/processes.py's spawn_ranks) and reports its peak
resident set (VmHWM) above its resident set after imports (peft's too) and process-group start (the same counter
as the loading section); it counts everything the process touches (the base's safetensors, loader, tokenizer,
allocator caches), so at this size it moves less than the state bytes do.

Targets: a LoRA checkpoint at most a quarter of a full one's bytes; LoRA's model states at most half of full
fine-tuning's; a LoRA step no slower than 1.25x a full one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from scripts.benchmarks.harness import build_trainer, interleaved, take
from scripts.benchmarks.loading import _reset_peak, _status
from scripts.benchmarks.report import Section, Target, md_table, median, mib, ms, ratio, say

TARGET_CHECKPOINT, TARGET_STATES, TARGET_TIME = 0.25, 0.5, 1.25
METHODS = ("full", "lora")


def state_bytes(trainer) -> int:
    """Bytes of the model's weights, their gradients and the optimizer's state tensors, each storage once."""
    storages: dict[int, int] = {}
    tensors = [t for p in trainer.model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [v for state in trainer.engine.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def checkpoint_bytes(trainer) -> int:
    trainer.save_checkpoint()
    folder = trainer.run_dir / "checkpoints" / f"step_{trainer.state.step:07d}"
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _peak_rss(argv: list[str], run_dir: str) -> dict:
    """One training run in this (fresh) process: its peak resident set above the post-import baseline."""
    import peft  # noqa: F401 (imported before the baseline in both runs: its modules are not training memory)

    from common.distributed import init_distributed
    from recipes.llm.train import LLMTrainer
    from scripts.kiln.launch import compose

    baseline = _reset_peak()
    trainer = LLMTrainer(compose([*argv, f"run.dir={run_dir}"]), init_distributed(), Path(run_dir))
    trainer.fit()
    return {"peak": _status("VmHWM") - baseline}


def base_checkpoint(opts) -> Path:
    """llm_tiny's seeded init as a Hugging Face folder with the data's tokenizer: the base both runs start from."""
    seed = build_trainer(opts, "llm_tiny", [], opts.work / "lora_base")
    return seed.export()


def run(opts) -> Section:
    warmup, steps = 1, opts.pick(10, 2)
    s = Section("lora", "LoRA vs full fine-tuning of the same model (llm_tiny from one base checkpoint)")
    say("lora: exporting llm_tiny's seeded init as the base checkpoint")
    base = base_checkpoint(opts)
    args = {m: [f"finetune={m}", f"model.init_from={base}", "data.num_workers=0"] for m in METHODS}
    trainers = {m: build_trainer(opts, "llm_tiny", args[m], opts.work / f"lora_{m}") for m in METHODS}
    say(f"lora: full vs lora, {warmup + steps} steps each, interleaved")
    by_method = interleaved(trainers, take(trainers["full"], warmup + steps), warmup)
    params = {m: sum(p.numel() for p in t.model.parameters()) for m, t in trainers.items()}
    trainable = {m: sum(p.numel() for p in t.model.parameters() if p.requires_grad) for m, t in trainers.items()}
    states = {m: state_bytes(t) for m, t in trainers.items()}
    ckpt = {m: checkpoint_bytes(t) for m, t in trainers.items()}
    say("lora: peak memory of each method in a fresh process")
    peaks = _fresh_peaks(opts, args, warmup + steps)

    time_ratio = ratio(by_method["lora"]["times"], by_method["full"]["times"])
    ratios = {
        "trainable_fraction": trainable["lora"] / params["lora"],
        "step_time": time_ratio,
        "checkpoint_bytes": ckpt["lora"] / ckpt["full"],
        "model_state_bytes": states["lora"] / states["full"],
        "peak_rss": peaks["lora"] / peaks["full"],
    }
    s.tables.append(_table(params, trainable, by_method, ckpt, states, peaks, ratios, time_ratio))
    s.targets += [
        Target(
            f"LoRA checkpoint <= {TARGET_CHECKPOINT}x a full one's bytes",
            f"{ratios['checkpoint_bytes']:.3f}x",
            ratios["checkpoint_bytes"] <= TARGET_CHECKPOINT,
        ),
        Target(
            f"LoRA model states (weights + grads + Adam) <= {TARGET_STATES}x full's",
            f"{ratios['model_state_bytes']:.3f}x",
            ratios["model_state_bytes"] <= TARGET_STATES,
        ),
        Target(f"LoRA step time <= {TARGET_TIME}x full's", f"{time_ratio:.2f}x", time_ratio <= TARGET_TIME),
    ]
    s.notes.append(
        f"step: the trainer's train_step, full and lora alternating on the same batches, {steps} steps each "
        f"after {warmup} warm-up; the ratio is the median of per-step ratios. Peak RSS: each method trains "
        f"{warmup + steps} steps in a fresh process; VmHWM above the resident set after imports."
    )
    s.data = {
        "base": str(base),
        "params": params,
        "trainable": trainable,
        "checkpoint_bytes": ckpt,
        "model_state_bytes": states,
        "peak_rss_bytes": peaks,
        "ratios": ratios,
        "step_s": {m: r["times"] for m, r in by_method.items()},
    }
    return s


def _fresh_peaks(opts, args: dict[str, list[str]], total_steps: int) -> dict[str, int]:
    """Each method's peak RSS above its baseline, training ``total_steps`` steps in a fresh process."""
    from scripts.kiln.processes import spawn_ranks

    peaks = {}
    for m in METHODS:
        run_dir = opts.work / f"lora_peak_{m}"
        argv = [
            "recipe=llm_tiny",
            "trainer.progress_bar=false",
            "trainer.eval=false",
            "checkpoint.final=false",
            "run.resume=never",
            f"trainer.max_steps={total_steps}",
            *args[m],
        ]
        peaks[m] = spawn_ranks(_peak_rss, (argv, str(run_dir)), 1, run_dir.parent, threads=opts.threads)[0]["peak"]

    return peaks


def _table(params, trainable, by_method, ckpt, states, peaks, ratios, time_ratio: float) -> str:
    """The section's table: a row per method, then their ratios."""
    rows = [
        [
            m,
            f"{trainable[m]:,} / {params[m]:,} ({trainable[m] / params[m]:.1%})",
            ms(median(by_method[m]["times"])),
            f"{ckpt[m]:,}",
            mib(states[m]),
            mib(peaks[m]),
        ]
        for m in METHODS
    ]
    rows.append(
        [
            "lora / full",
            f"{ratios['trainable_fraction']:.3f} of the model",
            f"{time_ratio:.2f}x",
            f"{ratios['checkpoint_bytes']:.3f}x",
            f"{ratios['model_state_bytes']:.3f}x",
            f"{ratios['peak_rss']:.3f}x",
        ]
    )
    return md_table(
        [
            "method",
            "trainable / all parameters",
            "step ms (median)",
            "checkpoint bytes",
            "weights + grads + Adam",
            "peak RSS above baseline",
        ],
        rows,
    )
