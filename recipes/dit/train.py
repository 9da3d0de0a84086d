"""DiT recipe: class-conditional diffusion (DDPM or rectified flow) on image shards, in pixel space or on
the latents of a frozen VAE (encoded on the fly or read from a latent cache), with DeepSpeed ZeRO, EMA,
samples, eval and a diffusers export.

Read top to bottom: setup (data, VAE, model, engine, resume) → the loss → hooks → generate/evaluate →
export. The step, checkpoints and resume are common/trainer.py's.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as tdist
import torch.nn.functional as F

from common import deepspeed as ds
from common import lora
from common.checkpoint import read_meta
from common.config import TrainConfig
from common.diffusion import vae as vae_lib
from common.diffusion.evaluate import class_labels, score_samples
from common.diffusion.hooks import EMASamples, ema_eval
from common.diffusion.objective import Objective, sampling_scheduler, scheduler_config
from common.diffusion.sampling import GRID_MAX_CLASSES, sample_images, save_grid
from common.distributed import DistInfo, barrier
from common.ema import EMA
from common.engine import DeepSpeedEngine
from common.errors import ConfigError, DataError
from common.parallel_dims import ParallelDims
from common.seed import per_sample, sample_rngs, seed_everything
from common.trainer import Trainer
from recipes.dit import lora as dit_lora
from recipes.dit import weights
from recipes.dit.data import build_train_loader, channels_of, class_names, load_latent_meta, prepare_data
from recipes.dit.evaluate import fit_classifier
from recipes.dit.export import write_pipeline
from recipes.dit.model import build_model, null_class, untied
from recipes.dit.parallelize import parallelize
from recipes.dit.sizing import model_geometry


class DiTTrainer(EMASamples, Trainer):
    def __init__(self, cfg: TrainConfig, dist: DistInfo, run_dir: Path, dims: ParallelDims | None = None):
        super().__init__(cfg, dist, run_dir, dims)
        # finetune=lora: adapters on model.init_from's transformer, the base of every start (common/lora.py).
        self.lora_base = cfg.model.init_from if cfg.finetune == "lora" else ""
        if self.resume_from is not None:  # one line for a checkpoint of another method, adapter or base
            lora.check_resume(read_meta(self.resume_from), cfg, self.lora_base, self.resume_from)
        meta = prepare_data(cfg, dist)  # the images: what on-the-fly training and eval read
        self.classes = class_names(meta)
        if len(self.classes) > cfg.model.num_classes:
            raise ConfigError(
                f"data.root={cfg.data.root} has {len(self.classes)} classes but the model's label table "
                f"has model.num_classes={cfg.model.num_classes}; set model.num_classes={len(self.classes)}"
            )
        self.in_channels, self.sample_size, self.geometry = model_geometry(cfg)
        self.vae = None
        if self.geometry is not None:
            self.geometry = vae_lib.vae_geometry(cfg.diffusion.vae, cfg.data.image_size)  # the folder must be here now
            if self.geometry.image_channels != channels_of(meta):
                raise DataError(
                    f"data.root={cfg.data.root} holds {channels_of(meta)}-channel images; the VAE in "
                    f"diffusion.vae={cfg.diffusion.vae} encodes {self.geometry.image_channels}-channel ones"
                )
            # Frozen, eval, fp32 and outside the module DeepSpeed wraps: never trained, never partitioned.
            self.vae = vae_lib.load_vae(self.geometry, self.device)
        elif channels_of(meta) != cfg.model.in_channels:
            raise ConfigError(
                f"data.root={cfg.data.root} holds {channels_of(meta)}-channel images; set "
                f"model.in_channels={channels_of(meta)} (or train on latents with diffusion.vae)"
            )
        train = load_latent_meta(cfg, vae_lib.vae_identity(cfg.diffusion.vae), meta) if cfg.data.latents else meta
        # parallel.cp > 1: the cp ranks of each data-parallel group (dp = world / cp) read the same samples (so draw the
        # same noise and timesteps: common/seed.py keys them by sample) and split their tokens.
        self.cp = self.dims.context_groups(self.device.type)
        dp_rank = dist.rank if self.cp is None else self.cp.dp_rank
        loader = build_train_loader(cfg, train["train_urls"], train, rank=dp_rank, dp=self.dims.dp)

        self.objective = Objective(cfg.diffusion)
        self.sampler_config = scheduler_config(sampling_scheduler(cfg.diffusion))
        seed_everything(cfg.trainer.seed)  # identical initial weights on every rank
        model = build_model(cfg.model, self.sample_size, self.in_channels)
        if cfg.model.init_from:  # model.* came from its config.json (recipes/dit/config.py: complete)
            n = weights.load_weights(model, Path(cfg.model.init_from))
            if dist.is_main:
                print(f"kiln: model.init_from: loaded {n:,} weights from {cfg.model.init_from}", flush=True)
        self.null_class = null_class(model)
        self.engine = DeepSpeedEngine(parallelize(model, cfg, self.cp), cfg, self.dims.dp, cp=self.cp)
        self.model = self.engine.module
        self.dtype = next(self.model.parameters()).dtype
        self.ema = EMA(self.model, cfg.diffusion.ema_decay)
        # Noise, timesteps and label drops come from each sample's generator (`loss`): only dropout inside the
        # model (or its LoRA adapters) draws from a per-rank stream. The EMA resumes whatever layout saved it.
        dropout = cfg.model.dropout > 0 or (bool(self.lora_base) and cfg.lora.dropout > 0)
        self.start(loader, per_rank_rng=dropout, extras={"ema": self.ema})
        self.model.train()

    # ---- the loss (common/trainer.py runs the step) ------------------------------------------
    def clean_inputs(self, batch: dict, rngs: list) -> torch.Tensor:
        """x_0 in the DiT's space: the images, or a latent sampled from the VAE posterior. The
        posterior's moments come from the cache or from encoding the images now; the sample's noise
        is drawn here in both cases, so cached and on-the-fly training draw the same numbers."""
        if self.vae is None:
            return batch["image"].to(self.device)
        if "mean" in batch:
            mean, std = batch["mean"].to(self.device), batch["std"].to(self.device)
        else:
            mean, std = vae_lib.posterior(self.vae, batch["image"].to(self.device))
        return vae_lib.to_latents(mean, std, self.normal(rngs, mean.shape[1:]), self.geometry)

    def normal(self, rngs: list, shape) -> torch.Tensor:
        """N(0, 1) of `shape` per sample, from each sample's generator, on the device."""
        return per_sample(rngs, lambda r: r.standard_normal(tuple(shape), dtype=np.float32)).to(self.device)

    def loss(self, batch: dict) -> torch.Tensor:
        """The diffusion loss summed over the batch's samples (each sample's loss: the mean over its elements).
        Every random draw comes from the sample's own generator, keyed by its place in the global stream
        (common/seed.py), in a fixed order: the same numbers whatever rank, micro-batch or layout takes it."""
        rngs = sample_rngs(self.cfg.trainer.seed, batch["sample_ids"])
        x0 = self.clean_inputs(batch, rngs)
        labels = batch["label"].to(self.device)
        noise = self.normal(rngs, x0.shape[1:])
        x_t, t, target = self.objective.noisy(x0, noise, self.objective.timesteps(rngs))
        drop = per_sample(rngs, lambda r: r.random()).to(self.device) < self.cfg.diffusion.class_dropout
        labels = torch.where(drop, torch.full_like(labels, self.null_class), labels)
        pred = self.engine.model(x_t.to(self.dtype), timestep=t, class_labels=labels).sample
        return F.mse_loss(pred.float(), target) * x0.shape[0]

    def count(self, batch: dict) -> int:
        return len(batch["label"])

    def tally(self, batch: dict) -> dict[str, int]:
        return {"samples": len(batch["label"])}

    def checkpoint_meta(self) -> dict:
        return lora.checkpoint_meta(self.cfg, self.lora_base)

    # ---- hooks of the loop (common/trainer.py) ---------------------------------------------
    def after_first_step(self) -> None:
        # Adam state exists after the first step: measure what each rank holds.
        path = self.run_dir / "memory.json"
        # ZeRO partitions over every rank: dp x cp.
        ds.record_state_bytes(self.engine.ds, self.cfg, self.dist, self.dims.dp * self.dims.cp, path)
        if self.vae is not None:
            # The VAE beside the engine: whole on every rank (no ZeRO attributes), frozen, not in the optimizer.
            params = list(self.vae.parameters())
            flags = torch.tensor(
                [any(hasattr(p, "ds_id") for p in params), any(p.requires_grad for p in params)],
                dtype=torch.int64,
                device=self.device,
            )
            tdist.all_reduce(flags, op=tdist.ReduceOp.MAX)
            # DeepSpeed's optimizer and partitions are built from the engine's module's parameters.
            engine_params = {id(p) for p in self.model.parameters()}
            in_engine = any(id(p) in engine_params for p in params)
            if self.dist.is_main:
                info = json.loads(path.read_text())
                info["vae"] = {
                    "params": sum(p.numel() for p in params),
                    "zero_partitioned": bool(flags[0]),
                    "requires_grad": bool(flags[1]),
                    "in_engine_module": in_engine,
                }
                path.write_text(json.dumps(info, indent=2))

    # ---- samples, evaluation, export --------------------------------------------------------
    def generate(self, labels: torch.Tensor, generator: torch.Generator, progress: str | None = None) -> torch.Tensor:
        """EMA-weight samples; every rank runs it (ZeRO-3 gathers weights collectively). `progress`
        labels a progress bar on rank 0."""
        d = self.cfg.diffusion
        if progress and self.dist.is_main:
            sampler = "Euler (flow)" if d.objective == "flow" else "DDIM"
            print(
                f"kiln: {progress}: {len(labels)} images, {d.sample_steps} {sampler} steps, "
                f"guidance {d.guidance_scale}",
                flush=True,
            )
        show_bar = progress if self.dist.is_main and self.cfg.trainer.progress_bar else None
        decode = None if self.vae is None else functools.partial(vae_lib.decode, self.vae, geometry=self.geometry)
        with ema_eval(self.model, self.ema):
            images = sample_images(
                self.model,
                self.sampler_config,
                labels,
                null_class=self.null_class,
                image_size=self.sample_size,
                in_channels=self.in_channels,
                steps=d.sample_steps,
                guidance_scale=d.guidance_scale,
                generator=generator,
                device=self.device,
                dtype=self.dtype,
                progress=show_bar,
                decode=decode,
            )
        return images

    def save_samples(self, name: str, progress: str | None = None) -> None:
        rows = min(len(self.classes), GRID_MAX_CLASSES)
        labels = class_labels(rows, self.cfg.diffusion.samples_per_class)
        # Seeded by the step: the same grid for the same weights, with or without a resume in between.
        generator = torch.Generator().manual_seed(self.cfg.trainer.seed + 12345 + self.state.step)
        images = self.generate(labels, generator, progress)
        if self.dist.is_main:
            save_grid(images, rows=rows, path=self.run_dir / "samples" / name)

    def after_fit(self) -> None:
        self.save_samples("final.png", progress="final sample grid")

    def evaluate(self) -> dict | None:
        d, num_classes = self.cfg.diffusion, len(self.classes)
        labels = class_labels(num_classes, d.eval_samples_per_class)
        images = self.generate(
            labels, torch.Generator().manual_seed(self.cfg.trainer.seed + 999), progress="eval samples"
        )
        if not self.dist.is_main:
            return None
        print("kiln: eval: fitting a classifier on the real images and scoring the samples", flush=True)
        clf, real_acc = fit_classifier(self.cfg.data.root, self.cfg.data.image_size, self.cfg.trainer.seed)
        result = score_samples(clf, images, labels, num_classes)
        result.update(classifier_accuracy_on_real_val=real_acc, chance=1.0 / num_classes, step=self.state.step)
        (self.run_dir / "eval.json").write_text(json.dumps(result, indent=2))
        rows = min(num_classes, GRID_MAX_CLASSES)
        save_grid(
            images[: rows * d.eval_samples_per_class : max(1, d.eval_samples_per_class // 8)],
            rows=rows,
            path=self.run_dir / "samples" / "eval.png",
        )
        return result

    def eval_summary(self, result: dict) -> str:
        return (
            f"kiln: eval mean accuracy {result['mean_accuracy']:.3f} (chance {result['chance']:.2f}, "
            f"classifier on real images {result['classifier_accuracy_on_real_val']:.3f})"
        )

    def export(self) -> Path:
        """EMA weights in diffusers format under run.dir/export/ (`write_pipeline`). Under finetune=lora: the EMA
        adapter as a PEFT folder on model.init_from's transformer, and with export.merge_lora the merged model as a
        whole export in export/merged (recipes/dit/lora.py)."""
        out = self.run_dir / "export"
        tmp = self.run_dir / ".export.tmp"
        with self.ema.swapped(), self.engine.gathered():
            if self.dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                if self.lora_base:
                    dit_lora.write_export(
                        self.model, self.cfg, tmp, base=self.lora_base, write_pipeline=self.write_pipeline
                    )
                else:
                    self.write_pipeline(tmp, untied(self.model))
                shutil.rmtree(out, ignore_errors=True)
                tmp.rename(out)
        barrier()
        return out

    def write_pipeline(self, folder: Path, transformer) -> None:
        write_pipeline(
            folder,
            transformer,
            self.cfg,
            self.geometry,
            self.classes,
            vae=self.vae,
            step=self.state.step,
            null_class=self.null_class,
            sample_size=self.sample_size,
        )


TRAINER = DiTTrainer  # recipes/registry.py
