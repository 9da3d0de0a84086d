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

from common import deepspeed as ds
from common.checkpoint import CheckpointManager
from common.config import TrainConfig
from common.distributed import DistInfo, all_reduce_mean, barrier
from common.errors import ConfigError
from common.parallel_dims import ParallelDims
from common.memory import Block, ModelSpec, count_params, largest_module_params
from common.profiling import StepTimer
from common.seed import seed_everything
from common.trainer import StepStats, Trainer, TrainState
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


class VLMTrainer(Trainer):
    def __init__(self, cfg: TrainConfig, dist: DistInfo, run_dir: Path):
        super().__init__(cfg, dist, run_dir)
        self.meta = prepare_data(cfg, dist)
        self.processor = load_processor(cfg.data.root)
        loader = build_train_loader(cfg, dist, self.meta["train_urls"], self.processor)

        seed_everything(cfg.trainer.seed)  # identical initial weights on every rank
        model = build_model(model_config(cfg, self.processor.tokenizer), cfg.toggles.attention)
        if cfg.vlm.init_from:
            self.init_from = resolve_init(cfg.vlm.init_from)
            model.load_state_dict(type(model).from_pretrained(self.init_from).state_dict())
            if dist.is_main:
                print(f"kiln: vlm.init_from: loaded all {sum(p.numel() for p in model.parameters()):,} weights "
                      f"(vision tower, projector, language model) from {self.init_from}", flush=True)
        self.dims = ParallelDims.from_config(cfg.parallel, dist.world_size)  # ZeRO data parallelism: dp = world
        self.engine = parallelize(model, cfg, self.dims.dp)
        self.model = self.engine.module
        self.dtype = next(self.model.parameters()).dtype
        seed_everything(cfg.trainer.seed + 1 + dist.rank)
        self.state = TrainState(loader, rng=True)

        self.ckpt = CheckpointManager(run_dir, cfg.checkpoint.keep, dist)
        resume_from = self.ckpt.resolve_resume(cfg.run.resume)
        if resume_from is not None:
            self.state.load_state_dict(ds.load_checkpoint(self.engine, resume_from, dist))
            if dist.is_main:
                print(f"kiln: resumed from {resume_from} at step {self.state.step}", flush=True)
        self.engine.train()

    # ---- one optimizer step -------------------------------------------------------------
    def train_step(self, batches, timer: StepTimer) -> StepStats:
        losses, real, slots, samples = [], 0, 0, 0
        for _ in range(self.cfg.trainer.grad_accum):
            with timer.phase("data_wait"):
                batch = next(batches)
            with timer.phase("forward"):
                inputs = batch["packed"].model_inputs(self.cfg.toggles.attention, device=self.device)
                inputs["pixel_values"] = batch["pixel_values"].to(self.device, self.dtype)
                if "attention_mask" in inputs and inputs["attention_mask"].dtype != torch.bool:
                    inputs["attention_mask"] = inputs["attention_mask"].to(self.dtype)
                loss = self.engine(**inputs, use_cache=False).loss  # no KV cache in training (and none recomputed)
            with timer.phase("backward"):
                self.engine.backward(loss)
                pre_step_norm = ds.full_grad_norm(self.engine)
            with timer.phase("optimizer"):
                self.engine.step()
            losses.append(loss.item())
            real, slots, samples = real + batch["real_tokens"], slots + batch["slots"], samples + batch["samples"]
        world = self.dist.world_size
        return StepStats(
            loss=all_reduce_mean(sum(losses) / len(losses), self.device),
            grad_norm=ds.grad_norm(self.engine, pre_step_norm),
            lr=self.engine.get_lr()[0],
            samples=samples * world,
            tokens=round(all_reduce_mean(real, self.device) * world),
            token_utilization=all_reduce_mean(real / slots, self.device),
            corrupt_shards=self.state.loader.corrupt_shards,
        )

    # ---- hooks of the loop (common/trainer.py) ---------------------------------------------
    def after_first_step(self) -> None:
        ds.record_state_bytes(self.engine, self.cfg, self.dist, self.dims.dp, self.run_dir / "memory.json")

    # ---- checkpoints: DeepSpeed's engine state + this rank's TrainState ---------------------
    def save_checkpoint(self) -> None:
        meta = {"recipe": self.cfg.recipe.name, "zero_stage": self.cfg.parallel.zero_stage, "stage": self.cfg.vlm.stage}
        ds.save_checkpoint(self.ckpt, self.engine, self.state.step, self.state.state_dict(), meta)

    # ---- evaluation and export ------------------------------------------------------------
    def evaluate(self) -> dict | None:
        """Every rank generates (ZeRO-3 gathers weights collectively); rank 0 scores and writes."""
        samples = load_eval_samples(self.meta["val_urls"], self.cfg.vlm.eval_samples)
        if self.dist.is_main:
            print(f"kiln: eval: answering {len(samples)} held-out images (greedy, up to {self.cfg.vlm.max_new_tokens} "
                  "new tokens)", flush=True)
        self.model.eval()
        answers = generate_answers(self.model, self.processor, samples, max_new_tokens=self.cfg.vlm.max_new_tokens, device=self.device)
        self.model.train()
        if not self.dist.is_main:
            return None
        result = {**score(samples, answers), "step": self.state.step, "stage": self.cfg.vlm.stage}
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


def memory_spec(cfg: TrainConfig) -> ModelSpec:
    """The LLaVA for the memory model (common/memory.py): built on the meta device, frozen per stage, counted.
    Without model.vocab_size the vocabulary is assumed (the tokenizer is not read)."""
    from recipes.vlm.parallelize import freeze_for_stage

    m = cfg.model
    vocab = m.vocab_size or 1024
    config = llava_config(m, vocab_size=vocab, image_token_id=vocab - 1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        model = build_model(config, "sdpa")
    freeze_for_stage(model, cfg.vlm.stage)
    layer = count_params(model.model.language_model.layers[0], trainable_only=True)
    trainable = count_params(model, trainable_only=True)
    # The frozen vision tower runs without autograd: it keeps nothing. The text rows are taken at
    # their longest, micro_batch x max_seq_len tokens (image tokens included).
    block = Block(hidden=m.text_hidden_size, heads=m.text_heads, ffn=m.text_intermediate_size, kv_heads=m.text_kv_heads,
                  norm="rmsnorm", mlp="swiglu", dropout=False,
                  attention="eager" if cfg.toggles.attention == "eager" else "fused",
                  dense_mask=cfg.toggles.attention == "sdpa")
    return ModelSpec(cfg.recipe.name, block, layers=m.text_layers, seq=cfg.data.max_seq_len,
                     micro_batch=cfg.trainer.micro_batch_size, layer_params=layer,
                     first_params=trainable - m.text_layers * layer, frozen_params=count_params(model) - trainable,
                     gather_unit_params=largest_module_params(model), vocab=vocab, precision=cfg.toggles.precision)


def main(cfg: TrainConfig, dist: DistInfo, run_dir: Path) -> None:
    trainer = VLMTrainer(cfg, dist, run_dir)
    trainer.fit()
    if cfg.trainer.eval:
        result = trainer.evaluate()
        if result is not None:
            print(f"kiln: eval accuracy {result['accuracy']:.3f} on {result['num_samples']} held-out digits "
                  f"(chance {result['chance']:.2f})", flush=True)
    out = trainer.export()
    if dist.is_main:
        print(f"kiln: exported to {out}", flush=True)
