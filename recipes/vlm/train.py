"""VLM recipe: a LLaVA trained on image–conversation shards with DeepSpeed ZeRO, exact packing,
two stages (align → finetune), held-out eval, and a Hugging Face export that vLLM serves.

Read top to bottom: setup (data, processor, model, engine, resume) → train_step → train →
evaluate → export.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from common import deepspeed as ds, faults
from common.checkpoint import CheckpointManager
from common.config import TrainConfig
from common.distributed import DistInfo, all_reduce_mean, barrier
from common.errors import ConfigError
from common.loop import run_training_loop
from common.memory import activation_bytes, print_estimate, zero_state_bytes
from common.profiling import StepTimer
from common.seed import rng_state, seed_everything, set_rng_state
from recipes.vlm.data import build_train_loader, load_processor, prepare_data
from recipes.vlm.evaluate import generate_answers, load_eval_samples, save_answer_grid, score
from recipes.vlm.model import build_model, llava_config
from recipes.vlm.parallelize import parallelize


def model_config(cfg: TrainConfig, tokenizer):
    return llava_config(
        cfg.model,
        vocab_size=cfg.model.vocab_size or len(tokenizer),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def resolve_init(init_from: str) -> Path:
    """An align run's export (run dir or export dir) to start finetuning from."""
    path = Path(init_from)
    for candidate in (path / "export", path):
        if (candidate / "config.json").exists() and (candidate / "model.safetensors").exists():
            return candidate
    raise ConfigError(f"vlm.init_from={init_from}: no exported model there (expected an align run dir with export/)")


class VLMTrainer:
    def __init__(self, cfg: TrainConfig, dist: DistInfo, run_dir: Path):
        self.cfg, self.dist, self.run_dir = cfg, dist, run_dir
        self.device = dist.device
        self.meta = prepare_data(cfg, dist)
        self.processor = load_processor(cfg.data.root)
        self.loader = build_train_loader(cfg, dist, self.meta["train_urls"], self.processor)

        seed_everything(cfg.trainer.seed)  # identical initial weights on every rank
        model = build_model(model_config(cfg, self.processor.tokenizer), cfg.toggles.attention)
        if cfg.vlm.init_from:
            self.init_from = resolve_init(cfg.vlm.init_from)
            model.load_state_dict(type(model).from_pretrained(self.init_from).state_dict())
        self.engine = parallelize(model, cfg, dist.world_size)
        self.model = self.engine.module
        self.dtype = next(self.model.parameters()).dtype
        seed_everything(cfg.trainer.seed + 1 + dist.rank)

        self.step = 0
        self.ckpt = CheckpointManager(run_dir, cfg.checkpoint.keep, dist)
        resume_from = self.ckpt.resolve_resume(cfg.run.resume)
        if resume_from is not None:
            self.load_rank_state(ds.load_checkpoint(self.engine, resume_from, dist))
            if dist.is_main:
                print(f"kiln: resumed from {resume_from} at step {self.step}", flush=True)

    # ---- one optimizer step -------------------------------------------------------------
    def train_step(self, timer: StepTimer) -> dict:
        losses, real, slots, samples = [], 0, 0, 0
        for _ in range(self.cfg.trainer.grad_accum):
            with timer.phase("data_wait"):
                batch = next(self.batches)
            with timer.phase("forward"):
                inputs = batch["packed"].model_inputs(self.cfg.toggles.attention, device=self.device)
                inputs["pixel_values"] = batch["pixel_values"].to(self.device, self.dtype)
                if "attention_mask" in inputs and inputs["attention_mask"].dtype != torch.bool:
                    inputs["attention_mask"] = inputs["attention_mask"].to(self.dtype)
                loss = faults.poison_loss(self.engine(**inputs).loss, self.step + 1)
            with timer.phase("backward"):
                self.engine.backward(loss)
                pre_step_norm = ds.full_grad_norm(self.engine)
            with timer.phase("optimizer"):
                self.engine.step()
            losses.append(loss.item())
            real, slots, samples = real + batch["real_tokens"], slots + batch["slots"], samples + batch["samples"]
        world = self.dist.world_size
        return {
            "loss": all_reduce_mean(sum(losses) / len(losses), self.device),
            "lr": self.engine.get_lr()[0],
            "grad_norm": ds.grad_norm(self.engine, pre_step_norm),
            "token_utilization": all_reduce_mean(real / slots, self.device),
            "tokens": all_reduce_mean(real, self.device) * world,
            "samples": samples * world,
            "corrupt_shards": self.loader.corrupt_shards,
        }

    # ---- the loop (common/loop.py) and its hooks -------------------------------------------
    def train(self) -> None:
        self.engine.train()
        run_training_loop(self)

    def after_first_step(self) -> None:
        ds.record_state_bytes(self.engine, self.cfg, self.dist, self.run_dir / "memory.json")

    # ---- checkpoints ----------------------------------------------------------------------
    def rank_state(self) -> dict:
        return {"step": self.step, "rng": rng_state(), "data": self.loader.state_dict()}

    def load_rank_state(self, state: dict) -> None:
        self.step = state["step"]
        set_rng_state(state["rng"])
        self.loader.load_state_dict(state["data"])

    def save_checkpoint(self) -> None:
        meta = {"recipe": self.cfg.recipe.name, "zero_stage": self.cfg.parallel.zero_stage, "stage": self.cfg.vlm.stage}
        ds.save_checkpoint(self.ckpt, self.engine, self.step, self.rank_state(), meta)

    # ---- evaluation and export ------------------------------------------------------------
    def evaluate(self) -> dict | None:
        """Every rank generates (ZeRO-3 gathers weights collectively); rank 0 scores and writes."""
        samples = load_eval_samples(self.meta["val_urls"], self.cfg.vlm.eval_samples)
        self.model.eval()
        answers = generate_answers(self.model, self.processor, samples, max_new_tokens=self.cfg.vlm.max_new_tokens, device=self.device)
        self.model.train()
        if not self.dist.is_main:
            return None
        result = {**score(samples, answers), "step": self.step, "stage": self.cfg.vlm.stage}
        (self.run_dir / "eval.json").write_text(json.dumps(result, indent=2))
        save_answer_grid(samples, answers, self.run_dir / "samples" / "eval.png")
        return result

    def export(self) -> Path:
        """Hugging Face folder: config, safetensors, tokenizer, processor + chat template."""
        out, tmp = self.run_dir / "export", self.run_dir / ".export.tmp"
        with ds.gathered(self.model, self.cfg.parallel.zero_stage):
            if self.dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                self.model.save_pretrained(tmp, safe_serialization=True)
                self.processor.save_pretrained(tmp)
                shutil.rmtree(out, ignore_errors=True)
                tmp.rename(out)
        barrier()
        return out


def dry_run(cfg: TrainConfig, dist: DistInfo) -> None:
    """Size the LLaVA on the meta device; allocates nothing and reads no data."""
    from recipes.vlm.parallelize import freeze_for_stage

    m = cfg.model
    vocab = m.vocab_size or 1024
    config = llava_config(m, vocab_size=vocab, image_token_id=vocab - 1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        model = build_model(config, "sdpa")
    freeze_for_stage(model, cfg.vlm.stage)
    n = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dp = cfg.parallel.dp if cfg.parallel.dp > 0 else dist.world_size
    states = zero_state_bytes(trainable, cfg.parallel.zero_stage, dp, cfg.toggles.precision)
    frozen = (n - trainable) * (4 if cfg.toggles.precision == "fp32" else 2) / (dp if cfg.parallel.zero_stage == 3 else 1)
    activations = activation_bytes(
        seq=cfg.data.max_seq_len, batch=cfg.trainer.micro_batch_size, hidden=m.text_hidden_size,
        layers=m.text_layers, recompute=cfg.toggles.activation_checkpointing, precision=cfg.toggles.precision,
    )
    print_estimate(
        f"recipe {cfg.recipe.name}: LlavaForConditionalGeneration ({trainable:,} trainable in stage {cfg.vlm.stage})",
        n, states, activations,
        f"per device: ZeRO stage {cfg.parallel.zero_stage} over dp={dp}, {cfg.toggles.precision}, "
        f"micro batch {cfg.trainer.micro_batch_size} x {cfg.data.max_seq_len} tokens, AC {cfg.toggles.activation_checkpointing}",
        frozen_bytes=frozen,
    )
    if not m.vocab_size:
        print(f"(vocab size assumed {vocab}; set model.vocab_size to size it exactly)")


def main(cfg: TrainConfig, dist: DistInfo, run_dir: Path | None) -> None:
    if cfg.run.dry_run:
        if dist.is_main:
            dry_run(cfg, dist)
        return
    trainer = VLMTrainer(cfg, dist, run_dir)
    trainer.train()
    if cfg.trainer.eval:
        result = trainer.evaluate()
        if result is not None:
            print(f"kiln: eval accuracy {result['accuracy']:.3f} on {result['num_samples']} held-out digits "
                  f"(chance {result['chance']:.2f})", flush=True)
    out = trainer.export()
    if dist.is_main:
        print(f"kiln: exported to {out}", flush=True)
