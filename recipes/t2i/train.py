"""Text-to-image recipe: fine-tune a released pipeline's transformer (`model.init_from`: a StableDiffusion3Pipeline
or FluxPipeline folder; what differs between them is recipes/t2i/weights.py's adapter) on captioned images with
rectified flow, under DeepSpeed ZeRO + activation checkpointing, EMA, sample grids and an export that the diffusers
pipeline of the base's class loads.

The diffusion core is the one the class-conditional DiT uses (common/diffusion: the flow objective, the VAE's
latent path and the sampler) and common/'s (the EMA, the engine, the step): this family adds only what text
conditioning changes -- the frozen text encoders run on the fly in the compute dtype (or their outputs are read from
a cache, data.latents), caption dropout to the empty prompt's embedding, the pipeline folder in and out. Read top
to bottom: setup → the loss → hooks → samples → export.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common import lora
from common.checkpoint import read_meta
from common.config import TrainConfig
from common.diffusion import release
from common.diffusion import vae as vae_lib
from common.diffusion.hooks import EMASamples, ema_eval
from common.diffusion.objective import Objective
from common.diffusion.prompts import CachedPrompts, sample_prompts
from common.diffusion.sampling import save_grid
from common.distributed import DistInfo, barrier
from common.ema import EMA
from common.engine import DeepSpeedEngine
from common.errors import ConfigError
from common.parallel_dims import ParallelDims
from common.seed import per_sample, sample_rngs, seed_everything
from common.trainer import Trainer
from recipes.t2i import weights as t2i_weights
from recipes.t2i.data import TEXT_FIELDS, build_train_loader, load_cache_meta, prepare_data
from recipes.t2i.evaluate import (
    NUM_DIGITS,
    eval_prompts,
    read_captioned_digits,
    score_prompt_adherence,
    through_vae,
)
from recipes.t2i.parallelize import parallelize
from recipes.t2i.sampling import PromptSampler
from recipes.t2i.weights import (
    COMPUTE_DTYPES,
    adapter,
    encoders_identity,
    load_transformer,
    pipeline_folder,
    scheduler_config,
    write_pipeline,
)

SAMPLE_PROMPTS = 8  # a sample grid: this many held-out captions (training ones without a val split), one row each
EVAL_GRID_COLUMNS = 8  # samples/eval.png: at most this many of each digit's eval samples


class T2ITrainer(EMASamples, Trainer):
    def __init__(self, cfg: TrainConfig, dist: DistInfo, run_dir: Path, dims: ParallelDims | None = None):
        super().__init__(cfg, dist, run_dir, dims)
        if not cfg.model.init_from:
            raise ConfigError(
                "the text-to-image recipe fine-tunes a released pipeline: set model.init_from=<a "
                "StableDiffusion3Pipeline or FluxPipeline folder>"
            )
        self.base = pipeline_folder(cfg.model.init_from)
        self.adapter = adapter(self.base)  # what this pipeline class does its own way (recipes/t2i/weights.py)
        # finetune=lora: adapters on the base pipeline's transformer, the base of every start (common/lora.py).
        self.lora_base = str(self.base) if cfg.finetune == "lora" else ""
        if self.resume_from is not None:  # one line for a checkpoint of another method, adapter or base
            lora.check_resume(read_meta(self.resume_from), cfg, self.lora_base, self.resume_from)
        self.meta = meta = prepare_data(cfg, dist)
        # data.latents: the frozen encoders' outputs read from their cache (data/cache_latents.py), checked first.
        cache = load_cache_meta(cfg, encoders_identity(self.base)) if cfg.data.latents else None
        # parallel.cp > 1: the cp ranks of each data-parallel group (dp = world / cp) read the same samples (so draw the
        # same noise and timesteps: common/seed.py keys them by sample) and split their tokens.
        self.cp = self.dims.context_groups(self.device.type)
        dp_rank = dist.rank if self.cp is None else self.cp.dp_rank
        loader = build_train_loader(cfg, cache or meta, rank=dp_rank, dp=self.dims.dp)
        self.prompts, split = sample_prompts(meta, SAMPLE_PROMPTS)
        if split != "val" and dist.is_main:  # a small folder whose held-out images did not decode: still sample
            print(
                f"kiln: data.root={cfg.data.root} holds no held-out captions (its val split is empty): the sample "
                f"grids draw its first {len(self.prompts)} training captions instead",
                flush=True,
            )
        # Frozen, eval, fp32 and outside the module DeepSpeed wraps: never trained, never partitioned.
        self.geometry = vae_lib.vae_geometry(self.base / "vae", cfg.data.image_size)
        self.vae = vae_lib.load_vae(self.geometry, self.device)
        if cache and not cfg.trainer.eval:  # the eval renders real images through the VAE: it keeps the encoder
            self.vae.encoder = self.vae.quant_conv = None  # only sample grids decode; the cache holds the moments

        self.objective = Objective(cfg.diffusion)  # flow; its schedule's keys came from the base's scheduler
        seed_everything(cfg.trainer.seed)
        model = load_transformer(self.base)
        self.engine = DeepSpeedEngine(parallelize(model, cfg, self.cp), cfg, self.dims.dp, cp=self.cp)
        self.model = self.engine.module
        self.dtype = next(self.model.parameters()).dtype
        # The text encoders: frozen, in the compute dtype, beside the engine like the VAE; or their cached outputs.
        load_encoders = functools.partial(
            self.adapter.prompt_encoder,
            device=self.device,
            dtype=self.dtype,
            max_sequence_length=cfg.model.max_sequence_length,
        )
        if cache:
            if COMPUTE_DTYPES.get(cfg.toggles.precision) != self.dtype:
                raise ConfigError(
                    f"data.latents: toggles.precision={cfg.toggles.precision} computes in {self.dtype}; a cache holds "
                    "embeddings computed in fp32, bf16 or fp16: train without data.latents"
                )
            encode = CachedPrompts(
                cfg.data.latents,
                cache,
                SAMPLE_PROMPTS,
                TEXT_FIELDS,
                device=self.device,
                dtype=self.dtype,
                load=load_encoders,
            )
        else:
            encode = load_encoders()
        self.sampler = PromptSampler(
            self.model, encode, self.vae, self.geometry, scheduler_config(self.base), self.adapter
        )
        self.encode, self.empty = encode, self.sampler.empty  # caption dropout trains on the empty prompt
        self.ema = EMA(self.model, cfg.diffusion.ema_decay)
        # Every random draw comes from each sample's generator (`loss`): only LoRA's dropout draws per rank.
        dropout = bool(self.lora_base) and cfg.lora.dropout > 0
        self.start(loader, per_rank_rng=dropout, extras={"ema": self.ema})
        self.model.train()

    # ---- the loss (common/trainer.py runs the step) ------------------------------------------
    def normal(self, rngs: list, shape) -> torch.Tensor:
        """N(0, 1) of `shape` per sample, from each sample's generator, on the device."""
        return per_sample(rngs, lambda r: r.standard_normal(tuple(shape), dtype=np.float32)).to(self.device)

    def loss(self, batch: dict) -> torch.Tensor:
        """The flow loss summed over the batch's samples. Every random draw comes from the sample's own generator in
        a fixed order (posterior noise, flow noise, timestep, caption drop): the same numbers whatever rank,
        micro-batch or layout takes the sample."""
        rngs = sample_rngs(self.cfg.trainer.seed, batch["sample_ids"])
        if "mean" in batch:  # a cache (data.latents): the posterior's moments and the prompt embeddings, read
            mean, std = batch["mean"].to(self.device), batch["std"].to(self.device)
            text = {key: batch[key].to(self.device, self.dtype) for key in self.empty}
        else:
            mean, std = vae_lib.posterior(self.vae, batch["image"].to(self.device))
            text = self.encode(batch["caption"])
        x0 = vae_lib.to_latents(mean, std, self.normal(rngs, mean.shape[1:]), self.geometry)
        noise = self.normal(rngs, x0.shape[1:])
        x_t, t, target = self.objective.noisy(x0, noise, self.objective.timesteps(rngs))
        drop = per_sample(rngs, lambda r: r.random()).to(self.device) < self.cfg.data.caption_dropout
        for key, value in text.items():  # a dropped caption is the empty prompt's embedding
            text[key] = torch.where(drop.view(-1, *[1] * (value.dim() - 1)), self.empty[key], value)
        # A guidance-distilled transformer (FLUX.1-dev) trains at the guidance scale it samples with, as diffusers'
        # train_dreambooth_flux.py does (one --guidance_scale for both); the others ignore it.
        guidance = torch.full((x0.shape[0],), self.cfg.diffusion.guidance_scale)
        pred = self.adapter.forward(self.engine.model, x_t.to(self.dtype), t, text, guidance)
        return F.mse_loss(pred.float(), target) * x0.shape[0]

    def count(self, batch: dict) -> int:
        return len(batch["caption"])

    def tally(self, batch: dict) -> dict[str, int]:
        return {"samples": len(batch["caption"])}

    def checkpoint_meta(self) -> dict:
        return lora.checkpoint_meta(self.cfg, self.lora_base)

    # ---- hooks of the loop (common/trainer.py): after_step is EMASamples' (common/diffusion/hooks.py) ---------
    # ---- samples and export -----------------------------------------------------------------
    def generate(self, prompts: list[str], generator: torch.Generator, guidance_scale: float | None = None):
        """EMA-weight images in [-1, 1] for `prompts`, with guidance against the empty prompt; every rank runs it
        (ZeRO-3 gathers weights collectively)."""
        d = self.cfg.diffusion
        with ema_eval(self.model, self.ema):
            images = self.sampler(
                prompts,
                generator,
                steps=d.sample_steps,
                guidance_scale=d.guidance_scale if guidance_scale is None else guidance_scale,
                dtype=self.dtype,
            )
        return images

    def save_samples(self, name: str) -> None:
        """A grid of the sample prompts' images (held-out captions), seeded by the step: the same grid for the same
        weights."""
        generator = torch.Generator().manual_seed(self.cfg.trainer.seed + 12345 + self.state.step)
        images = self.generate(self.prompts, generator)
        if self.dist.is_main:
            save_grid(images, rows=len(self.prompts), path=self.run_dir / "samples" / name)
            (self.run_dir / "samples" / "prompts.json").write_text(json.dumps(self.prompts, indent=2))

    def after_fit(self) -> None:
        self.save_samples("final.png")

    def evaluate(self) -> dict | None:
        """Prompt adherence on held-out phrasings (recipes/t2i/evaluate.py), for the captioned digits only: every
        rank samples (in micro-batch-sized chunks), rank 0 scores and writes eval.json and samples/eval.png."""
        d, size, main = self.cfg.diffusion, self.cfg.data.image_size, self.dist.is_main
        # data.buckets: the classifier's real images are square data.image_size digits, which bucketed shards are not
        train = None if self.cfg.data.buckets else read_captioned_digits(self.meta["train_urls"], size, images=main)
        val = None if self.cfg.data.buckets else read_captioned_digits(self.meta["val_urls"], size, images=main)
        if train is None or val is None:  # the same on every rank: the captions are read whole
            if main:
                print(
                    f"kiln: eval: skipped: the captions in data.root={self.cfg.data.root} are not the captioned "
                    "digits', the only ones the prompt-adherence eval has a classifier for",
                    flush=True,
                )
            return None
        if not val.captions:  # the classifier is checked on the held-out images
            if main:
                print(
                    f"kiln: eval: skipped: data.root={self.cfg.data.root} holds no held-out images (its val split is "
                    "empty) to check the prompt-adherence classifier on",
                    flush=True,
                )
            return None
        prompts, digits = eval_prompts(d.eval_samples_per_class)
        generator = torch.Generator().manual_seed(self.cfg.trainer.seed + 999)
        chunk = self.cfg.trainer.micro_batch_size
        images = torch.cat([self.generate(prompts[i : i + chunk], generator) for i in range(0, len(prompts), chunk)])
        if not main:
            return None
        print(
            "kiln: eval: fitting a classifier on the real images (through the VAE) and scoring the samples", flush=True
        )
        render = functools.partial(through_vae, self.vae, self.geometry)
        result = score_prompt_adherence(images, digits, prompts, train, val, self.cfg.trainer.seed, render=render)
        result.update(step=self.state.step, sample_steps=d.sample_steps, guidance_scale=d.guidance_scale)
        (self.run_dir / "eval.json").write_text(json.dumps(result, indent=2))
        per, cols = d.eval_samples_per_class, min(d.eval_samples_per_class, EVAL_GRID_COLUMNS)
        pick = [digit * per + j for digit in range(NUM_DIGITS) for j in range(cols)]
        save_grid(images[pick], rows=NUM_DIGITS, path=self.run_dir / "samples" / "eval.png")
        return result

    def eval_summary(self, result: dict) -> str:
        return (
            f"kiln: eval prompt adherence {result['mean_accuracy']:.3f} on held-out phrasings (chance "
            f"{result['chance']:.2f}, classifier on real images {result['classifier_accuracy_on_real_val']:.3f})"
        )

    def export(self) -> Path:
        """The base's pipeline folder under run.dir/export/: the EMA transformer, the base's other parts. Under
        finetune=lora: the EMA adapter as diffusers' LoRA file on the base, and with export.merge_lora the merged
        pipeline in export/merged (common/diffusion/release.py)."""
        out, tmp = self.run_dir / "export", self.run_dir / ".export.tmp"
        with self.ema.swapped(), self.engine.gathered():
            if self.dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                if self.lora_base:
                    release.write_lora_export(
                        t2i_weights, self.model, self.cfg, tmp, base=self.base, step=self.state.step
                    )
                else:
                    write_pipeline(tmp, self.base, self.cfg, step=self.state.step, transformer=self.model)
                shutil.rmtree(out, ignore_errors=True)
                tmp.rename(out)
        barrier()
        return out


TRAINER = T2ITrainer  # recipes/registry.py
