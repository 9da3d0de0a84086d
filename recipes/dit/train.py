"""DiT recipe: class-conditional diffusion on digit shards with DeepSpeed ZeRO, EMA, samples, eval, export.

Read top to bottom: setup (data, model, engine, resume) → train_step → train → evaluate → export.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler

from common import deepspeed as ds
from common.checkpoint import CheckpointManager
from common.config import TrainConfig
from common.parallel_dims import ParallelDims
from common.memory import Block, ModelSpec, count_params, largest_module_params
from common.distributed import DistInfo, all_reduce_mean, barrier
from common.ema import EMA
from common.profiling import StepTimer
from common.seed import seed_everything
from common.trainer import StepStats, Trainer, TrainState
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


class DiTTrainer(Trainer):
    def __init__(self, cfg: TrainConfig, dist: DistInfo, run_dir: Path):
        super().__init__(cfg, dist, run_dir)
        meta = prepare_data(cfg, dist)
        loader = build_train_loader(cfg, dist, meta["train_urls"])

        self.scheduler = noise_scheduler(cfg)
        seed_everything(cfg.trainer.seed)  # identical initial weights on every rank
        model = build_model(cfg.model, cfg.data.image_size)
        self.null_class = null_class(model)
        self.dims = ParallelDims.from_config(cfg.parallel, dist.world_size)  # ZeRO data parallelism: dp = world
        self.engine = parallelize(model, cfg, self.dims.dp)
        self.model = self.engine.module
        self.dtype = next(self.model.parameters()).dtype
        self.ema = EMA(self.model, cfg.diffusion.ema_decay)
        seed_everything(cfg.trainer.seed + 1 + dist.rank)  # per-rank noise, timesteps, label drops
        # Per-rank RNG streams (noise, timesteps, label drops) and the EMA shard resume with the step.
        self.state = TrainState(loader, rng=True, extras={"ema": self.ema})

        self.ckpt = CheckpointManager(run_dir, cfg.checkpoint.keep, dist)
        resume_from = self.ckpt.resolve_resume(cfg.run.resume)
        if resume_from is not None:
            self.load_checkpoint(resume_from)
        self.engine.train()

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

    def train_step(self, batches, timer: StepTimer) -> StepStats:
        losses = []
        for _ in range(self.cfg.trainer.grad_accum):
            with timer.phase("data_wait"):
                batch = next(batches)
            with timer.phase("forward"):
                loss = self.diffusion_loss(batch)
            with timer.phase("backward"):
                self.engine.backward(loss)  # all-reduces gradients at the accumulation boundary
                pre_step_norm = ds.full_grad_norm(self.engine)
            with timer.phase("optimizer"):
                self.engine.step()  # optimizer and lr step at the accumulation boundary
            losses.append(loss.item())
        t = self.cfg.trainer
        stats = StepStats(
            loss=all_reduce_mean(sum(losses) / len(losses), self.device),
            grad_norm=ds.grad_norm(self.engine, pre_step_norm),
            lr=self.engine.get_lr()[0],
            samples=t.micro_batch_size * t.grad_accum * self.dist.world_size,
            corrupt_shards=self.state.loader.corrupt_shards,
        )
        if stats.finite:  # else DeepSpeed skipped the step
            self.ema.update(self.state.step)
        return stats

    # ---- hooks of the loop (common/trainer.py) ---------------------------------------------
    def after_first_step(self) -> None:
        # Adam state exists after the first step: measure what each rank holds.
        ds.record_state_bytes(self.engine, self.cfg, self.dist, self.dims.dp, self.run_dir / "memory.json")

    def after_step(self) -> None:
        every = self.cfg.trainer.sample_every
        if every and self.state.step % every == 0:
            self.save_samples(f"step_{self.state.step:07d}.png")

    # ---- checkpoints: DeepSpeed's engine state + this rank's TrainState ---------------------
    def save_checkpoint(self) -> None:
        meta = {"recipe": self.cfg.recipe.name, "zero_stage": self.cfg.parallel.zero_stage}
        ds.save_checkpoint(self.ckpt, self.engine, self.state.step, self.state.state_dict(), meta)

    def load_checkpoint(self, path: Path) -> None:
        self.state.load_state_dict(ds.load_checkpoint(self.engine, path, self.dist))
        if self.dist.is_main:
            print(f"kiln: resumed from {path} at step {self.state.step}", flush=True)

    # ---- samples, evaluation, export --------------------------------------------------------
    def generate(self, labels: torch.Tensor, generator: torch.Generator, progress: str | None = None) -> torch.Tensor:
        """EMA-weight samples; every rank runs it (ZeRO-3 gathers weights collectively). `progress`
        labels a progress bar on rank 0."""
        d = self.cfg.diffusion
        if progress and self.dist.is_main:
            print(f"kiln: {progress}: {len(labels)} images, {d.sample_steps} DDIM steps, guidance {d.guidance_scale}",
                  flush=True)
        show_bar = progress if self.dist.is_main and self.cfg.trainer.progress_bar else None
        was_training = self.model.training
        self.model.eval()
        with self.ema.swapped():
            images = sample_images(
                self.model, dict(self.scheduler.config), labels,
                null_class=self.null_class, image_size=self.cfg.data.image_size,
                in_channels=self.cfg.model.in_channels, steps=d.sample_steps,
                guidance_scale=d.guidance_scale, generator=generator, device=self.device, dtype=self.dtype,
                progress=show_bar,
            )
        self.model.train(was_training)
        return images

    def save_samples(self, name: str, progress: str | None = None) -> None:
        per_class = self.cfg.diffusion.samples_per_class
        labels = class_labels(self.cfg.model.num_classes, per_class)
        # Seeded by the step: the same grid for the same weights, with or without a resume in between.
        generator = torch.Generator().manual_seed(self.cfg.trainer.seed + 12345 + self.state.step)
        images = self.generate(labels, generator, progress)
        if self.dist.is_main:
            save_grid(images, rows=self.cfg.model.num_classes, path=self.run_dir / "samples" / name)

    def evaluate(self) -> dict | None:
        d = self.cfg.diffusion
        labels = class_labels(self.cfg.model.num_classes, d.eval_samples_per_class)
        images = self.generate(labels, torch.Generator().manual_seed(self.cfg.trainer.seed + 999),
                               progress="eval samples")
        if not self.dist.is_main:
            return None
        print("kiln: eval: fitting the digit classifier on real digits and scoring the samples", flush=True)
        clf, real_acc = fit_digit_classifier(self.cfg.data.root, self.cfg.data.image_size, self.cfg.trainer.seed)
        result = score_samples(clf, images, labels, self.cfg.model.num_classes)
        result.update(classifier_accuracy_on_real_val=real_acc, chance=1.0 / self.cfg.model.num_classes, step=self.state.step)
        (self.run_dir / "eval.json").write_text(json.dumps(result, indent=2))
        save_grid(images[:: max(1, d.eval_samples_per_class // 8)], rows=self.cfg.model.num_classes, path=self.run_dir / "samples" / "eval.png")
        return result

    def export(self) -> Path:
        """EMA weights in diffusers format (+ the noise scheduler) under run.dir/export/."""
        out = self.run_dir / "export"
        tmp = self.run_dir / ".export.tmp"
        with self.ema.swapped(), ds.gathered(self.model, self.cfg.parallel.zero_stage):
            if self.dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                self.model.save_pretrained(tmp / "transformer", safe_serialization=True)
                self.scheduler.save_pretrained(tmp / "scheduler")
                info = {
                    "recipe": self.cfg.recipe.name, "step": self.state.step, "image_size": self.cfg.data.image_size,
                    "num_classes": self.cfg.model.num_classes, "null_class": self.null_class,
                    "sample_steps": self.cfg.diffusion.sample_steps, "guidance_scale": self.cfg.diffusion.guidance_scale,
                }
                (tmp / "kiln.json").write_text(json.dumps(info, indent=2))
                shutil.rmtree(out, ignore_errors=True)
                tmp.rename(out)
        barrier()
        return out


def memory_spec(cfg: TrainConfig) -> ModelSpec:
    """The DiT for the memory model (common/memory.py): built on the meta device, counted."""
    m = cfg.model
    with torch.device("meta"):
        model = build_model(m, cfg.data.image_size)
    first_block = model.transformer_blocks[0]
    layer = count_params(first_block)
    block = Block(hidden=m.num_attention_heads * m.attention_head_dim, heads=m.num_attention_heads,
                  ffn=first_block.ff.net[-1].in_features, norm="adaln_zero", mlp="gelu", dropout=m.dropout > 0,
                  attention="eager" if cfg.toggles.attention == "eager" else "fused")
    return ModelSpec(cfg.recipe.name, block, layers=m.num_layers, seq=(cfg.data.image_size // m.patch_size) ** 2,
                     micro_batch=cfg.trainer.micro_batch_size, layer_params=layer,
                     first_params=count_params(model) - m.num_layers * layer,
                     gather_unit_params=largest_module_params(model), precision=cfg.toggles.precision)


def main(cfg: TrainConfig, dist: DistInfo, run_dir: Path) -> None:
    trainer = DiTTrainer(cfg, dist, run_dir)
    trainer.fit()
    trainer.save_samples("final.png", progress="final sample grid")
    if cfg.trainer.eval:
        result = trainer.evaluate()
        if result is not None:
            print(f"kiln: eval mean accuracy {result['mean_accuracy']:.3f} (chance {result['chance']:.2f}, "
                  f"classifier on real digits {result['classifier_accuracy_on_real_val']:.3f})", flush=True)
    out = trainer.export()
    if dist.is_main:
        print(f"kiln: exported to {out}", flush=True)
