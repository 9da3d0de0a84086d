"""VLM recipe: a LLaVA trained on image–conversation shards with DeepSpeed ZeRO, exact packing,
two stages (align → finetune), held-out eval, and a Hugging Face export that vLLM serves.

Where the weights come from (`source`, recipes/vlm/weights.py): a vision-tower folder + a language-model
folder (`vlm.vision_from` + `vlm.language_from`, LLaVA's stage 1), a LLaVA folder (`model.init_from`: an
align run or a llava-hf release), a Qwen2.5-VL or Qwen3-VL folder (`model.init_from`, native resolution), or
fresh weights shaped by `model.*` (the digits demo). The processor comes with them (the dataset's own for the
digits demo); what differs between LLaVA's inputs and a Qwen-VL's is one adapter (recipes/vlm/inputs.py).

Read top to bottom: setup (data, processor, model, engine, resume) → the loss → evaluate → export. The
step, checkpoints and resume are common/trainer.py's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from common import deepspeed as ds
from common import lora
from common.checkpoint import read_meta
from common.config import TrainConfig
from common.distributed import DistInfo, barrier
from common.engine import DeepSpeedEngine
from common.parallel_dims import ParallelDims
from common.preference import eval_summary as preference_summary
from common.seed import seed_everything
from common.trainer import Trainer
from recipes.vlm import lora as vlm_lora
from recipes.vlm.attention import eval_attention
from recipes.vlm.data import prepare_data
from recipes.vlm.evaluate import conversation_eval, generate_answers, load_eval_samples, save_answer_grid, score
from recipes.vlm.inputs import inputs_for
from recipes.vlm.llava import llava_hf_state_dict
from recipes.vlm.parallelize import parallelize
from recipes.vlm.preference import PreferenceTraining, check_data
from recipes.vlm.weights import init_folder, load_model


class VLMTrainer(Trainer):
    def __init__(self, cfg: TrainConfig, dist: DistInfo, run_dir: Path, dims: ParallelDims | None = None):
        super().__init__(cfg, dist, run_dir, dims)
        # finetune=lora: adapters on the LLaVA (Qwen2.5-VL) of model.init_from, the base of every start
        # (common/lora.py).
        self.lora_base = str(init_folder(cfg.model.init_from)[0]) if cfg.finetune == "lora" else ""
        if self.resume_from is not None:  # one line for a checkpoint of another method, adapter or base
            lora.check_resume(read_meta(self.resume_from), cfg, self.lora_base, self.resume_from)
        self.meta = prepare_data(cfg, dist)
        check_data(cfg, self.meta)  # preference pairs with preference.loss, and only then
        seed_everything(cfg.trainer.seed)  # identical initial weights (a fresh projector) on every rank
        model, self.processor, source = load_model(cfg, self.meta)
        # The architecture's inputs: processor and tower agree on image tokens, and the chat template trains
        # (one line if not).
        self.inputs = inputs_for(source, self.processor, model, self.meta)
        self.conversations = self.inputs.conversations
        stops = self.inputs.check_chat_template()
        loaded = source.describe(model)
        if dist.is_main and loaded:
            print(loaded, flush=True)
        if dist.is_main and not stops:
            print(
                "kiln: warning: the chat template ends assistant turns without eos, so the model does not learn to "
                "stop (llava-hf's template drops LLaVA's </s>)",
                flush=True,
            )
        # parallel.cp > 1: the cp ranks of each data-parallel group (dp = world / cp) read the same rows and split them.
        self.cp = self.dims.context_groups(self.device.type)
        dp_rank = dist.rank if self.cp is None else self.cp.dp_rank
        self.engine = DeepSpeedEngine(parallelize(model, cfg, self.cp), cfg, self.dims.dp, cp=self.cp)
        self.model = self.engine.module
        self.dtype = next(self.model.parameters()).dtype
        # preference.loss: pairs and the pairwise objective (and its frozen reference) instead of supervised turns.
        self.preference = PreferenceTraining(self) if cfg.preference.enabled else None
        if self.preference is None:
            loader = self.inputs.train_loader(cfg, self.meta, rank=dp_rank, dp=self.dims.dp)
        else:
            loader = self.preference.loader(self.inputs, rank=dp_rank, dp=self.dims.dp)
        # Nothing random per rank in a step but LoRA's dropout: the rest of the state is the same on every rank.
        self.start(loader, per_rank_rng=bool(self.lora_base) and cfg.lora.dropout > 0)
        self.model.train()

    # ---- the loss (common/trainer.py runs the step) ------------------------------------------
    def model_inputs(self, batch: dict) -> dict:
        inputs = self.inputs.model_inputs(batch, self.cfg.toggles.attention, self.device, self.dtype)
        if "attention_mask" in inputs and inputs["attention_mask"].dtype != torch.bool:
            inputs["attention_mask"] = inputs["attention_mask"].to(self.dtype)
        return inputs

    def loss(self, batch: dict) -> torch.Tensor:
        """Cross-entropy summed over the micro-batch's labelled tokens (the assistant's answers), by
        transformers' own loss: with `num_items_in_batch` it sums and divides by it. Under preference.loss the
        pairwise loss summed over the pairs (recipes/vlm/preference.py)."""
        if self.preference is not None:
            return self.preference.loss(batch)
        # No KV cache in training (and none recomputed).
        return self.engine.model(**self.model_inputs(batch), use_cache=False, num_items_in_batch=1).loss

    def count(self, batch: dict) -> int:
        return self.inputs.count(batch) if self.preference is None else batch["pairs"]

    def tally(self, batch: dict) -> dict[str, int]:
        counts = self.inputs.tally(batch)
        if self.preference is not None:  # the documents are the samples; the pairs, and those dropped whole
            counts |= {"pairs": batch["pairs"], "skipped_pairs": batch["skipped_pairs"]}
        return counts

    def loss_terms(self) -> dict[str, torch.Tensor]:
        return {} if self.preference is None else self.preference.terms()  # TRL's rewards/* and logps/*

    def checkpoint_meta(self) -> dict:
        return {"stage": self.cfg.vlm.stage, **lora.checkpoint_meta(self.cfg, self.lora_base)}

    # ---- hooks of the loop (common/trainer.py) ---------------------------------------------
    def after_first_step(self) -> None:
        path = self.run_dir / "memory.json"  # ZeRO partitions over every rank: dp x cp
        ds.record_state_bytes(self.engine.ds, self.cfg, self.dist, self.dims.dp * self.dims.cp, path)

    # ---- evaluation and export ------------------------------------------------------------
    def evaluate(self) -> dict | None:
        """Every rank evaluates (ZeRO-3 gathers weights collectively); rank 0 scores and writes."""
        self.model.eval()
        with eval_attention(self.model, self.cfg.toggles.attention):
            if self.preference is not None:  # held-out pairs: the loss and TRL's rewards/*
                result = self.preference.evaluate(self.inputs, self.cfg.vlm.eval_samples) | {"step": self.state.step}
                result = result if self.dist.is_main else None
            elif self.conversations:
                result = self.evaluate_conversations()
            else:
                result = self.evaluate_digits()
        self.model.train()
        if result is not None:
            (self.run_dir / "eval.json").write_text(json.dumps(result, indent=2))
        return result

    def evaluate_digits(self) -> dict | None:
        samples = load_eval_samples(self.meta["val_urls"], self.cfg.vlm.eval_samples)
        if self.dist.is_main:
            print(
                f"kiln: eval: answering {len(samples)} held-out images (greedy, up to {self.cfg.vlm.max_new_tokens} "
                "new tokens)",
                flush=True,
            )
        answers = generate_answers(
            self.model, self.processor, samples, max_new_tokens=self.cfg.vlm.max_new_tokens, device=self.device
        )
        if not self.dist.is_main:
            return None
        save_answer_grid(samples, answers, self.run_dir / "samples" / "eval.png")
        return {**score(samples, answers), "step": self.state.step, "stage": self.cfg.vlm.stage}

    def evaluate_conversations(self) -> dict | None:
        if self.dist.is_main:
            print(f"kiln: eval: loss on up to {self.cfg.vlm.eval_samples} held-out conversations", flush=True)
        result = conversation_eval(
            self.model,
            self.inputs,
            self.meta["val_urls"],
            limit=self.cfg.vlm.eval_samples,
            max_seq_len=self.cfg.data.max_seq_len,
            max_new_tokens=self.cfg.vlm.max_new_tokens,
            device=self.device,
        )
        return {**result, "step": self.state.step, "stage": self.cfg.vlm.stage} if self.dist.is_main else None

    def eval_summary(self, result: dict) -> str:
        if "num_pairs" in result:
            return preference_summary(result)
        if "accuracy" in result:
            return (
                f"kiln: eval accuracy {result['accuracy']:.3f} on {result['num_samples']} held-out digits "
                f"(chance {result['chance']:.2f})"
            )
        return (
            f"kiln: eval loss {result['val_loss']:.4f} on {result['num_samples']} held-out conversations "
            f"({result['val_tokens']:,} answer tokens)"
        )

    def export(self) -> Path:
        """Hugging Face folder: config (image_token_index, vision_feature_layer, ...), safetensors, tokenizer,
        processor + chat template; the image processor also in its own preprocessor_config.json, where
        releases before transformers 5 (and the vLLM builds pinned to them) read it. The tensors carry llava-hf's
        names (`llava_hf_state_dict`). A Qwen2.5-VL's export is its release's layout: transformers' own names, its
        tokenizer and chat template, and its image processor with the run's pixel budget. Under finetune=lora: a
        PEFT adapter folder on model.init_from's LLaVA, and with export.merge_lora the merged model in
        export/merged (recipes/vlm/lora.py)."""
        out, tmp = self.run_dir / "export", self.run_dir / ".export.tmp"
        with self.engine.gathered():
            if self.dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                if self.lora_base:
                    vlm_lora.write_export(self.model, self.cfg, tmp, base=self.lora_base, processor=self.processor)
                else:
                    self.model.save_pretrained(tmp, state_dict=llava_hf_state_dict(self.model), safe_serialization=True)
                    self.processor.save_pretrained(tmp)
                    self.processor.image_processor.save_pretrained(tmp)
                shutil.rmtree(out, ignore_errors=True)
                tmp.rename(out)
        barrier()
        return out


TRAINER = VLMTrainer  # recipes/registry.py
