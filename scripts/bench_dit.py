#!/usr/bin/env python
"""DiT benchmarks: activation checkpointing (none / selective / full) on dit_tiny, and latent training from a
latent cache vs encoding with the VAE on the fly. Side by side in one process, steps interleaved.

    python scripts/bench_dit.py [--quick] [--only ac,latents] [--threads 1] [--work outputs/bench/dit]

ac: the bytes a forward keeps alive for backward (every storage created during dit_tiny's forward +
loss that is still alive when it returns, weights and the batch excluded: this also sees what
selective AC's cache holds, which saved_tensors_hooks do not) beside common/memory.py's prediction,
and train_step time with each mode on the same batches, rotating which mode goes first.

latents: the DiT recipe's trainer on VAE latents of 256x256 images, (a) encoding each batch with the
VAE (data.root = image shards) and (b) reading the posterior moments from a latent cache built by
data.cache_latents (data.latents), same initial weights, same batches, steps interleaved. The models
are DiT-XL/2 and sd-vae-ft-mse's AutoencoderKL with every width divided by the same factor (8; 16
with --quick), which keeps their FLOP ratio (both scale with width^2, but for attention's s^2 term),
so the measured ratio stands in for the full-size one on a CPU; FLOPs of the full-size pair (counted
on the meta device) give the compute-bound ratio. Prints markdown tables and target lines.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TARGET_SELECTIVE_SAVED = 0.50  # selective AC keeps at most half the activation bytes of no AC ...
TARGET_SELECTIVE_TIME = 1.20  # ... for at most this step-time factor
FAST_DIT_RATIO = 1.95  # fast-DiT: DiT-XL/2 at 256px on an A100, 0.43 -> 0.84 steps/s with cached features
SECTIONS = ("ac", "latents")
# sd-vae-ft-mse (stabilityai), the AutoencoderKL of Stable Diffusion 1.x/2.x.
SD_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, block_out_channels=(128, 256, 512, 512),
              down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
              norm_num_groups=32, sample_size=256, scaling_factor=0.18215)
XL2_WIDTH, XL2_HEADS = 1152, 16


def md_table(headers: list[str], rows: list[list]) -> str:
    return "\n".join(["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
                      *("| " + " | ".join(map(str, r)) + " |" for r in rows)])


def say(message: str) -> None:
    print(f"[bench_dit] {message}", file=sys.stderr, flush=True)


def make_trainer(overrides: list[str], run_dir: Path):
    """The recipe's DiTTrainer, built as scripts/train.py builds it."""
    from common.distributed import init_distributed
    from common.launch import compose
    from common.toggles import apply_global_toggles
    from recipes.dit.train import DiTTrainer

    cfg = compose(["recipe=dit_tiny", "trainer.progress_bar=false", "trainer.eval=false", "checkpoint.final=false",
                   "run.resume=never", "profile.count_flops=false", *overrides, f"run.dir={run_dir}"])
    apply_global_toggles(cfg.toggles)
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = DiTTrainer(cfg, init_distributed(), run_dir)
    trainer.engine.train()
    return trainer


def first_batches(trainer, n: int) -> list:
    it = iter(trainer.state.loader)
    batches = [next(it) for _ in range(n)]
    trainer.state.loader.close()
    return batches


def interleaved(trainers: dict, batches: dict, warmup: int) -> dict[str, dict]:
    """Step i of every trainer (on its own copy of batch i) before any takes step i+1, the order
    rotating each step so machine noise lands on all alike: per trainer, times and losses after warm-up.
    Each trainer keeps its own RNG stream (the process-global one, swapped in and out), so all of
    them draw the same noise and timesteps at step i, as separate runs with one seed would."""
    from common.profiling import StepTimer
    from common.seed import rng_state, set_rng_state

    timer = StepTimer()
    timer.enabled = False  # what a non-logging step of the loop does
    names = list(trainers)
    out = {n: {"times": [], "losses": []} for n in names}
    start_rng = rng_state()
    streams = {n: start_rng for n in names}
    for i in range(len(batches[names[0]])):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            set_rng_state(streams[name])
            start = time.perf_counter()
            stats = trainers[name].train_step(iter([batches[name][i]]), timer)
            seconds = time.perf_counter() - start
            streams[name] = rng_state()
            if i >= warmup:
                out[name]["times"].append(seconds)
                out[name]["losses"].append(stats.loss)
    return out


def ratio(times: list[float], base: list[float]) -> float:
    """Median of per-step ratios: step i of both ran the same batch."""
    return statistics.median(t / b for t, b in zip(times, base))


# ---- activation checkpointing ------------------------------------------------------------------------

def bench_ac(opts) -> str:
    from torch.utils.flop_counter import FlopCounterMode

    from common.memory import layer_activation_bytes
    from common.tools.activations import kept_for_backward
    from recipes.dit.train import memory_spec

    warmup, steps = 1, (3 if opts.quick else 12)
    batch = ["trainer.micro_batch_size=16"] if opts.quick else []
    modes = ("none", "selective", "full")
    say(f"ac: dit_tiny, AC {'/'.join(modes)}, {warmup + steps} steps each, interleaved")
    trainers = {m: make_trainer([f"toggles.activation_checkpointing={m}", *batch], opts.work / f"ac_{m}") for m in modes}
    batches = first_batches(trainers["none"], warmup + steps)
    kept, flops = {}, {}
    for mode, trainer in trainers.items():
        exclude = [*trainer.model.parameters(), *trainer.model.buffers(), *batches[0].values()]
        kept[mode], out = kept_for_backward(lambda: trainer.diffusion_loss(batches[0]), exclude)
        del out
        # FLOPs of forward + backward, the recomputation included (ops a selective policy serves from
        # its cache never reach the counter): what the step time is on a compute-bound device.
        with FlopCounterMode(display=False) as counter:
            trainer.engine.backward(trainer.diffusion_loss(batches[0]))
        trainer.model.zero_grad(set_to_none=True)  # no step: these gradients are dropped
        flops[mode] = counter.get_total_flops()
    result = interleaved(trainers, {m: batches for m in modes}, warmup)
    spec = memory_spec(trainers["none"].cfg)
    shape = dict(seq=spec.seq, batch=spec.micro_batch, act_bytes=spec.act_bytes)
    planned = {m: spec.layers * layer_activation_bytes(spec.block, recompute=m, **shape) for m in modes}
    base = result["none"]["times"]
    rows = [[m, f"{kept[m] / 2**20:.2f}", f"{kept[m] / kept['none']:.2f}", f"{planned[m] / 2**20:.2f}",
             f"{flops[m] / flops['none']:.3f}x", f"{statistics.median(result[m]['times']) * 1e3:.1f}",
             f"{ratio(result[m]['times'], base):.2f}x"] for m in modes]
    fewer, slower = 1 - kept["selective"] / kept["none"], ratio(result["selective"]["times"], base)
    met = fewer >= TARGET_SELECTIVE_SAVED and slower <= TARGET_SELECTIVE_TIME
    cfg = trainers["none"].cfg
    lines = ["## DiT activation checkpointing: bytes kept for backward and step time (dit_tiny)", "",
             md_table(["AC", "kept for backward (MiB)", "vs none", "common/memory.py, blocks only (MiB)",
                       "fwd+bwd FLOPs vs none", "train_step ms (median)", "vs none"], rows), "",
             f"- target: dit_tiny: selective AC keeps <= {1 - TARGET_SELECTIVE_SAVED:.0%} of the activation bytes of no AC "
             f"for <= {TARGET_SELECTIVE_TIME:.2f}x the step time: {fewer:.1%} fewer bytes, {slower:.2f}x time -> "
             f"**{'met' if met else 'NOT met'}**",
             f"- full AC: {1 - kept['full'] / kept['none']:.1%} fewer bytes, "
             f"{ratio(result['full']['times'], base):.2f}x time",
             f"- FLOPs (torch's FlopCounterMode over forward + backward, recomputation included): selective "
             f"{flops['selective'] / flops['none']:.3f}x, full {flops['full'] / flops['none']:.3f}x of no AC -- the "
             f"step-time factors of a compute-bound device. On a CPU at dit_tiny's width "
             f"(64) the recomputed elementwise ops (layer norms, adaLN modulation, tanh-GELU on the 4h tensor) and "
             f"the selective policy's per-op Python dispatch cost as much as the matmuls it skips.",
             f"- micro batch {cfg.trainer.micro_batch_size} x {spec.seq} tokens, fp32, {opts.threads} torch thread(s); "
             f"{steps} steps per mode after {warmup} warm-up, modes rotating first; 'vs none' time is the median "
             f"of per-step ratios. Selective = common/toggles.py's policy with recompute_widening (the DiT's): "
             f"keep matmul and attention outputs except the MLP's up projection and adaLN's modulation."]
    return "\n".join(lines) + "\n"


# ---- latent cache vs on-the-fly encoding -------------------------------------------------------------

def scaled_vae_config(div: int) -> dict:
    groups = min(32, SD_VAE["block_out_channels"][0] // div)
    return {**SD_VAE, "block_out_channels": tuple(c // div for c in SD_VAE["block_out_channels"]), "norm_num_groups": groups}


def xl2_overrides(div: int) -> list[str]:
    width = XL2_WIDTH // div
    heads = max(1, XL2_HEADS // div)
    return ["model=dit_xl2", f"model.num_attention_heads={heads}", f"model.attention_head_dim={width // heads}",
            f"model.norm_num_groups={min(32, width // 8)}"]


def full_size_flops(batch: int) -> tuple[float, float]:
    """(VAE encode FLOPs, DiT-XL/2 train-step FLOPs) per batch of 256x256 images, counted on the meta device."""
    import torch
    from diffusers import AutoencoderKL
    from torch.utils.flop_counter import FlopCounterMode

    from common.launch import compose
    from recipes.dit.model import build_model

    with torch.device("meta"):
        vae = AutoencoderKL(**SD_VAE)
        dit = build_model(compose(["recipe=dit_xl2"]).model, 32, 4)
        x = torch.empty(batch, 3, 256, 256)
        z = torch.empty(batch, 4, 32, 32)
        t, y = torch.zeros(batch), torch.zeros(batch, dtype=torch.long)
        with FlopCounterMode(display=False) as enc:
            with torch.no_grad():
                vae.encode(x)
        with FlopCounterMode(display=False) as step:
            dit(z, timestep=t, class_labels=y).sample.sum().backward()
    return float(enc.get_total_flops()), float(step.get_total_flops())


def write_image_folder(root: Path, n: int, size: int) -> Path:
    """Random RGB images in two class folders."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / f"class_{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(folder / f"{i:04d}.png")
    return root


def bench_latents(opts) -> str:
    import torch
    from diffusers import AutoencoderKL

    from data import cache_latents, prepare_images

    div = 16 if opts.quick else 8
    mb, warmup, steps = (2, 1, 2) if opts.quick else (8, 1, 8)
    work = opts.work / "latents"
    say(f"latents: DiT-XL/2 and SD-VAE at 1/{div} width, 256x256 images, micro batch {mb}: building data")
    folder = write_image_folder(work / "images", n=mb * (warmup + steps) + 8, size=256)
    shards, latents, vae = work / "shards", work / "latents", work / "vae"
    torch.manual_seed(0)
    AutoencoderKL(**scaled_vae_config(div)).save_pretrained(vae)
    common = ["data=images", f"data.root={shards}", "data.image_size=256", f"diffusion.vae={vae}", "data.num_workers=0",
              f"trainer.micro_batch_size={mb}", *xl2_overrides(div)]
    with contextlib.redirect_stdout(sys.stderr):  # their summaries are not part of the report
        rc = prepare_images.main(["--input", str(folder), "--out", str(shards), "--image-size", "256",
                                  "--train-shards", "1", "--val-shards", "1", "--val-fraction", "0.1", "--force"])
        rc = rc or cache_latents.main([*common, "--out", str(latents), "--batch-size", str(mb), "--force"])
    if rc:
        raise RuntimeError("building the bench's image shards or latent cache failed")
    say(f"latents: on-the-fly vs cached, {warmup + steps} steps each, interleaved")
    trainers = {"on-the-fly encoding": make_trainer(common, work / "run_fly"),
                "cached latents": make_trainer([*common, f"data.latents={latents}"], work / "run_cached")}
    batches = {name: first_batches(t, warmup + steps) for name, t in trainers.items()}
    result = interleaved(trainers, batches, warmup)
    fly, cached = result["on-the-fly encoding"], result["cached latents"]
    measured = ratio(fly["times"], cached["times"])
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(fly["losses"], cached["losses"]))
    enc, step = full_size_flops(mb)
    rows = [[name, f"{statistics.median(r['times']) * 1e3:.1f}", f"{ratio(r['times'], cached['times']):.2f}x"]
            for name, r in result.items()]
    lines = ["## DiT latent training: cached latents vs on-the-fly VAE encoding", "",
             md_table(["inputs", "train_step ms (median)", "vs cached"], rows), "",
             f"- on-the-fly / cached step time: {measured:.2f}x measured (DiT-XL/2 + SD-VAE at 1/{div} width, "
             f"256x256 images, micro batch {mb}, fp32, {opts.threads} torch thread(s)); "
             f"{1 + enc / step:.2f}x from the full-size pair's FLOPs (VAE encode {enc / mb / 1e9:.0f} GFLOP + DiT-XL/2 "
             f"train step {step / mb / 1e9:.0f} GFLOP per image); fast-DiT: {FAST_DIT_RATIO:.2f}x (0.43 -> 0.84 "
             f"steps/s for DiT-XL/2 on an A100 with cached features, AC and AMP together).",
             f"- same model, same batches: per-step losses of the two agree to {loss_diff:.1e} (relative); "
             f"{steps} steps each after {warmup} warm-up, alternating first. The cache stores the posterior's mean "
             f"and std, so both draw a fresh latent each step. Image decoding (PNG) is outside the timed step in both."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, smaller batches and models (a smoke run)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections: {', '.join(SECTIONS)}")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--work", type=Path, default=REPO / "outputs" / "bench" / "dit")
    opts = ap.parse_args(argv)
    only = [s for s in opts.only.split(",") if s]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    import torch

    torch.set_num_threads(opts.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(opts.threads))
    opts.work.mkdir(parents=True, exist_ok=True)
    runs = {"ac": bench_ac, "latents": bench_latents}
    for name in only:
        print(runs[name](opts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
