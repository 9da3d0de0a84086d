"""LLM recipe: a Llama trained with DTensor tensor parallelism + FSDP2 data parallelism on packed
documents, sharded DCP checkpoints that reshard on resume, and a Hugging Face export.

Read top to bottom: setup (data, mesh, model, engine, resume) → the loss → export. The step, checkpoints
and resume are common/trainer.py's; the optimizer, DCP and the pipeline's step are common/engine.py's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as tdist
from torch.distributed.checkpoint.state_dict import StateDictOptions

from common import lora
from common.checkpoint import read_meta
from common.config import TrainConfig
from common.data.packing import PackedBatch
from common.data.webdataset import train_loader
from common.distributed import DistInfo, barrier
from common.engine import NativeEngine
from common.errors import DataError
from common.metrics import add_to_step, plot_reward_curve
from common.parallel_dims import CPGroups, ParallelDims, batch_mesh
from common.preference import eval_summary as preference_summary
from common.trainer import Trainer
from recipes.llm import weights
from recipes.llm.config import check_qlora_layout
from recipes.llm.context_parallel import ContextShard
from recipes.llm.data import (
    build_train_loader,
    decode_document,
    eval_batches,
    load_tokenizer,
    local_batch,
    model_inputs,
    pad_id,
    prepare_data,
    real_token_mask,
)
from recipes.llm.export import write_export
from recipes.llm.grpo import GRPOTraining, decode_prompt
from recipes.llm.grpo import check_data as check_prompts
from recipes.llm.loss import NextTokenLoss
from recipes.llm.model import LlamaArgs, MoE, Transformer
from recipes.llm.moe_losses import MoEAux, expert_load
from recipes.llm.parallelize import parallelize
from recipes.llm.pipeline_parallel import Pipeline, TiedEmbeddings, split_for_rank, virtual_stages
from recipes.llm.preference import PreferenceTraining, check_data, decode_pair
from recipes.llm.sizing import llama_args


def build_model(args: LlamaArgs, cfg: TrainConfig, mesh, device: torch.device) -> Transformer:
    """This rank's model, parallelized and allocated, its weights still to be filled: built on meta,
    split for the rank's pipeline stages, parallelized, then materialized, so each rank allocates only
    what it holds. Under pipeline parallelism it is the rank's part: the layers/ends of its stages
    (same FQNs as the whole model)."""
    with torch.device("meta"):
        model = Transformer(args)
    pp = mesh["pp"].size()
    if pp > 1:
        split_for_rank(model, mesh["pp"].get_local_rank(), pp, virtual_stages(cfg.parallel.pp_schedule))
    model = parallelize(model, mesh, cfg)
    model.to_empty(device=device)
    model.init_buffers()  # the RoPE table; the caller fills the weights (no random init to throw away)
    return model


@dataclasses.dataclass
class LocalBatch:
    """This dp rank's rows of a global micro-batch (trainer.micro_batch_size of them), packed."""

    packed: PackedBatch
    cp: ContextShard | None = None  # under context parallelism (parallel.cp > 1): this cp rank's share of the rows


class LLMTrainer(Trainer):
    def __init__(self, cfg: TrainConfig, dist: DistInfo, run_dir: Path, dims: ParallelDims | None = None):
        super().__init__(cfg, dist, run_dir, dims)
        self.lora = cfg.finetune == "lora"  # adapters on a frozen model.init_from (common/lora.py)
        if self.resume_from is not None:  # one line for a checkpoint of another method, adapter or base
            lora.check_resume(read_meta(self.resume_from), cfg, cfg.model.init_from, self.resume_from)
        self.meta = prepare_data(cfg, dist)
        self.tokenizer = self.resolve_tokenizer()
        # Rows are padded with pad_token_id, else (Llama 3 has none) eos: pad slots are masked either way.
        self.pad_id = pad_id(self.tokenizer)
        self.mesh = self.dims.build_mesh(self.device.type)
        self.dp_rank = self.mesh["dp"].get_local_rank()
        # Context parallelism: the cp ranks of a dp rank read the same documents and split each row.
        self.cp = CPGroups.of(self.mesh)
        self.chat = self.meta.get("format") == "chat"  # conversations are never cut across rows
        check_data(cfg, self.meta)  # preference pairs with preference.loss, and only then
        check_prompts(cfg, self.meta)  # prompts with grpo.enabled, and only then
        pairs = cfg.preference.enabled  # preference optimization (recipes/llm/preference.py): pairs, laid whole
        if cfg.grpo.enabled:  # GRPO (recipes/llm/grpo.py): global micro-batches of micro_batch_size x dp prompts
            rows = cfg.trainer.micro_batch_size * self.dims.dp
            loader = train_loader(
                cfg, self.meta["train_urls"], decode=decode_prompt, collate=list, batch_size=rows, rank=0, world_size=1
            )
        else:
            loader = build_train_loader(
                cfg,
                self.meta["train_urls"],
                self.dims.dp,
                chat=self.chat or pairs,
                decode=decode_pair if pairs else decode_document,
            )
        self.args = llama_args(cfg, len(self.tokenizer))
        if len(self.tokenizer) > self.args.vocab_size:
            raise DataError(
                f"the tokenizer has {len(self.tokenizer)} tokens but model.vocab_size={self.args.vocab_size}"
            )

        self.model = build_model(self.args, cfg, self.mesh, self.device)
        self.load_weights()
        if cfg.lora.quantize_base == "nf4":
            self.quantize_base()
        self.find_moe_layers()
        self.objective = NextTokenLoss(cfg, self.dims, self.device)  # the one loss: training, pipeline, evaluation
        # preference.loss: the pairwise objective (and its frozen reference) instead of next-token prediction
        self.preference = PreferenceTraining(self, build_model) if pairs else None
        # grpo.enabled: samples from the rollout engine scored by the reward functions, the GRPO loss on them
        self.grpo = GRPOTraining(self, build_model) if cfg.grpo.enabled else None
        self.grpo_eval = None  # its held-out reward, taken at the end of fit (evaluate_grpo)
        self.pipeline, tied = self.build_pipeline()
        self.engine = NativeEngine(
            self.model, cfg, self.mesh, cp=self.cp, tied=tied, backward_context=self.objective.backward
        )
        if self.lora and self.resume_from is None:
            lora.init_adapter(self.model, cfg.trainer.seed)
        # Layout-independent: one global data stream and no per-rank random draws, so rank 0's copy
        # (step, data position, LR schedule) resumes any layout. LoRA dropout draws per rank: its streams are saved.
        self.start(loader, per_rank_rng=self.lora and cfg.lora.dropout > 0)
        if self.preference is not None:  # preference.reference=precomputed: at the start weights, before step 1
            self.preference.after_start()
        self.model.train()

    # ---- setup steps (in __init__'s order) ------------------------------------------------------
    def load_weights(self) -> None:
        """The weights: from the checkpoint resumed (load_checkpoint, in start), else from model.init_from (each
        rank reads its own slices), else rank 0's seeded init copied into every layout, so all layouts start from
        the same weights (a "seed checkpoint"). Under LoRA the checkpoints hold the adapter only: the frozen base
        always comes from model.init_from, the adapter from a seeded init (init_adapter)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        cfg, source = self.cfg, self.cfg.model.init_from
        if source and (self.resume_from is None or self.lora):
            weights.load_weights(self.model, self.args, source)
            if self.dist.is_main:
                n = sum(math.prod(shape) for shape, _ in weights.safetensors_weights(Path(source)).values())
                print(f"kiln: model.init_from: loaded {n:,} weights from {source}", flush=True)
        elif self.resume_from is None:
            full = None
            if self.dist.is_main:
                reference = Transformer(self.args)
                reference.init_weights(seed=cfg.trainer.seed)
                full = reference.state_dict()
            # strict=False under PP: rank 0's full dict holds the other stages' keys too.
            set_model_state_dict(
                self.model,
                full or {},
                options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=self.dims.pp == 1),
            )

    def quantize_base(self) -> None:
        """QLoRA (lora.quantize_base=nf4): the loaded base's adapted linears in 4 bits."""
        check_qlora_layout(self.cfg, self.dims.dp, self.dims.tp, self.dims.pp)
        held = lora.quantize_base(self.model)
        print(
            f"kiln: lora.quantize_base=nf4: the adapted linears' base weights hold {held / 2**20:,.1f} MiB", flush=True
        )

    def find_moe_layers(self) -> None:
        """The MoE layers this rank holds (found through any wrapper: AC, FSDP), whose routing the aux losses read,
        and every MoE layer of the model (under pipeline parallelism, other ranks hold some: step_metrics)."""
        moe_layers = {
            int(re.search(r"layers\.(\d+)\.", name)[1]): m
            for name, m in self.model.named_modules()
            if isinstance(m, MoE)
        }
        self.moe_layer_ids = [i for i in range(self.args.n_layers) if self.args.is_moe_layer(i)]
        moe = self.cfg.model.moe
        # The routing statistics are counted over every rank that splits the step's tokens: dp, and under context
        # parallelism dp x cp (each cp rank routes its chunks of the rows), so that the aux losses are the whole rows'.
        batch = batch_mesh(self.mesh)
        self.moe_aux = (
            None
            if not self.args.moe
            else MoEAux(moe_layers, moe.aux_loss_coef, moe.z_loss_coef, batch.get_group() if batch.size() > 1 else None)
        )
        self.moe_worst = torch.zeros(2, device=self.device)  # the run's worst (max/mean load, MoE layer index)
        # Expert parallelism's token exchanges (recipes/llm/expert_parallel.py): their host counters.
        self.token_exchanges = [m.token_exchange for m in moe_layers.values() if hasattr(m, "token_exchange")]

    def build_pipeline(self) -> tuple[Pipeline | None, TiedEmbeddings | None]:
        """Under pipeline parallelism: the rank's stages and schedule, and the tied embeddings that its first and
        last stages hold twice (gradients summed over the pair: recipes/llm/pipeline_parallel.py:TiedEmbeddings)."""
        if self.dims.pp == 1:
            return None, None
        pipeline = Pipeline(self.model, self.cfg, self.mesh, self.device, self.pad_id, self.objective, self.moe_aux)
        return pipeline, TiedEmbeddings(self.model, self.mesh) if self.args.tie_embeddings else None

    def resolve_tokenizer(self):
        """The data's tokenizer, or with model.init_from the checkpoint's, after checking that the data
        was tokenized with it."""
        data_tokenizer = load_tokenizer(self.cfg.data.root)
        source = self.cfg.model.init_from
        if not source:
            return data_tokenizer
        tokenizer = weights.load_tokenizer(source)
        weights.check_same_tokenizer(data_tokenizer, tokenizer, self.cfg.data.root, source)
        return tokenizer

    # ---- the loss (common/trainer.py runs the step) ------------------------------------------
    def prepare(self, rows: list[list[dict]]) -> LocalBatch:
        """This dp rank's rows of the global micro-batch (rows r, r+dp, ...), packed; under context parallelism,
        this cp rank's share of them."""
        if self.preference is not None:
            return self.preference.prepare(rows)
        packed = local_batch(
            rows, dp_rank=self.dp_rank, dp=self.dims.dp, max_seq_len=self.cfg.data.max_seq_len, pad_id=self.pad_id
        )
        cp, method = self.cp, self.cfg.parallel.cp_method
        shard = None if cp is None else ContextShard.of(packed, cp.cp, cp.cp_rank, method, self.cfg.toggles.attention)
        return LocalBatch(packed, shard)

    def prepare_step(self, batches: list) -> list:
        """Under grpo.enabled the step's prompts are synced, generated and scored once (recipes/llm/grpo.py)."""
        if self.grpo is not None:
            return self.grpo.prepare_step(batches)
        return super().prepare_step(batches)

    def count(self, batch: LocalBatch) -> int:
        # Only labelled tokens count (chat: the assistant's); under cp this rank's (summed over dp x cp). Pairs: pairs.
        if self.preference is not None:
            return batch.pairs
        if self.grpo is not None:
            return self.grpo.count(batch)
        return batch.cp.num_labels if batch.cp is not None else batch.packed.num_labels

    def tally(self, batch: LocalBatch) -> dict[str, int]:
        if self.grpo is not None:
            return self.grpo.tally(batch)
        if batch.cp is not None:
            return {"tokens": batch.cp.num_real_tokens, "slots": batch.cp.input_ids.numel()}
        return {"tokens": batch.packed.num_real_tokens, "slots": batch.packed.input_ids.numel()}

    def loss(self, batch: LocalBatch) -> torch.Tensor:
        """The recipe's loss (recipes/llm/loss.py) summed over the labelled tokens, plus an MoE's auxiliary losses;
        under preference.loss the pairwise loss summed over the pairs (recipes/llm/preference.py)."""
        if self.preference is not None:
            return self.preference.loss(batch)
        if self.grpo is not None:
            return self.grpo.loss(batch)
        return self.forward_sum(batch, aux=True)

    def forward_sum(self, batch: LocalBatch, aux: bool) -> torch.Tensor:
        """The one forward path without pipeline parallelism (training and evaluation): the model and the loss in the
        loss's context; ``aux``: plus the MoE's auxiliary losses (recipes/llm/moe_losses.py:MoEAux), training only."""
        packed, device = batch.packed, self.device
        if batch.cp is not None:  # this cp rank's chunks of the rows, their next-token targets (shifted)
            input_ids, labels = batch.cp.input_ids, batch.cp.targets
            inputs = batch.cp.model_inputs(self.cp.cp_group, device)
        else:
            input_ids, labels = packed.input_ids, packed.labels
            inputs = model_inputs(packed, self.cfg.toggles.attention, device)
        with self.objective.forward():
            logits = self.model(input_ids.to(device), **inputs)
            loss = self.objective(logits, labels.to(device))
            if aux and self.moe_aux is not None:
                real = (batch.cp.real_tokens if batch.cp is not None else real_token_mask(packed)).flatten().to(device)
                weight = torch.tensor(float(self.count(batch)), device=device)
                loss = loss + self.moe_aux.loss(*self.moe_aux.routed(real, weight))
        return loss

    def forward_backward(self, batch: LocalBatch, inv_count, last, timer) -> torch.Tensor:
        """Under pipeline parallelism the schedule runs the micro-batch's forward and backward itself (calling the
        same loss on its last stage: recipes/llm/pipeline_parallel.py); otherwise the engine runs `loss`."""
        if self.pipeline is None:
            return super().forward_backward(batch, inv_count, last, timer)
        with timer.phase("forward"):  # forward and backward, interleaved by the schedule
            return self.pipeline.step(batch, self.engine.grad_scale(inv_count))

    def loss_terms(self) -> dict[str, torch.Tensor]:
        if self.preference is not None:  # TRL's rewards/* and logps/* (means over the step's pairs)
            return self.preference.terms()
        return {} if self.moe_aux is None else self.moe_aux.pop_terms(self.device)

    def step_metrics(self) -> dict[str, torch.Tensor]:
        """Per MoE layer, the step's expert load (global tokens per expert): the busiest expert over the mean
        (`moe.layer<i>.max_load`) and the load's normalised entropy (`moe.layer<i>.load_entropy`), plus the
        worst layer's max_load; under expert parallelism, what this rank's forwards dispatched (`moe.dispatched_rows`:
        token-expert pairs) and sent to other ranks (`moe.all_to_all_bytes`: dispatch and combine). On the device;
        the run's worst is kept for the summary (log_moe_summary). Under pipeline parallelism each stage holds its
        layers' load (global over dp): one all-reduce over pp gathers them."""
        if self.grpo is not None:  # TRL's reward, completion and clip metrics; the sync's gap; seconds per part
            return self.grpo.step_metrics()
        if self.moe_aux is None:
            return {}
        load = self.moe_aux.pop_load(self.moe_layer_ids, self.args.moe.num_experts, self.device)
        if self.dims.pp > 1:
            tdist.all_reduce(load, group=self.mesh["pp"].get_group())
        max_load, entropy = expert_load(load)
        worst, at = max_load.max(0)
        self.moe_worst = torch.where(worst > self.moe_worst[0], torch.stack([worst, at.float()]), self.moe_worst)
        out = {"moe.max_load": worst}
        for i, layer in enumerate(self.moe_layer_ids):
            out |= {f"moe.layer{layer}.max_load": max_load[i], f"moe.layer{layer}.load_entropy": entropy[i]}
        if self.token_exchanges:  # this rank's forward all-to-alls, over its MoE layers (host counts; not global)
            out |= {
                "moe.dispatched_rows": sum(e.rows_dispatched for e in self.token_exchanges),
                "moe.all_to_all_bytes": sum(e.bytes_sent for e in self.token_exchanges),
            }
            for e in self.token_exchanges:
                e.rows_dispatched = e.bytes_sent = 0
        return out

    def log_moe_summary(self) -> None:
        """One line at the end of the run: the worst layer's expert imbalance over the run (one host read)."""
        if self.moe_layer_ids and self.dist.is_main:
            worst, at = self.moe_worst.tolist()
            print(
                f"kiln: MoE expert load: worst max/mean {worst:.2f} (layer {self.moe_layer_ids[int(at)]}; "
                f"1.00 = balanced, {self.cfg.model.moe.num_experts} = one expert takes every token; "
                "per layer in metrics.jsonl: moe.layer<i>.max_load, load_entropy)",
                flush=True,
            )

    def checkpoint_meta(self) -> dict:
        return lora.checkpoint_meta(self.cfg, self.cfg.model.init_from)

    # ---- evaluation and export ------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict | None:
        """The held-out loss (token-mean next-token cross-entropy, no MoE aux losses) and its perplexity over the val
        split's first data.eval_docs documents, laid into global micro-batches of rows as training lays them (the
        last one's missing rows are padding): each dp rank its rows, every rank the same batches (FSDP, expert and
        pipeline parallelism are collective). Rank 0 writes RUN_DIR/eval.json and returns it."""
        from common.data.webdataset import iter_samples

        if self.grpo is not None:  # taken at the end of fit, the rollout engine still up (evaluate_grpo)
            return self.grpo_eval
        held_out = iter_samples(self.meta.get("val_urls", []))
        decode = decode_document if self.preference is None else decode_pair
        docs = [decode(s) for s, _ in zip(held_out, range(self.cfg.data.eval_docs))]
        if not docs:
            if self.dist.is_main:
                print("kiln: eval: skipped: the val split has no documents", flush=True)
            return None
        if self.preference is not None:  # held-out pairs: the loss and TRL's rewards/* (recipes/llm/preference.py)
            result = self.preference.evaluate(docs) | {"step": self.state.step}
            if not self.dist.is_main:
                return None
            (self.run_dir / "eval.json").write_text(json.dumps(result, indent=2))
            return result
        rows = self.cfg.trainer.micro_batch_size * self.dims.dp
        batches = eval_batches(docs, rows, self.cfg.data.max_seq_len, chat=self.chat)
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # CE sum, labelled tokens
        for global_rows in batches:
            batch = self.prepare(global_rows)
            loss_sum = (
                self.pipeline.eval_loss(batch) if self.pipeline is not None else self.forward_sum(batch, aux=False)
            )
            sums += torch.stack([loss_sum.double(), torch.tensor(float(self.count(batch)), device=self.device)])
        self.model.train()
        # Over dp; the CE sum over pp too (only the last stage computes it: Engine.all_reduce).
        loss, tokens = torch.cat(
            [self.engine.all_reduce(sums[:1], loss=True), self.engine.all_reduce(sums[1:])]
        ).tolist()
        if not self.dist.is_main:
            return None
        val_loss = loss / max(tokens, 1)
        result = {
            "val_loss": val_loss,
            "val_perplexity": math.exp(val_loss),
            "val_tokens": int(tokens),
            "num_samples": len(docs),
            "step": self.state.step,
        }
        (self.run_dir / "eval.json").write_text(json.dumps(result, indent=2))
        return result

    # ---- export -----------------------------------------------------------------------------
    def export(self) -> Path:
        """A Hugging Face LlamaForCausalLM folder (safetensors + tokenizer) from the sharded model; with
        model.init_from, in the source's format (recipes/llm/weights.py:write_hf_folder). Under LoRA a PEFT adapter
        folder on model.init_from, and with export.merge_lora the merged model in export/merged
        (recipes/llm/lora.py)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        # LoRA without merging gathers the adapter only.
        adapter_only = self.lora and not self.cfg.export.merge_lora
        if self.dims.pp > 1:
            # Each rank holds its stages' weights (disjoint FQNs): consolidate, then gather the stages.
            part = get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, ignore_frozen_params=adapter_only)
            )
            parts = [None] * self.dims.pp
            tdist.all_gather_object(
                parts, {k: v.detach().cpu() for k, v in part.items()}, group=self.mesh["pp"].get_group()
            )
            full = {k: v for p in parts for k, v in p.items()}
        else:
            full = get_model_state_dict(
                self.model,
                options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapter_only),
            )
        out, tmp = self.run_dir / "export", self.run_dir / ".export.tmp"
        if self.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            write_export(full, self.args, self.cfg, tmp, tokenizer=self.tokenizer)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
        barrier()
        return out

    def fit(self, batches=None) -> None:
        """common/trainer.py's loop; under grpo.enabled with trainer.eval, the held-out reward before a fresh run's
        first step (step 0) and after its last (evaluate_grpo), while the rollout engine is up, then RUN_DIR/reward.png;
        the engine stops when training ends, or fails."""
        on = self.grpo is not None and self.cfg.trainer.eval
        try:
            if on and self.state.step == 0 < self.cfg.trainer.max_steps:
                self.evaluate_grpo()
            super().fit(batches)
            if on:
                self.grpo_eval = self.evaluate_grpo()
            if self.grpo is not None and self.dist.is_main:  # the training reward per step, the held-out reward
                plot_reward_curve(self.run_dir / "metrics.jsonl", self.run_dir / "reward.png")
        finally:
            if self.grpo is not None:
                self.grpo.close()

    def evaluate_grpo(self) -> dict | None:
        """grpo.enabled's held-out evaluation (recipes/llm/grpo.py:GRPOTraining.evaluate) on the val split's first
        data.eval_docs prompts: ``eval/reward`` and ``eval/rewards/<function>/mean`` in metrics.jsonl at the step the
        weights are of (0, or the last step's record), and RUN_DIR/eval.json (rank 0 writes them; every rank calls it).
        """
        from common.data.webdataset import iter_samples

        held_out = iter_samples(self.meta.get("val_urls", []))
        prompts = [decode_prompt(s) for s, _ in zip(held_out, range(self.cfg.data.eval_docs))]
        if not prompts:
            print("kiln: eval: skipped: the val split has no prompts", flush=True)
            return None
        result = {"step": self.state.step, **self.grpo.evaluate(prompts)}  # every rank calls it
        if self.dist.is_main:
            add_to_step(self.run_dir / "metrics.jsonl", self.state.step, result)  # the loop's logger is closed
            (self.run_dir / "eval.json").write_text(json.dumps(result, indent=2))
        return result

    def after_fit(self) -> None:
        self.log_moe_summary()

    def eval_summary(self, result: dict) -> str:
        if "num_pairs" in result:
            return preference_summary(result)
        if "eval/reward" in result:
            return (
                f"kiln: eval reward {result['eval/reward']:.4f} on {result['eval/num_prompts']} held-out prompts "
                f"(greedy; step {result['step']})"
            )
        return (
            f"kiln: eval loss {result['val_loss']:.4f} (perplexity {result['val_perplexity']:.1f}) on "
            f"{result['num_samples']} held-out documents ({result['val_tokens']:,} tokens)"
        )

    def after_export(self, out: Path) -> None:
        """A greedy generation from the exported folder, in samples/generation.txt and on stdout."""
        text = sample_generation(out)
        (self.run_dir / "samples").mkdir(exist_ok=True)
        (self.run_dir / "samples" / "generation.txt").write_text(text + "\n")
        print(f"kiln: sample: {text!r}", flush=True)


def sample_generation(export: Path, prompt: str = "The with statement", max_new_tokens: int = 40) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    ids = tokenizer(prompt, return_tensors="pt")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    return tokenizer.decode(out[0], skip_special_tokens=True)


TRAINER = LLMTrainer  # recipes/registry.py
