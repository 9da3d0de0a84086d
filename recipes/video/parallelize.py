"""Apply LoRA, context parallelism and the toggles to a Wan transformer, in the fixed order: LoRA → the sequence split
(parallel.cp) → fp8 → AC → compile (ZeRO comes last, when common/engine.py:DeepSpeedEngine wraps the model).

Under parallel.cp each rank holds a contiguous 1/cp of a clip's video tokens from the first block to the output
projection (where diffusers' own context-parallel plan for Wan splits them too: the RoPE table and blocks.0's input
split, proj_out's output gathered): the self-attention exchanges heads for tokens through DeepSpeed's all-to-all
(common/ulysses.py) around diffusers' projections, norms and rotary embedding; the cross-attention needs nothing (each
rank's video queries read the whole prompt); everything else in a block works token by token."""

from __future__ import annotations

import torch

from common.config import TrainConfig
from common.lora import apply_lora
from common.parallel_dims import CPGroups
from common.toggles import apply_toggles
from common.ulysses import gather_tokens, sdpa_kernel, shard_tokens, ulysses_kernel


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding of (B, S, H, D) queries or keys (diffusers' WanAttnProcessor's, on pairs of features)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class UlyssesWanSelfAttention:
    """diffusers' WanAttnProcessor for a block's self-attention (attn1) on this rank's share of the video tokens: the
    same projections, q/k RMSNorm (per token) and rotary embedding (its table split like the tokens), the attention
    through the all-to-all. Tests check it against the unsplit model."""

    def __init__(self, cp: CPGroups):
        self.attend = ulysses_kernel(sdpa_kernel, cp.cp_group)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("UlyssesWanSelfAttention is a block's self-attention without a mask")
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = rotary(q, *rotary_emb), rotary(k, *rotary_emb)
        out = self.attend(q, k, v).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def split_sequence(model, cp: CPGroups) -> None:
    """A clip's video tokens split over the cp ranks from blocks.0 to proj_out (gathered whole again before diffusers
    unpatchifies them); the RoPE table split alike; every block's self-attention exchanges heads for tokens."""
    for block in model.blocks:
        block.attn1.set_processor(UlyssesWanSelfAttention(cp))

    def split_rope(_module, _args, out):
        return tuple(shard_tokens(t, cp.cp, cp.cp_rank) for t in out)

    def split_input(_module, args):
        return (shard_tokens(args[0], cp.cp, cp.cp_rank), *args[1:])

    model.rope.register_forward_hook(split_rope)
    model.blocks[0].register_forward_pre_hook(split_input)
    model.proj_out.register_forward_hook(lambda _m, _args, out: gather_tokens(out, cp.cp_group))


def parallelize(model, cfg: TrainConfig, cp: CPGroups | None = None):
    """`model` with its adapters (finetune=lora: the attention's linears, the rest frozen), its video tokens split over
    `cp` (parallel.cp > 1), activation checkpointing per WanTransformerBlock and the toggles applied, ready for the
    engine (DeepSpeed ZeRO over what trains: every weight in a full fine-tune, over dp x cp ranks)."""
    if cfg.finetune == "lora":
        apply_lora(model, cfg.lora)
    if cp is not None:
        split_sequence(model, cp)
    apply_toggles(model, cfg.toggles, block_types=(type(model.blocks[0]),), recompute_widening=True)
    return model
