"""Video recipe: fine-tune a released WanPipeline's transformer (`model.init_from`, Wan 2.1 text-to-video) on captioned
clips with flow matching, under DeepSpeed ZeRO + activation checkpointing (+ Ulysses over the video tokens:
parallel.cp), EMA, sample clips and an export that WanPipeline loads.

The diffusion core is the other diffusion families' (common/diffusion: the flow objective, the sampler, the EMA hooks,
the pipeline folder in and out) and common/'s (the engine, the step); this family adds what video changes -- clips
[3, F, H, W] through the frozen AutoencoderKLWan (latents normalized per channel), the frozen UMT5 in the compute dtype
(or both read from a cache, data.latents), caption dropout to the empty prompt's embedding. Read top to bottom: setup
→ the loss → samples → export.
"""

from __future__ import annotations

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
from common.diffusion.hooks import EMASamples, ema_eval
from common.diffusion.objective import Objective
from common.diffusion.prompts import CachedPrompts, sample_prompts
from common.distributed import DistInfo, barrier
from common.ema import EMA
from common.engine import DeepSpeedEngine
from common.errors import ConfigError
from common.parallel_dims import ParallelDims
from common.seed import per_sample, sample_rngs, seed_everything
from common.trainer import Trainer
from recipes.video import weights
from recipes.video.data import TEXT_FIELDS, build_train_loader, load_cache_meta, prepare_data
from recipes.video.parallelize import parallelize
from recipes.video.sampling import VideoSampler, save_contact_sheet, write_mp4
from recipes.video.weights import COMPUTE_DTYPES, PromptEncoder, VideoVae, load_transformer, load_vae, posterior

SAMPLE_PROMPTS = 4  # sample clips: this many held-out captions (training ones without a val split)


class VideoTrainer(EMASamples, Trainer):
    def __init__(self, cfg: TrainConfig, dist: DistInfo, run_dir: Path, dims: ParallelDims | None = None):
        super().__init__(cfg, dist, run_dir, dims)
        if not cfg.model.init_from:
            raise ConfigError(
                "the video recipe fine-tunes a released pipeline: set model.init_from=<a WanPipeline folder>"
            )
        self.base = weights.pipeline_folder(cfg.model.init_from)
        self.lora_base = str(self.base) if cfg.finetune == "lora" else ""  # finetune=lora: adapters on its transformer
        if self.resume_from is not None:  # one line for a checkpoint of another method, adapter or base
            lora.check_resume(read_meta(self.resume_from), cfg, self.lora_base, self.resume_from)
        self.meta = meta = prepare_data(cfg, dist, self.dims.dp)
        # data.latents: the frozen encoders' outputs read from their cache (data/cache_latents.py), checked first.
        cache = load_cache_meta(cfg, weights.encoders_identity(self.base)) if cfg.data.latents else None
        # parallel.cp > 1: the cp ranks of a data-parallel group read the same clips (so draw the same noise and
        # timesteps: common/seed.py keys them by sample) and split their tokens.
        self.cp = self.dims.context_groups(self.device.type)
        dp_rank = dist.rank if self.cp is None else self.cp.dp_rank
        loader = build_train_loader(cfg, cache or meta, rank=dp_rank, dp=self.dims.dp)
        self.prompts, split = sample_prompts(meta, SAMPLE_PROMPTS)
        if split != "val" and dist.is_main:
            print(
                f"kiln: data.root={cfg.data.root} holds no held-out captions (its val split is empty): the sample "
                f"clips draw its first {len(self.prompts)} training captions instead",
                flush=True,
            )
        # Frozen, eval, fp32 and outside the module DeepSpeed wraps: never trained, never partitioned.
        self.geometry = VideoVae.of(self.base)
        self.vae = load_vae(self.base, self.device)
        if cache:
            self.vae.encoder = self.vae.quant_conv = None  # only sample clips decode; the cache holds the moments

        self.objective = Objective(cfg.diffusion)  # flow; its schedule's keys came from the base's scheduler
        seed_everything(cfg.trainer.seed)
        self.engine = DeepSpeedEngine(
            parallelize(load_transformer(self.base), cfg, self.cp), cfg, self.dims.dp, cp=self.cp
        )
        self.model = self.engine.module
        self.dtype = next(self.model.parameters()).dtype

        def load_encoder() -> PromptEncoder:
            return PromptEncoder(
                self.base, device=self.device, dtype=self.dtype, max_sequence_length=cfg.model.max_sequence_length
            )

        if cache:
            if COMPUTE_DTYPES.get(cfg.toggles.precision) != self.dtype:
                raise ConfigError(
                    f"data.latents: toggles.precision={cfg.toggles.precision} computes in {self.dtype}; a cache holds "
                    "embeddings computed in fp32, bf16 or fp16: train without data.latents"
                )
            kw = {"device": self.device, "dtype": self.dtype, "load": load_encoder}
            encode = CachedPrompts(cfg.data.latents, cache, SAMPLE_PROMPTS, TEXT_FIELDS, **kw)
        else:
            encode = load_encoder()
        d = cfg.data
        clip = (d.num_frames, d.height, d.width)
        self.sampler = VideoSampler(
            self.model, encode, self.vae, self.geometry, weights.scheduler_config(self.base), clip
        )
        self.encode, self.empty = encode, self.sampler.empty  # caption dropout trains on the empty prompt
        self.ema = EMA(self.model, cfg.diffusion.ema_decay)
        dropout = bool(self.lora_base) and cfg.lora.dropout > 0  # the only draw per rank rather than per sample
        self.start(loader, per_rank_rng=dropout, extras={"ema": self.ema})
        self.model.train()

    # ---- the loss (common/trainer.py runs the step) ------------------------------------------
    def normal(self, rngs: list, shape) -> torch.Tensor:
        """N(0, 1) of `shape` per sample, from each sample's generator, on the device."""
        return per_sample(rngs, lambda r: r.standard_normal(tuple(shape), dtype=np.float32)).to(self.device)

    def loss(self, batch: dict) -> torch.Tensor:
        """The flow loss summed over the batch's clips. Every random draw comes from the clip's own generator in a
        fixed order (posterior noise, flow noise, timestep, caption drop): the same numbers whatever rank, micro-batch
        or layout takes the clip."""
        rngs = sample_rngs(self.cfg.trainer.seed, batch["sample_ids"])
        if "mean" in batch:  # a cache (data.latents): the posterior's moments and the prompt embeddings, read
            mean, std = batch["mean"].to(self.device), batch["std"].to(self.device)
            text = {key: batch[key].to(self.device, self.dtype) for key in self.empty}
        else:
            mean, std = posterior(self.vae, batch["video"].to(self.device))
            text = self.encode(batch["caption"])
        x0 = self.geometry.to_latents(mean, std, self.normal(rngs, mean.shape[1:]))
        noise = self.normal(rngs, x0.shape[1:])
        x_t, t, target = self.objective.noisy(x0, noise, self.objective.timesteps(rngs))
        drop = per_sample(rngs, lambda r: r.random()).to(self.device) < self.cfg.data.caption_dropout
        for key, value in text.items():  # a dropped caption is the empty prompt's embedding
            text[key] = torch.where(drop.view(-1, *[1] * (value.dim() - 1)), self.empty[key], value)
        pred = self.engine.model(x_t.to(self.dtype), timestep=t, **text).sample
        return F.mse_loss(pred.float(), target) * x0.shape[0]

    def count(self, batch: dict) -> int:
        return len(batch["caption"])

    def tally(self, batch: dict) -> dict[str, int]:
        return {"samples": len(batch["caption"])}

    def checkpoint_meta(self) -> dict:
        return lora.checkpoint_meta(self.cfg, self.lora_base)

    # ---- samples and export -----------------------------------------------------------------
    def generate(self, prompts: list[str], generator: torch.Generator) -> torch.Tensor:
        """EMA-weight clips in [-1, 1] [N, 3, F, H, W] for `prompts`, with guidance against the empty prompt; every
        rank runs it (ZeRO-3 gathers weights collectively)."""
        d = self.cfg.diffusion
        with ema_eval(self.model, self.ema):
            return self.sampler(
                prompts, generator, steps=d.sample_steps, guidance_scale=d.guidance_scale, dtype=self.dtype
            )

    def save_samples(self, name: str) -> None:
        """The sample prompts' clips (held-out captions), seeded by the step: a contact sheet (`name`, a row per clip)
        and one MP4 per clip beside it."""
        generator = torch.Generator().manual_seed(self.cfg.trainer.seed + 12345 + self.state.step)
        videos = self.generate(self.prompts, generator)
        if self.dist.is_main:
            folder = self.run_dir / "samples"
            save_contact_sheet(videos, folder / name)
            for i, video in enumerate(videos):
                write_mp4(video, folder / f"{Path(name).stem}_{i}.mp4")
            (folder / "prompts.json").write_text(json.dumps(self.prompts, indent=2))

    def after_fit(self) -> None:
        self.save_samples("final.png")

    def evaluate(self) -> dict | None:
        return None

    def eval_summary(self, result: dict) -> str:
        return ""

    def export(self) -> Path:
        """The base's pipeline folder under run.dir/export/: the EMA transformer, the base's other parts. Under
        finetune=lora: the EMA adapter as diffusers' LoRA file on the base (and, with export.merge_lora, the merged
        pipeline in export/merged): common/diffusion/release.py."""
        out, tmp = self.run_dir / "export", self.run_dir / ".export.tmp"
        with self.ema.swapped(), self.engine.gathered():
            if self.dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                if self.lora_base:
                    release.write_lora_export(weights, self.model, self.cfg, tmp, base=self.base, step=self.state.step)
                else:
                    weights.write_pipeline(tmp, self.base, self.cfg, step=self.state.step, transformer=self.model)
                shutil.rmtree(out, ignore_errors=True)
                tmp.rename(out)
        barrier()
        return out


TRAINER = VideoTrainer  # recipes/registry.py
