"""DiT: activation checkpointing (none / selective / full) on dit_tiny, and latent training from a latent cache
vs encoding with the VAE on the fly. Side by side in this process, steps interleaved.

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
on the meta device) give the compute-bound ratio.

breakdown: the same scaled pair in bf16 with the GPU presets' parallel.zero_stage=2 on one process, a logged step's
phases (data, VAE, forward, backward, optimizer, EMA, logging) as the step was before (ZeRO-2's partitioned optimizer
kept on one rank, the VAE encoding every batch) and after (one rank runs ZeRO-0; the presets read the latent cache).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from common.activations import kept_for_backward
from scripts.benchmarks.harness import build_trainer, interleaved, model_tensors, quiet, take
from scripts.benchmarks.report import Section, Target, md_table, median, mib, ms, ratio, say

TARGET_SELECTIVE_SAVED = 0.50  # selective AC keeps at most half the activation bytes of no AC ...
TARGET_SELECTIVE_TIME = 1.20  # ... for at most this step-time factor
FAST_DIT_RATIO = 1.95  # fast-DiT: DiT-XL/2 at 256px on an A100, 0.43 -> 0.84 steps/s with cached features
MODES = ("none", "selective", "full")
# sd-vae-ft-mse (stabilityai), the AutoencoderKL of Stable Diffusion 1.x/2.x.
SD_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    layers_per_block=2,
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    norm_num_groups=32,
    sample_size=256,
    scaling_factor=0.18215,
)
XL2_WIDTH, XL2_HEADS = 1152, 16
NO_FLOP_COUNT = ["profile.count_flops=false"]  # the loop's FLOP counter: these sections time train_step alone


def dit_trainer(opts, overrides: list[str], run_dir: Path):
    """The DiT recipe's trainer (dit_tiny with `overrides`), built as scripts/train.py builds it."""
    return build_trainer(opts, "dit_tiny", [*NO_FLOP_COUNT, *overrides], run_dir)


# ---- activation checkpointing ------------------------------------------------------------------------


def ac(opts, s: Section) -> None:
    from common.memory import layer_activation_bytes
    from recipes.dit.sizing import memory_spec

    warmup, steps = 1, opts.pick(12, 3)
    batch = opts.pick([], ["trainer.micro_batch_size=16"])
    say(f"dit: ac, dit_tiny, AC {'/'.join(MODES)}, {warmup + steps} steps each, interleaved")
    trainers = {
        m: dit_trainer(opts, [f"toggles.activation_checkpointing={m}", *batch], opts.work / f"dit_ac_{m}")
        for m in MODES
    }
    batches = take(trainers["none"], warmup + steps)
    kept, flops = _kept_and_flops(trainers, batches[0])
    result = interleaved(trainers, batches, warmup, own_rng=True)
    spec = memory_spec(trainers["none"].cfg)
    shape = dict(seq=spec.seq, batch=spec.micro_batch, act_bytes=spec.act_bytes)
    planned = {m: spec.layers * layer_activation_bytes(spec.block, recompute=m, **shape) for m in MODES}
    base = result["none"]["times"]
    vs_none = {m: ratio(result[m]["times"], base) for m in MODES}
    rows = [
        [
            m,
            mib(kept[m]),
            f"{kept[m] / kept['none']:.2f}",
            mib(planned[m]),
            f"{flops[m] / flops['none']:.3f}x",
            ms(median(result[m]["times"])),
            f"{vs_none[m]:.2f}x",
        ]
        for m in MODES
    ]
    fewer, slower = 1 - kept["selective"] / kept["none"], vs_none["selective"]
    cfg = trainers["none"].cfg
    s.tables.append(
        md_table(
            [
                "AC",
                "kept for backward",
                "vs none",
                "common/memory.py, blocks only",
                "fwd+bwd FLOPs vs none",
                "train_step ms (median)",
                "vs none",
            ],
            rows,
        )
    )
    s.targets.append(
        Target(
            f"dit_tiny: selective AC keeps <= {1 - TARGET_SELECTIVE_SAVED:.0%} of the activation bytes "
            f"of no AC for <= {TARGET_SELECTIVE_TIME:.2f}x the step time",
            f"{fewer:.1%} fewer bytes, {slower:.2f}x time",
            fewer >= TARGET_SELECTIVE_SAVED and slower <= TARGET_SELECTIVE_TIME,
        )
    )
    s.notes += [
        f"full AC: {1 - kept['full'] / kept['none']:.1%} fewer bytes, {vs_none['full']:.2f}x time",
        f"FLOPs (torch's FlopCounterMode over forward + backward, recomputation included): selective "
        f"{flops['selective'] / flops['none']:.3f}x, full {flops['full'] / flops['none']:.3f}x of no AC -- the "
        f"step-time factors of a compute-bound device. On a CPU at dit_tiny's width (64) the recomputed elementwise "
        f"ops (layer norms, adaLN modulation, tanh-GELU on the 4h tensor) and the selective policy's per-op Python "
        f"dispatch cost as much as the matmuls it skips.",
        f"ac: micro batch {cfg.trainer.micro_batch_size} x {spec.seq} tokens, fp32, {opts.threads} torch thread(s); "
        f"{steps} steps per mode after {warmup} warm-up, modes rotating first; 'vs none' time is the median of "
        f"per-step ratios. Selective = common/toggles.py's policy with recompute_widening (the DiT's): keep matmul "
        f"and attention outputs except the MLP's up projection and adaLN's modulation.",
    ]
    s.data["ac"] = {
        "kept_bytes": kept,
        "planned_bytes": planned,
        "flops": flops,
        "step_s": {m: r["times"] for m, r in result.items()},
    }


def _kept_and_flops(trainers: dict, batch: dict) -> tuple[dict, dict]:
    """Per AC mode: the bytes one forward + loss of ``batch`` keeps for backward, and forward + backward FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    kept, flops = {}, {}
    for mode, trainer in trainers.items():
        exclude = [*model_tensors(trainer.model), *batch.values()]
        kept[mode], out = kept_for_backward(lambda: trainer.loss(batch), exclude)
        del out
        # FLOPs of forward + backward, the recomputation included (ops a selective policy serves from
        # its cache never reach the counter): what the step time is on a compute-bound device.
        with FlopCounterMode(display=False) as counter:
            trainer.engine.ds.backward(trainer.loss(batch))
        trainer.model.zero_grad(set_to_none=True)  # no step: these gradients are dropped
        flops[mode] = counter.get_total_flops()
    return kept, flops


# ---- latent cache vs on-the-fly encoding -------------------------------------------------------------


def scaled_vae_config(div: int) -> dict:
    groups = min(32, SD_VAE["block_out_channels"][0] // div)
    return {
        **SD_VAE,
        "block_out_channels": tuple(c // div for c in SD_VAE["block_out_channels"]),
        "norm_num_groups": groups,
    }


def xl2_overrides(div: int) -> list[str]:
    width = XL2_WIDTH // div
    heads = max(1, XL2_HEADS // div)
    return [
        "model=dit_xl2",
        f"model.num_attention_heads={heads}",
        f"model.attention_head_dim={width // heads}",
        f"model.norm_num_groups={min(32, width // 8)}",
    ]


def full_size_flops(batch: int) -> tuple[float, float]:
    """(VAE encode FLOPs, DiT-XL/2 train-step FLOPs) per batch of 256x256 images, counted on the meta device."""
    import torch
    from diffusers import AutoencoderKL
    from torch.utils.flop_counter import FlopCounterMode

    from recipes.dit.model import build_model
    from scripts.kiln.launch import compose

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


def latent_inputs(opts) -> dict:
    """The latents' and the step breakdown's inputs, built once: random 256x256 images as shards, a VAE shaped like
    SD's at 1/div width, and its latent cache (data.cache_latents); the overrides both sections train with."""
    import torch
    from diffusers import AutoencoderKL

    from data import cache_latents, prepare_images

    div = opts.pick(8, 16)
    mb, warmup, steps = opts.pick((8, 1, 8), (2, 1, 2))
    work = opts.work / "dit_latents"
    say(f"dit: latents, DiT-XL/2 and SD-VAE at 1/{div} width, 256x256 images, micro batch {mb}: building data")
    folder = write_image_folder(work / "images", n=mb * (warmup + steps) + 8, size=256)
    shards, cache, vae = work / "shards", work / "latents", work / "vae"
    torch.manual_seed(0)
    AutoencoderKL(**scaled_vae_config(div)).save_pretrained(vae)
    common = [
        "data=images",
        f"data.root={shards}",
        "data.image_size=256",
        f"diffusion.vae={vae}",
        "data.num_workers=0",
        f"trainer.micro_batch_size={mb}",
        *xl2_overrides(div),
    ]
    with quiet(opts.log):  # their summaries are not part of the report
        rc = prepare_images.main(
            [
                "--input",
                str(folder),
                "--out",
                str(shards),
                "--image-size",
                "256",
                "--train-shards",
                "1",
                "--val-shards",
                "1",
                "--val-fraction",
                "0.1",
                "--force",
            ]
        )
        rc = rc or cache_latents.main([*common, "--out", str(cache), "--batch-size", str(mb), "--force"])
    if rc:
        raise RuntimeError("building the bench's image shards or latent cache failed")
    return dict(common=common, cache=cache, work=work, div=div, mb=mb, warmup=warmup, steps=steps)


def latents(opts, s: Section, inputs: dict) -> None:
    common, cache, work, div = inputs["common"], inputs["cache"], inputs["work"], inputs["div"]
    mb, warmup, steps = inputs["mb"], inputs["warmup"], inputs["steps"]
    say(f"dit: latents, on-the-fly vs cached, {warmup + steps} steps each, interleaved")
    trainers = {
        "on-the-fly encoding": dit_trainer(opts, common, work / "run_fly"),
        "cached latents": dit_trainer(opts, [*common, f"data.latents={cache}"], work / "run_cached"),
    }
    batches = {name: take(t, warmup + steps) for name, t in trainers.items()}
    result = interleaved(trainers, batches, warmup, own_rng=True)
    fly, cached = result["on-the-fly encoding"], result["cached latents"]
    measured = ratio(fly["times"], cached["times"])
    losses = {name: [float(st.loss) for st in r["stats"]] for name, r in result.items()}
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses["on-the-fly encoding"], losses["cached latents"]))
    enc, step = full_size_flops(mb)
    rows = [[name, ms(median(r["times"])), f"{ratio(r['times'], cached['times']):.2f}x"] for name, r in result.items()]
    s.tables.append(md_table(["inputs", "train_step ms (median)", "vs cached"], rows))
    s.notes += [
        f"on-the-fly / cached step time: {measured:.2f}x measured (DiT-XL/2 + SD-VAE at 1/{div} width, 256x256 images, "
        f"micro batch {mb}, fp32, {opts.threads} torch thread(s)); {1 + enc / step:.2f}x from the full-size pair's "
        f"FLOPs (VAE encode {enc / mb / 1e9:.0f} GFLOP + DiT-XL/2 train step {step / mb / 1e9:.0f} GFLOP per image); "
        f"fast-DiT: {FAST_DIT_RATIO:.2f}x (0.43 -> 0.84 steps/s for DiT-XL/2 on an A100 with cached features, AC and "
        f"AMP together).",
        f"same model, same batches: per-step losses of the two agree to {loss_diff:.1e} (relative); {steps} steps each "
        f"after {warmup} warm-up, alternating first. The cache stores the posterior's mean and std, so both draw a "
        f"fresh latent each step. Image decoding (PNG) is outside the timed step in both.",
    ]
    s.data["latents"] = {
        "ratio": measured,
        "flops_ratio": 1 + enc / step,
        "max_loss_rel_diff": loss_diff,
        "step_s": {name: r["times"] for name, r in result.items()},
    }


# ---- the step's breakdown: what a GPU preset's step was (ZeRO-2 on one process, the VAE in the step) and is now ----
PHASES = ("data", "VAE", "forward", "backward", "optimizer", "EMA", "logging")
BREAKDOWN = {  # name -> (overrides, keep ZeRO's partitioning on one process: the step before one rank ran ZeRO-0)
    "before: ZeRO-2, VAE on the fly": ([], True),
    "ZeRO-0, VAE on the fly": ([], False),
    "after: ZeRO-0, latent cache": (["data.latents={cache}"], False),
}


@contextlib.contextmanager
def partitioned_on_one_rank():
    """The engine as Kiln built it before one rank ran ZeRO-0: parallel.zero_stage as configured (the bench's "before"
    row; common/deepspeed.py zero_stage)."""
    from common import deepspeed as ds

    saved = ds.zero_stage
    ds.zero_stage = lambda cfg, dp: cfg.parallel.zero_stage
    try:
        yield
    finally:
        ds.zero_stage = saved


def timed_phases(trainer, batch, timer) -> dict[str, float]:
    """One step of `trainer` on `batch` as the loop runs a logged step, seconds per PHASES: train_step's own phases
    (data_wait, forward, backward, optimizer), the VAE (or the cache's moments -> latents) timed inside the forward
    and taken out of it, then the EMA update and the logged record (its device-to-host reads)."""
    clean = trainer.clean_inputs

    def timed_clean(*args):
        with timer.phase("vae"):
            return clean(*args)

    trainer.clean_inputs = timed_clean
    try:
        start = time.perf_counter()
        stats = trainer.train_step(iter([batch]), timer)
        step_time = time.perf_counter() - start
    finally:
        trainer.clean_inputs = clean
    trainer.state.step += 1
    with timer.phase("ema"):
        trainer.ema.update()
    with timer.phase("logging"):
        json.dumps(stats.record(step_time))
    t = timer.pop()
    return {
        "data": t["data_wait_s"],
        "VAE": t["vae_s"],
        "forward": t["forward_s"] - t["vae_s"],
        "backward": t["backward_s"],
        "optimizer": t["optimizer_s"],
        "EMA": t["ema_s"],
        "logging": t["logging_s"],
    }


def breakdown(opts, s: Section, inputs: dict) -> None:
    from common.profiling import StepTimer
    from common.seed import rng_state, set_rng_state

    mb, warmup, steps, div = inputs["mb"], inputs["warmup"], inputs["steps"], inputs["div"]
    base = [*inputs["common"], "toggles.precision=bf16", "parallel.zero_stage=2"]  # the GPU presets' choices
    trainers, batches = {}, {}
    for name, (extra, partitioned) in BREAKDOWN.items():
        overrides = [*base, *(e.format(cache=inputs["cache"]) for e in extra)]
        with partitioned_on_one_rank() if partitioned else contextlib.nullcontext():
            trainers[name] = dit_trainer(opts, overrides, inputs["work"] / f"breakdown_{len(trainers)}")
        batches[name] = take(trainers[name], warmup + steps)
    say(f"dit: step breakdown, {len(trainers)} layouts, {warmup + steps} steps each, interleaved")
    timer, names = StepTimer(), list(trainers)
    phases = {n: [] for n in names}
    streams = dict.fromkeys(names, rng_state())
    for i in range(warmup + steps):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            set_rng_state(streams[name])
            seconds = timed_phases(trainers[name], batches[name][i], timer)
            streams[name] = rng_state()
            if i >= warmup:
                phases[name].append(seconds)
    med = {n: {p: median([x[p] for x in phases[n]]) for p in PHASES} for n in names}
    total = {n: median([sum(x.values()) for x in phases[n]]) for n in names}
    first = names[0]
    rows = [[n, *(ms(med[n][p]) for p in PHASES), ms(total[n]), f"{total[first] / total[n]:.2f}x"] for n in names]
    s.tables.append(md_table(["step", *(f"{p} ms" for p in PHASES), "total ms", "speed-up"], rows))
    zero2, zero0 = med[first], med[names[1]]
    opt, bwd = zero2["optimizer"] / zero0["optimizer"], zero2["backward"] / zero0["backward"]
    s.notes.append(
        f"step breakdown: DiT-XL/2 + SD-VAE at 1/{div} width, micro batch {mb}, bf16, parallel.zero_stage=2 as the "
        f"GPU presets set it, one process, {opts.threads} torch thread(s), medians of {steps} steps after {warmup} "
        f"warm-up, layouts rotating first. ZeRO-2 / ZeRO-0 on one rank: optimizer {opt:.2f}x, backward {bwd:.2f}x "
        f"(ZeRO-2's gradient hooks copy each gradient into its reduce buckets); the whole step before / after: "
        f"{total[first] / total[names[-1]]:.2f}x. On this shared 2-core CPU the absolute times "
        "are noisy (other jobs run beside it): read the ratios. 'data' is the step's batch preparation (the loader's "
        "decoding runs before it); 'VAE' is the encode on the fly, or the cache's moments -> latent."
    )
    s.data["breakdown"] = {"median_s": med, "total_s": total}


# ---- a DiT step by hand: what scripts/gpu_check.py measures Kiln's DiT step against on a GPU -----------------------


def ddpm_alphas_cumprod(steps: int = 1000):
    """The DiT paper's DDPM schedule (linear betas 1e-4 .. 0.02 over 1000 steps): cumulative products of 1 - beta."""
    import torch

    return torch.cumprod(1 - torch.linspace(1e-4, 0.02, steps, dtype=torch.float64), 0).float()


def dit_batch(micro: int, num_classes: int, device, *, channels: int = 4, size: int = 32, seed: int = 0) -> dict:
    """One micro batch as a latent cache gives it: latents x0, the noise, timesteps and class labels."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x0, noise = (torch.randn(micro, channels, size, size, generator=g) for _ in range(2))
    t, y = torch.randint(0, 1000, (micro,), generator=g), torch.randint(0, num_classes, (micro,), generator=g)
    return {k: v.to(device) for k, v in {"x0": x0, "noise": noise, "t": t, "y": y}.items()}


def bare_dit_step(model, opt, *, grad_clip: float, ema_decay: float, autocast=None):
    """A hand-written DiT training step: DDPM noising of the batch's latents, the epsilon-prediction MSE under
    `autocast`, backward, clip, torch's AdamW, and an EMA of the weights (one foreach lerp). It shares none of Kiln's
    step code (no DeepSpeed, no trainer): the reference scripts/gpu_check.py's dit_mfu rows time Kiln's step against
    (fp32 weights under bf16 autocast, the fused AdamW: plain PyTorch mixed precision)."""
    import torch
    import torch.nn.functional as F

    params = [p for p in model.parameters() if p.requires_grad]
    ema = [p.detach().clone() for p in params]
    alphas = ddpm_alphas_cumprod().to(params[0].device)

    def step(batch: dict) -> torch.Tensor:
        a = alphas[batch["t"]].view(-1, 1, 1, 1)
        x_t = a.sqrt() * batch["x0"] + (1 - a).sqrt() * batch["noise"]
        device = x_t.device.type
        with torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext():
            pred = model(x_t, timestep=batch["t"], class_labels=batch["y"]).sample
        loss = F.mse_loss(pred.float(), batch["noise"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - ema_decay)
        return loss.detach()

    step.ema = ema
    return step


def run(opts) -> Section:
    s = Section("dit", "DiT: selective activation checkpointing; cached vs on-the-fly latents; the step's breakdown")
    ac(opts, s)
    inputs = latent_inputs(opts)
    latents(opts, s, inputs)
    breakdown(opts, s, inputs)
    return s
