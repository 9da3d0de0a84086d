"""DiT recipe: class-conditional diffusion on digit shards with DeepSpeed ZeRO, EMA, samples, eval, export.

Read top to bottom: setup (data, model, engine, resume) → train_step → train → evaluate → export.
"""

from __future__ import annotations

import functools
import json
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, DiTTransformer2DModel

from common.checkpoint import CheckpointManager, read_meta
from common.config import TrainConfig
from common.errors import ConfigError
from common.deepspeed import local_state_bytes, zero_state_bytes
from common.distributed import DistInfo, all_reduce_mean, barrier
from common.ema import EMA
from common.metrics import MetricsLogger
from common.optim import lr_factor
from common.profiling import StepTimer, maybe_profile
from common.seed import rng_state, seed_everything, set_rng_state
from recipes.dit.data import build_train_loader, prepare_data
from recipes.dit.evaluate import class_labels, fit_digit_classifier, score_samples
from recipes.dit.model import build_model, null_class
from recipes.dit.parallelize import parallelize
from recipes.dit.sampling import sample_images, save_grid


def noise_scheduler(cfg: TrainConfig) -> DDPMScheduler:
    d = cfg.diffusion
    return DDPMScheduler(
        num_train_timesteps=d.num_train_timesteps,
        beta_schedule=d.beta_schedule,
        prediction_type=d.prediction_type,
        clip_sample=False,
    )


class DiTTrainer:
    def __init__(self, cfg: TrainConfig, dist: DistInfo, run_dir: Path):
        self.cfg, self.dist, self.run_dir = cfg, dist, run_dir
        self.device = dist.device

        meta = prepare_data(cfg, dist)
        self.loader = build_train_loader(cfg, dist, meta["train_urls"])

        self.scheduler = noise_scheduler(cfg)
        seed_everything(cfg.trainer.seed)  # identical initial weights on every rank
        model = build_model(cfg.model, cfg.data.image_size)
        self.null_class = null_class(model)
        schedule = functools.partial(lr_factor, cfg=cfg.optim, max_steps=cfg.trainer.max_steps)
        self.engine = parallelize(
            model, cfg, dist.world_size, lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        )
        self.model = self.engine.module
        self.dtype = next(self.model.parameters()).dtype
        # Plain fp32 DDP-style training (ZeRO-0) keeps whole gradients on p.grad, and its
        # optimizer does not report a gradient norm: compute it there ourselves.
        self.full_grads = cfg.parallel.zero_stage == 0 and self.dtype == torch.float32
        self.ema = EMA(self.model, cfg.diffusion.ema_decay)
        self.sample_gen = torch.Generator().manual_seed(cfg.trainer.seed + 12345)
        seed_everything(cfg.trainer.seed + 1 + dist.rank)  # per-rank noise, timesteps, label drops

        self.step = 0
        self.ckpt = CheckpointManager(run_dir, cfg.checkpoint.keep, dist)
        resume_from = self.ckpt.resolve_resume(cfg.run.resume)
        if resume_from is not None:
            self.load_checkpoint(resume_from)

    # ---- one optimizer step -------------------------------------------------------------
    def diffusion_loss(self, batch: dict) -> torch.Tensor:
        x0 = batch["image"].to(self.device)
        labels = batch["label"].to(self.device)
        n = x0.shape[0]
        noise = torch.randn_like(x0)
        t = torch.randint(0, self.cfg.diffusion.num_train_timesteps, (n,), device=self.device)
        drop = torch.rand(n, device=self.device) < self.cfg.diffusion.class_dropout
        labels = torch.where(drop, torch.full_like(labels, self.null_class), labels)
        x_t = self.scheduler.add_noise(x0, noise, t)
        pred = self.engine(x_t.to(self.dtype), timestep=t, class_labels=labels).sample
        target = noise if self.cfg.diffusion.prediction_type == "epsilon" else self.scheduler.get_velocity(x0, noise, t)
        return F.mse_loss(pred.float(), target)

    def train_step(self, batches, timer: StepTimer) -> dict:
        losses, grad_norm = [], None
        for _ in range(self.cfg.trainer.grad_accum):
            with timer.phase("data_wait"):
                batch = next(batches)
            with timer.phase("forward"):
                loss = self.diffusion_loss(batch)
            with timer.phase("backward"):
                self.engine.backward(loss)  # all-reduces gradients at the accumulation boundary
            if self.engine.is_gradient_accumulation_boundary() and self.full_grads:
                grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
            with timer.phase("optimizer"):
                self.engine.step()  # steps the optimizer and lr only at the accumulation boundary
            losses.append(loss.item())
        self.ema.update(self.step)
        if grad_norm is None:  # ZeRO and bf16 optimizers compute the norm while clipping
            grad_norm = self.engine.get_global_grad_norm()
        return {
            "loss": all_reduce_mean(sum(losses) / len(losses), self.device),
            "lr": self.engine.get_lr()[0],
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        }

    # ---- the loop -------------------------------------------------------------------------
    def train(self) -> None:
        cfg, t = self.cfg, self.cfg.trainer
        global_batch = t.micro_batch_size * t.grad_accum * self.dist.world_size
        metrics = MetricsLogger(
            self.run_dir, self.dist, max_steps=t.max_steps, start_step=self.step, progress_bar=t.progress_bar
        )
        self.engine.train()
        batches = iter(self.loader)
        timer = StepTimer()
        start_step = self.step
        with maybe_profile(cfg.profile, self.run_dir, self.dist.rank) as prof:
            while self.step < t.max_steps:
                log_now = (self.step + 1) % t.log_every == 0 or self.step + 1 == t.max_steps
                timer.enabled = log_now or cfg.profile.enabled
                start = time.perf_counter()
                stats = self.train_step(batches, timer)
                self.step += 1
                if self.step == start_step + 1:
                    self.record_memory()  # optimizer state exists after the first step
                step_time = time.perf_counter() - start
                prof.step()
                metrics.advance()
                if log_now:
                    phases = timer.pop()
                    metrics.log(self.step, {
                        **stats,
                        "step_time_s": step_time,
                        "data_wait_s": phases.pop("data_wait_s", 0.0),
                        **phases,
                        "samples_per_s": global_batch / step_time,
                        "corrupt_shards": self.loader.corrupt_shards,
                    })
                if t.sample_every and self.step % t.sample_every == 0:
                    self.save_samples(f"step_{self.step:07d}.png")
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                    self.save_checkpoint()
        if cfg.checkpoint.final:
            self.save_checkpoint()
        self.loader.close()
        metrics.close()

    def record_memory(self) -> None:
        """memory.json: measured per-rank weight + optimizer-state bytes beside the ZeRO formula."""
        import torch.distributed as tdist

        measured = [None] * self.dist.world_size
        tdist.all_gather_object(measured, local_state_bytes(self.engine))
        if self.dist.is_main:
            n = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in self.model.parameters())
            predicted = zero_state_bytes(n, self.cfg.parallel.zero_stage, self.dist.world_size, self.cfg.toggles.precision)
            info = {
                "zero_stage": self.cfg.parallel.zero_stage, "world_size": self.dist.world_size, "num_params": n,
                "per_rank_state_bytes": measured,
                "predicted_weights_plus_optimizer_bytes": predicted["weights"] + predicted["optimizer"],
            }
            (self.run_dir / "memory.json").write_text(json.dumps(info, indent=2))

    # ---- checkpoints ----------------------------------------------------------------------
    def rank_state(self) -> dict:
        """What DeepSpeed's checkpoint lacks, per rank: RNG streams, data position, EMA shard."""
        return {
            "step": self.step,
            "rng": rng_state(),
            "sample_gen": self.sample_gen.get_state(),
            "data": self.loader.state_dict(),
            "ema": self.ema.state_dict(),
        }

    def load_rank_state(self, state: dict) -> None:
        self.step = state["step"]
        set_rng_state(state["rng"])
        self.sample_gen.set_state(state["sample_gen"])
        self.loader.load_state_dict(state["data"])
        self.ema.load_state_dict(state["ema"])

    def save_checkpoint(self) -> None:
        def write(tmp: Path) -> None:
            self.engine.save_checkpoint(str(tmp.parent), tag=tmp.name, save_latest=False)
            torch.save(self.rank_state(), tmp / f"rank{self.dist.rank:05d}.pt")

        self.ckpt.save(self.step, write, meta={"recipe": self.cfg.recipe.name, "zero_stage": self.cfg.parallel.zero_stage})

    def load_checkpoint(self, path: Path) -> None:
        meta = read_meta(path)
        if meta["world_size"] != self.dist.world_size:
            raise ConfigError(
                f"run.resume: {path} was written by {meta['world_size']} ranks; this run has {self.dist.world_size} "
                "(resume with the same number of ranks)"
            )
        self.engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True, load_lr_scheduler_states=True)
        self.load_rank_state(torch.load(path / f"rank{self.dist.rank:05d}.pt", weights_only=False))
        if self.dist.is_main:
            print(f"kiln: resumed from {path} at step {self.step}", flush=True)

    # ---- samples, evaluation, export --------------------------------------------------------
    def generate(self, labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """EMA-weight samples; every rank runs it (ZeRO-3 gathers weights collectively)."""
        d = self.cfg.diffusion
        was_training = self.model.training
        self.model.eval()
        with self.ema.swapped():
            images = sample_images(
                self.model, dict(self.scheduler.config), labels,
                null_class=self.null_class, image_size=self.cfg.data.image_size,
                in_channels=self.cfg.model.in_channels, steps=d.sample_steps,
                guidance_scale=d.guidance_scale, generator=generator, device=self.device, dtype=self.dtype,
            )
        self.model.train(was_training)
        return images

    def save_samples(self, name: str) -> None:
        per_class = self.cfg.diffusion.samples_per_class
        labels = class_labels(self.cfg.model.num_classes, per_class)
        images = self.generate(labels, self.sample_gen)
        if self.dist.is_main:
            save_grid(images, rows=self.cfg.model.num_classes, path=self.run_dir / "samples" / name)

    def evaluate(self) -> dict | None:
        d = self.cfg.diffusion
        labels = class_labels(self.cfg.model.num_classes, d.eval_samples_per_class)
        images = self.generate(labels, torch.Generator().manual_seed(self.cfg.trainer.seed + 999))
        if not self.dist.is_main:
            return None
        clf, real_acc = fit_digit_classifier(self.cfg.data.root, self.cfg.data.image_size, self.cfg.trainer.seed)
        result = score_samples(clf, images, labels, self.cfg.model.num_classes)
        result.update(classifier_accuracy_on_real_val=real_acc, chance=1.0 / self.cfg.model.num_classes, step=self.step)
        (self.run_dir / "eval.json").write_text(json.dumps(result, indent=2))
        save_grid(images[:: max(1, d.eval_samples_per_class // 8)], rows=self.cfg.model.num_classes, path=self.run_dir / "samples" / "eval.png")
        return result

    def export(self) -> Path:
        """EMA weights in diffusers format (+ the noise scheduler) under run.dir/export/."""
        out = self.run_dir / "export"
        tmp = self.run_dir / ".export.tmp"
        with self.ema.swapped(), gathered(self.model, self.cfg.parallel.zero_stage):
            if self.dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                self.model.save_pretrained(tmp / "transformer", safe_serialization=True)
                self.scheduler.save_pretrained(tmp / "scheduler")
                info = {
                    "recipe": self.cfg.recipe.name, "step": self.step, "image_size": self.cfg.data.image_size,
                    "num_classes": self.cfg.model.num_classes, "null_class": self.null_class,
                    "sample_steps": self.cfg.diffusion.sample_steps, "guidance_scale": self.cfg.diffusion.guidance_scale,
                }
                (tmp / "kiln.json").write_text(json.dumps(info, indent=2))
                shutil.rmtree(out, ignore_errors=True)
                tmp.rename(out)
        barrier()
        return out


def gathered(model: torch.nn.Module, zero_stage: int):
    """Full weights on every rank for the duration (ZeRO-3 partitions them)."""
    import contextlib

    if zero_stage < 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)


def dry_run(cfg: TrainConfig, dist: DistInfo) -> None:
    """Size the model on the meta device and estimate per-device memory; allocates nothing."""
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.data.image_size)
    n = sum(p.numel() for p in model.parameters())
    dp = cfg.parallel.dp if cfg.parallel.dp > 0 else dist.world_size
    states = zero_state_bytes(n, cfg.parallel.zero_stage, dp, cfg.toggles.precision)
    act = activation_bytes(cfg, model)
    gib = 2**30
    print(f"recipe {cfg.recipe.name}: DiTTransformer2DModel with {n:,} parameters ({n / 1e9:.2f}B)")
    print(f"per-device memory estimate, ZeRO stage {cfg.parallel.zero_stage} over dp={dp}, precision {cfg.toggles.precision}:")
    for key in ("weights", "grads", "optimizer"):
        print(f"  {key:<22}{states[key] / gib:10.2f} GiB")
    print(f"  {'activations':<22}{act / gib:10.2f} GiB  (micro batch {cfg.trainer.micro_batch_size}, AC {cfg.toggles.activation_checkpointing})")
    print(f"  {'total':<22}{(states['total'] + act) / gib:10.2f} GiB")
    if cfg.parallel.dp <= 0:
        print("(sized for this launch's world size; set parallel.dp=N to size for N GPUs)")


def activation_bytes(cfg: TrainConfig, model: DiTTransformer2DModel) -> float:
    """Korthikanti et al. (2022): s·b·h·(34 + 5·a·s/h) bytes per layer in 16-bit, SDPA not
    materializing scores (drop the 5·a·s/h term); full recomputation keeps 2·s·b·h per layer."""
    m = cfg.model
    s = (cfg.data.image_size // m.patch_size) ** 2
    b = cfg.trainer.micro_batch_size
    h = m.num_attention_heads * m.attention_head_dim
    scale = 2.0 if cfg.toggles.precision == "fp32" else 1.0
    per_layer = 2 * s * b * h if cfg.toggles.activation_checkpointing == "full" else 34 * s * b * h
    return per_layer * m.num_layers * scale


def main(cfg: TrainConfig, dist: DistInfo, run_dir: Path | None) -> None:
    if cfg.run.dry_run:
        if dist.is_main:
            dry_run(cfg, dist)
        return
    trainer = DiTTrainer(cfg, dist, run_dir)
    trainer.train()
    trainer.save_samples("final.png")
    if cfg.trainer.eval:
        result = trainer.evaluate()
        if result is not None:
            print(f"kiln: eval mean accuracy {result['mean_accuracy']:.3f} (chance {result['chance']:.2f}, "
                  f"classifier on real digits {result['classifier_accuracy_on_real_val']:.3f})", flush=True)
    out = trainer.export()
    if dist.is_main:
        print(f"kiln: exported to {out}", flush=True)
