"""LLM recipe: a Llama trained with DTensor tensor parallelism + FSDP2 data parallelism on packed
documents, sharded DCP checkpoints that reshard on resume, and a Hugging Face export.

Read top to bottom: setup (data, mesh, model, optimizer, resume) → train_step → train → export.
"""

from __future__ import annotations

import contextlib
import functools
import math
import shutil
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions

from common.checkpoint import CheckpointManager
from common.config import TrainConfig
from common.data.packing import PackedBatch
from common.distributed import DistInfo, barrier
from common.errors import DataError
from common.memory import Block, ModelSpec, count_params
from common.optim import adamw_kernel, lr_factor
from common.parallel_dims import ParallelDims
from common.profiling import StepTimer
from common.seed import seed_everything
from common.trainer import StepStats, Trainer, TrainState
from recipes.llm import hf
from recipes.llm.data import build_train_loader, load_tokenizer, local_batch, model_inputs, pad_id, prepare_data
from recipes.llm.model import Llama3RopeScaling, LlamaArgs, Transformer
from recipes.llm.parallelize import parallelize
from recipes.llm.pipeline import Pipeline, TiedEmbeddings, clip_grad_norm_, split_for_rank, virtual_stages


def llama_args(cfg: TrainConfig, vocab_size: int) -> LlamaArgs:
    """The model of cfg.model (with model.init_from, the checkpoint's: recipes/llm/config.py:complete)."""
    m = cfg.model
    r = m.rope_scaling
    scaling = None if r.rope_type == "default" else Llama3RopeScaling(
        factor=r.factor, low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
        original_max_position_embeddings=r.original_max_position_embeddings)
    return LlamaArgs(dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
                     vocab_size=m.vocab_size or vocab_size, ffn_dim=m.ffn_dim, norm_eps=m.norm_eps,
                     rope_theta=m.rope_theta, max_seq_len=m.max_seq_len, tie_embeddings=m.tie_embeddings,
                     head_dim=m.head_dim, rope_scaling=scaling)


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


# Optimizer state keyed per parameter FQN ("param_groups.<fqn>.lr", ...). Nested, `param_groups` is
# one object that DCP saves from a single rank: under pipeline parallelism each stage's groups name
# different parameters, and the other stages would load groups without their hyperparameters.
FLAT_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


class LLMTrainer(Trainer):
    def __init__(self, cfg: TrainConfig, dist: DistInfo, run_dir: Path):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        super().__init__(cfg, dist, run_dir)
        self.meta = prepare_data(cfg, dist)
        self.tokenizer = self.resolve_tokenizer()
        # Rows are padded with pad_token_id, else (Llama 3 has none) eos: pad slots are masked either way.
        self.pad_id = pad_id(self.tokenizer)
        self.dims = ParallelDims.from_config(cfg.parallel, dist.world_size)
        self.mesh = self.dims.build_mesh(self.device.type)
        self.dp_rank = self.mesh["dp"].get_local_rank()
        loader = build_train_loader(cfg, self.meta["train_urls"], self.dims.dp)
        self.args = llama_args(cfg, len(self.tokenizer))
        if len(self.tokenizer) > self.args.vocab_size:
            raise DataError(f"the tokenizer has {len(self.tokenizer)} tokens but model.vocab_size={self.args.vocab_size}")

        pp = self.dims.pp
        self.model = build_model(self.args, cfg, self.mesh, self.device)
        self.ckpt = CheckpointManager(run_dir, cfg.checkpoint.keep, dist)
        resume_from = self.ckpt.resolve_resume(cfg.run.resume)
        # The weights: from the checkpoint resumed (load_checkpoint, below), else from model.init_from
        # (each rank reads its own slices), else rank 0's seeded init copied into every layout, so all
        # layouts start from the same weights (a "seed checkpoint").
        if resume_from is None and cfg.model.init_from:
            hf.load_weights(self.model, self.args, cfg.model.init_from)
            if dist.is_main:
                n = sum(math.prod(shape) for shape, _ in hf.safetensors_weights(Path(cfg.model.init_from)).values())
                print(f"kiln: model.init_from: loaded {n:,} weights from {cfg.model.init_from}", flush=True)
        elif resume_from is None:
            full = None
            if dist.is_main:
                reference = Transformer(self.args)
                reference.init_weights(seed=cfg.trainer.seed)
                full = reference.state_dict()
            # strict=False under PP: rank 0's full dict holds the other stages' keys too.
            set_model_state_dict(self.model, full or {}, options=StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True, strict=pp == 1))
        self.pipeline = Pipeline(self.model, cfg, self.mesh, self.device) if pp > 1 else None
        self.tied = TiedEmbeddings(self.model, self.mesh) if pp > 1 and self.args.tie_embeddings else None

        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay, **adamw_kernel(self.device))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, functools.partial(lr_factor, cfg=o, max_steps=cfg.trainer.max_steps))
        seed_everything(cfg.trainer.seed + 1)
        # Layout-independent: one global data stream and no per-rank random draws, so rank 0's copy
        # (step, data position, LR schedule) resumes any layout.
        self.state = TrainState(loader, rng=False, extras={"scheduler": self.scheduler})
        if resume_from is not None:
            self.load_checkpoint(resume_from)
            if dist.is_main:
                print(f"kiln: resumed from {resume_from} at step {self.state.step}", flush=True)
        self.model.train()

    def resolve_tokenizer(self):
        """The data's tokenizer, or with model.init_from the checkpoint's, after checking that the data
        was tokenized with it."""
        data_tokenizer = load_tokenizer(self.cfg.data.root)
        source = self.cfg.model.init_from
        if not source:
            return data_tokenizer
        tokenizer = hf.load_tokenizer(source)
        hf.check_same_tokenizer(data_tokenizer, tokenizer, self.cfg.data.root, source)
        return tokenizer

    # ---- one optimizer step -------------------------------------------------------------
    def pack(self, documents: list[dict]) -> tuple[PackedBatch, int, int]:
        """This dp rank's packed rows, and what every rank must agree on: the global number of labelled
        tokens (the loss is their mean) and the most rows any dp rank packs (pipeline rounds). Every rank
        holds the whole global micro-batch (one stream, sliced by dp rank), so packing every dp rank's
        share here is a little host work instead of collectives and host-device syncs every micro-batch."""
        shares = [local_batch(documents, dp_rank=r, dp=self.dims.dp, max_seq_len=self.cfg.data.max_seq_len,
                              pad_id=self.pad_id) for r in range(self.dims.dp)]
        # Only labelled tokens count (chat: the assistant's), here and in the loss's ignore_index.
        labelled = sum(int((share.labels[:, 1:] != -100).sum()) for share in shares)  # CPU tensors: no sync
        return shares[self.dp_rank], labelled, max(share.num_rows for share in shares)

    def micro_step_loss(self, documents: list[dict]) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """Loss whose dp-average of gradients equals the gradient of the global token mean."""
        packed, global_tokens, _ = self.pack(documents)
        labels = packed.labels[:, 1:].to(self.device)
        with self.autocast():
            logits = self.model(packed.input_ids.to(self.device),
                                **model_inputs(packed, self.cfg.toggles.attention, self.device))
        with self.loss_context():
            loss_sum = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
            if hasattr(loss_sum, "full_tensor"):  # loss parallel: a replicated DTensor scalar
                loss_sum = loss_sum.full_tensor()
        loss = loss_sum / max(1, global_tokens) * self.dims.dp  # FSDP averages over dp
        return loss, loss_sum.detach(), global_tokens, packed.input_ids.numel()

    def pipeline_micro_step(self, documents: list[dict], accum: int) -> tuple[torch.Tensor, int, int]:
        """micro_step_loss + backward under PP: the schedule runs forward and backward per microbatch."""
        packed, global_tokens, max_rows = self.pack(documents)
        scale = self.dims.dp / max(1, global_tokens) / accum  # micro_step_loss's normalization
        with self.autocast():
            loss_sum = self.pipeline.step(packed, self.pad_id, scale, max_rows)
        return loss_sum, global_tokens, packed.input_ids.numel()

    def train_step(self, batches, timer: StepTimer) -> StepStats:
        total, tokens, slots = torch.zeros((), device=self.device), 0, 0
        accum = self.cfg.trainer.grad_accum
        for _ in range(accum):
            with timer.phase("data_wait"):
                documents = next(batches)
            if self.pipeline is not None:
                with timer.phase("forward"):  # forward and backward, interleaved by the schedule
                    loss_sum, n_tokens, n_slots = self.pipeline_micro_step(documents, accum)
            else:
                with timer.phase("forward"):
                    loss, loss_sum, n_tokens, n_slots = self.micro_step_loss(documents)
                with timer.phase("backward"), self.loss_context():
                    (loss / accum).backward()
            total += loss_sum.float() / max(1, n_tokens) / accum  # mean over labelled tokens (chat: the assistant's)
            # Throughput counts every real token (the global micro-batch is on every rank), labelled or not.
            tokens, slots = tokens + sum(d["input_ids"].numel() for d in documents), slots + n_slots
        with timer.phase("optimizer"):
            clip = self.cfg.optim.grad_clip or float("inf")
            if self.tied is not None:
                self.tied.all_reduce_grads()
            if self.pipeline is not None:  # the norm spans every stage's gradients
                grad_norm = clip_grad_norm_(list(self.model.parameters()), clip, self.mesh["pp"].get_group(),
                                            skip=self.tied.norm_skip if self.tied is not None else None)
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            # The step's one host-device sync: skipping needs a decision on the host (the same on every
            # rank: the norm is global); common/trainer.py counts the skip.
            finite = bool(torch.isfinite(grad_norm))
            if finite:
                self.optimizer.step()
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        # The loss stays on the device; common/trainer.py reads it on logging steps only.
        tdist.all_reduce(total, group=self.mesh["dp"].get_group())
        if self.pipeline is not None:  # only the last stage computed the loss
            tdist.all_reduce(total, group=self.mesh["pp"].get_group())
        return StepStats(
            loss=total,
            grad_norm=grad_norm,
            skipped=not finite,
            lr=self.scheduler.get_last_lr()[0],
            tokens=tokens,
            token_utilization=tokens / (slots * self.dims.dp) if slots else 0.0,
            corrupt_shards=self.state.loader.corrupt_shards,  # one global stream: the same on every rank
        )

    def autocast(self):
        bf16 = self.cfg.toggles.precision in ("bf16", "fp8") and self.dims.dp == 1  # FSDP's policy casts otherwise
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def loss_context(self):
        if self.dims.tp > 1 and self.cfg.model.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    # ---- sharded checkpoints (torch.distributed.checkpoint) ------------------------------
    def save_checkpoint(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        def write(tmp: Path) -> None:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=FLAT_OPTIM)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
            if self.dist.is_main:  # the TrainState is the same on every rank (see __init__)
                torch.save(self.state.state_dict(), tmp / "trainer.pt")

        layout = {"dp": self.dims.dp, "tp": self.dims.tp, "pp": self.dims.pp}
        self.ckpt.save(self.state.step, write, meta={"recipe": self.cfg.recipe.name, "layout": layout})

    def load_checkpoint(self, path: Path) -> None:
        """DCP reshards: a checkpoint written under one (dp, tp) layout loads under another."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=FLAT_OPTIM)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=FLAT_OPTIM)
        self.state.load_state_dict(torch.load(path / "trainer.pt", weights_only=False))

    # ---- export -----------------------------------------------------------------------------
    def export(self) -> Path:
        """A Hugging Face LlamaForCausalLM folder (safetensors + tokenizer) from the sharded model; with
        model.init_from, in the source's format (recipes/llm/hf.py:write_hf_folder)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        if self.dims.pp > 1:
            # Each rank holds its stages' weights (disjoint FQNs): consolidate, then gather the stages.
            part = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
            parts = [None] * self.dims.pp
            tdist.all_gather_object(parts, {k: v.detach().cpu() for k, v in part.items()},
                                    group=self.mesh["pp"].get_group())
            full = {k: v for p in parts for k, v in p.items()}
        else:
            full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        out, tmp = self.run_dir / "export", self.run_dir / ".export.tmp"
        if self.dist.is_main:
            hf.write_hf_folder(full, self.args, tmp, tokenizer=self.tokenizer, source=self.cfg.model.init_from or None)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
        barrier()
        return out


def sample_generation(export: Path, prompt: str = "The with statement", max_new_tokens: int = 40) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    ids = tokenizer(prompt, return_tensors="pt")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def memory_spec(cfg: TrainConfig) -> ModelSpec:
    """The Llama for the memory model (common/memory.py): built on the meta device, counted. Without
    model.vocab_size the vocabulary is assumed (the tokenizer is not read)."""
    args = llama_args(cfg, vocab_size=cfg.model.vocab_size or 2048)
    with torch.device("meta"):
        model = Transformer(args)
    layer, first = count_params(model.layers["0"]), count_params(model.tok_embeddings)
    # Tied embeddings are counted once (on the first stage); under PP the last stage holds a second copy.
    last = count_params(model.norm) + (0 if args.tie_embeddings else count_params(model.output))
    # sdpa: the packed documents' [b,1,s,s] bool mask (kept as a bias per layer) and K/V repeated per query
    # head; flash: the varlen kernel takes cu_seqlens and shares K/V heads. DTensor TP keeps the gathered
    # linear inputs.
    varlen = cfg.toggles.attention == "flash"
    block = Block(hidden=args.dim, heads=args.n_heads, ffn=args.ffn_dim, kv_heads=args.n_kv_heads, norm="rmsnorm",
                  mlp="swiglu", dropout=False, attention="fused", repeat_kv=not varlen, dense_mask=not varlen,
                  megatron_sp=False, selective="save_matmuls")
    p = cfg.parallel
    return ModelSpec(cfg.recipe.name, block, layers=args.n_layers, seq=cfg.data.max_seq_len,
                     micro_batch=cfg.trainer.micro_batch_size, layer_params=layer, first_params=first,
                     last_params=last, gather_unit_params=max(layer, first + last),  # FSDP units: blocks, root
                     vocab=args.vocab_size, precision=cfg.toggles.precision, sharding="fsdp",
                     ac_modes=("none", "selective", "full"), pp_schedule=p.pp_schedule,
                     pp_microbatches=p.pp_microbatches, vocab_parallel=cfg.model.loss_parallel)


def main(cfg: TrainConfig, dist: DistInfo, run_dir: Path) -> None:
    trainer = LLMTrainer(cfg, dist, run_dir)
    trainer.fit()
    out = trainer.export()
    if dist.is_main:
        text = sample_generation(out)
        (run_dir / "samples").mkdir(exist_ok=True)
        (run_dir / "samples" / "generation.txt").write_text(text + "\n")
        print(f"kiln: exported to {out}\nkiln: sample: {text!r}", flush=True)
