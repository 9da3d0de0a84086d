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
from common.data.moving_digits import DIRECTIONS, PAIRS
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
from recipes.video.evaluate import eval_prompts, read_moving_digits, score_prompt_adherence, through_vae
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
        if cache and not cfg.trainer.eval:  # the eval renders real clips through the VAE: it keeps the encoder
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
        """Prompt adherence on held-out phrasings (recipes/video/evaluate.py: the digit and the direction), for the
        moving digits only: every rank samples (in micro-batch-sized chunks), rank 0 scores and writes eval.json,
        samples/eval.png (a row per (digit, direction)) and a few of the clips as MP4s."""
        main = self.dist.is_main
        train = read_moving_digits(self.meta["train_urls"], videos=main)
        val = read_moving_digits(self.meta["val_urls"], videos=main)
        if train is None or val is None or not val.captions:  # the same on every rank: the captions are read whole
            if main:
                why = "are not the moving digits'" if val is None or train is None else "hold no held-out clips"
                print(
                    f"kiln: eval: skipped: the clips in data.root={self.cfg.data.root} {why} (the prompt-adherence "
                    "eval scores moving digits against held-out real clips)",
                    flush=True,
                )
            return None
        d = self.cfg.diffusion
        prompts, digits, directions = eval_prompts(d.eval_samples_per_class)
        generator = torch.Generator().manual_seed(self.cfg.trainer.seed + 999)
        chunk = self.cfg.trainer.micro_batch_size
        videos = torch.cat([self.generate(prompts[i : i + chunk], generator) for i in range(0, len(prompts), chunk)])
        if not main:
            return None
        print(
            "kiln: eval: fitting a digit classifier on real frames (through the VAE) and scoring the clips", flush=True
        )
        render = functools.partial(through_vae, self.vae, self.geometry)
        result = score_prompt_adherence(
            videos, digits, directions, prompts, train, val, self.cfg.trainer.seed, render=render
        )
        result.update(step=self.state.step, sample_steps=d.sample_steps, guidance_scale=d.guidance_scale)
        (self.run_dir / "eval.json").write_text(json.dumps(result, indent=2))
        per = len(prompts) // len(PAIRS)  # the first clip of each (digit, direction), digit-major
        folder = self.run_dir / "samples"
        save_contact_sheet(videos[::per], folder / "eval.png", scale=2)
        for i in range(len(DIRECTIONS)):  # a clip per direction (digits 0-3)
            write_mp4(videos[(i * len(DIRECTIONS) + i) * per], folder / f"eval_{i}.mp4")
        return result

    def eval_summary(self, result: dict) -> str:
        return (
            f"kiln: eval on held-out phrasings: digit {result['digit_accuracy']:.3f} (chance "
            f"{result['chance_digit']:.2f}), direction {result['direction_accuracy']:.3f} (chance "
            f"{result['chance_direction']:.2f}); real held-out clips: digit {result['real_val_digit_accuracy']:.3f} "
            f"({result['classifier_frame_accuracy_on_real_val']:.3f} per frame), direction "
            f"{result['real_val_direction_accuracy']:.3f}"
        )

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
