"""The Llama a run builds from its config (`llama_args`: the trainer, the export and the benchmarks build it from
there) and the Llama in the memory model (common/memory.py) for scripts/plan.py and run.dry_run. Imports the model,
never the trainer."""

from __future__ import annotations

import functools

import torch

from common import lora
from common.config import TrainConfig
from common.memory import Block, ModelSpec, count_params, nf4_bytes, preference_reference
from recipes.llm.model import Llama3RopeScaling, LlamaArgs, MoE, MoEArgs, Transformer


def llama_args(cfg: TrainConfig, vocab_size: int) -> LlamaArgs:
    """The model of cfg.model (with model.init_from, the checkpoint's: recipes/llm/config.py:complete)."""
    m = cfg.model
    r = m.rope_scaling
    scaling = (
        None
        if r.rope_type == "default"
        else Llama3RopeScaling(
            factor=r.factor,
            low_freq_factor=r.low_freq_factor,
            high_freq_factor=r.high_freq_factor,
            original_max_position_embeddings=r.original_max_position_embeddings,
        )
    )
    e = m.moe
    moe = (
        None
        if not e.num_experts
        else MoEArgs(
            num_experts=e.num_experts,
            top_k=e.top_k,
            ffn_dim=e.ffn_dim,
            norm_topk_prob=e.norm_topk_prob,
            shared_ffn_dim=e.shared_ffn_dim,
            shared_gate=e.shared_gate,
            first_dense_layers=e.first_dense_layers,
            interval=e.interval,
        )
    )
    return LlamaArgs(
        dim=m.dim,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads,
        vocab_size=m.vocab_size or vocab_size,
        ffn_dim=m.ffn_dim,
        norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        max_seq_len=m.max_seq_len,
        tie_embeddings=m.tie_embeddings,
        head_dim=m.head_dim,
        rope_scaling=scaling,
        qk_norm=m.qk_norm,
        qkv_bias=m.qkv_bias,
        moe=moe,
    )


def llama_block(args: LlamaArgs, cfg: TrainConfig) -> Block:
    """One layer of the Llama for the memory model: its widths, its attention and what it keeps for backward."""
    # sdpa: the packed documents' [b,1,s,s] bool mask (kept as a bias per layer) and K/V repeated per query
    # head; flash: the varlen kernel takes cu_seqlens and shares K/V heads. DTensor TP keeps the gathered
    # linear inputs.
    varlen = cfg.toggles.attention == "flash"
    # MoE: a token's activations are those of its top_k experts (and the shared one): the active width.
    moe = args.moe
    ffn = moe.top_k * moe.ffn_dim + moe.shared_ffn_dim if moe else args.ffn_dim
    return Block(
        hidden=args.dim,
        heads=args.n_heads,
        ffn=ffn,
        kv_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        norm="rmsnorm",
        mlp="swiglu",
        dropout=False,
        attention="fused",
        repeat_kv=not varlen,
        dense_mask=not varlen,
        cp_varlen=varlen,  # under parallel.cp: VarlenSegments (recipes/llm/context_parallel.py), no mask rows
        megatron_sp=False,
        selective="save_matmuls",
        # Qwen3's RMSNorm per head on q and k (model.qk_norm); Kiln's RMSNorm, like transformers', keeps the fp32 copy.
        qk_norm=args.qk_norm,
        qk_norm_keeps_input=False,
    )


def memory_spec(cfg: TrainConfig) -> ModelSpec:
    """The Llama for the memory model (common/memory.py): built on the meta device, counted. Without
    model.vocab_size the vocabulary is assumed (the tokenizer is not read)."""
    args = llama_args(cfg, vocab_size=cfg.model.vocab_size or 2048)
    with torch.device("meta"):
        model = Transformer(args)

    # MoE: layers differ (dense first layers); the mean layer, counting every expert (total, not active, parameters).
    # Tied embeddings are counted once (on the first stage); under PP the last stage holds a second copy.
    def sizes(count) -> tuple[int, int, int]:  # (mean layer, first stage's rest, last stage's rest)
        return (
            sum(map(count, model.layers.values())) // args.n_layers,
            count(model.tok_embeddings),
            count(model.norm) + (0 if args.tie_embeddings else count(model.output)),
        )

    layer, first, last = sizes(count_params)
    gather_unit = max(layer, first + last)  # FSDP units: blocks, root
    # preference.loss's live reference, as recipes/llm/preference.py builds it: a copy built and sharded as the policy
    # (build_model), its parameters in fp32 whatever toggles.precision, as the policy's.
    reference_copy, note = preference_reference(cfg, count_params(model), "in fp32 sharded as the policy")
    # finetune=lora: the adapters train (weights, gradients, Adam state); the base is frozen weights only, in the
    # parameters' dtype (fp32 whatever toggles.precision: FSDP2's policy and autocast cast them per use).
    if cfg.finetune == "lora":
        lora.apply_lora(model, cfg.lora)
        layer, first, last = sizes(functools.partial(count_params, trainable_only=True))
    frozen = count_params(model) - count_params(model, trainable_only=True)
    frozen_bytes = 4.0 * frozen
    if cfg.finetune == "lora" and cfg.lora.quantize_base == "nf4":  # QLoRA: the adapted linears' base in NF4
        quantized = [m.base_layer.weight.numel() for m in model.modules() if hasattr(m, "lora_A")]
        frozen_bytes += sum(nf4_bytes(n) - 4.0 * n for n in quantized)
    moe = args.moe
    experts = max((count_params(m.experts) for m in model.modules() if isinstance(m, MoE)), default=0)
    block = llama_block(args, cfg)
    p = cfg.parallel
    return ModelSpec(
        cfg.recipe.name,
        block,
        layers=args.n_layers,
        seq=cfg.data.max_seq_len,
        micro_batch=cfg.trainer.micro_batch_size,
        layer_params=layer,
        first_params=first,
        last_params=last,
        gather_unit_params=gather_unit,
        frozen_params=frozen,
        frozen_bytes=frozen_bytes,
        vocab=args.vocab_size,
        precision=cfg.toggles.precision,
        sharding="fsdp",
        ac_modes=("none", "selective", "full"),
        pp_schedule=p.pp_schedule,
        pp_microbatches=p.pp_microbatches,
        vocab_parallel=cfg.model.loss_parallel,
        context_parallel=True,
        cp_method=p.cp_method,
        expert_params=experts,
        experts=moe.num_experts if moe else 0,
        top_k=moe.top_k if moe else 0,
        reference_copy=reference_copy,
        note=note,
    )
