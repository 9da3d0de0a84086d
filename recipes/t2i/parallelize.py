"""Apply LoRA, context parallelism and the toggles to an SD3 or Flux transformer, in the fixed order: LoRA → the
sequence split (parallel.cp, SD3 only) → fp8 → AC → compile (ZeRO comes last, when common/engine.py:DeepSpeedEngine
wraps the model). Attention is diffusers' own joint attention (SDPA), or under parallel.cp the same projections
around DeepSpeed's Ulysses all-to-all (common/ulysses.py; SD3's joint attention: ulysses_joint_kernel below)."""

from __future__ import annotations

import torch
import torch.distributed as tdist
from diffusers.models.attention_processor import Attention

from common.config import TrainConfig
from common.lora import apply_lora
from common.parallel_dims import CPGroups
from common.toggles import apply_toggles
from common.ulysses import Kernel, gather_tokens, sdpa_kernel, shard_tokens, ulysses_kernel


def ulysses_joint_kernel(kernel: Kernel, group):
    """Joint attention (SD3's: the image tokens and the prompt's text tokens in one softmax) under the split: this
    rank's (B, S/cp, H, D) image q, k, v and the whole (B, T, H, D) text q, k, v (the text stream is short and is
    computed whole on every cp rank) -> (this rank's image output (B, S/cp, H, D), the whole text output (B, T, H, D)).

    The image tokens go through DistributedAttention's all-to-all; inside it, with heads/cp heads of every image
    token, the rank appends the same heads of the text tokens (the all-to-all hands rank r the r-th block of heads)
    and runs `kernel` on the joint sequence (key order does not matter without a mask). The text output's heads are
    all-gathered; its backward sums the ranks' gradients (each rank's text stream carries the gradient of its own
    heads and image tokens only, like its weights), which DeepSpeed's sum over cp then completes."""
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention
    from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor

    deepspeed.init_distributed(dist_backend=tdist.get_backend(), verbose=False)
    cp, rank = tdist.get_world_size(group), tdist.get_rank(group)

    def attend(q, k, v, q_text, k_text, v_text):
        h = q_text.shape[2] // cp
        mine = [t[:, :, rank * h : (rank + 1) * h] for t in (q_text, k_text, v_text)]
        text_out = []

        def joint(qi: torch.Tensor, ki: torch.Tensor, vi: torch.Tensor) -> torch.Tensor:
            n = qi.shape[1]
            out = kernel(*(torch.cat([a, b], dim=1) for a, b in zip((qi, ki, vi), mine, strict=True)))
            text_out.append(out[:, n:])
            return out[:, :n]

        image = DistributedAttention(joint, group, scatter_idx=2, gather_idx=1)(q, k, v, batch_dim_idx=0)
        heads_first = text_out[0].permute(2, 0, 1, 3).contiguous()  # (H/cp, B, T, D): gathered rank after rank
        text = wait_tensor(all_gather_single_autograd(heads_first, 0, group)).permute(1, 2, 0, 3)
        return image, text

    return attend


class UlyssesJointAttnProcessor:
    """diffusers' JointAttnProcessor2_0 (SD3's joint attention over image + text tokens, and SD3.5's image-only
    `attn2`) with this rank's share of the image tokens: the same projections and q/k norms, the attention through
    DeepSpeed's all-to-all (ulysses_joint_kernel above; common/ulysses.py: ulysses_kernel). The text tokens stay
    whole on every cp rank. Tests check it against JointAttnProcessor2_0 on the unsplit model."""

    def __init__(self, cp: CPGroups):
        self.joint = ulysses_joint_kernel(sdpa_kernel, cp.cp_group)
        self.image = ulysses_kernel(sdpa_kernel, cp.cp_group)

    def __call__(self, attn: Attention, hidden_states, encoder_hidden_states=None, attention_mask=None, *_, **__):
        if attention_mask is not None:
            raise ValueError("UlyssesJointAttnProcessor handles attention without a mask only")
        b = hidden_states.shape[0]

        def heads(x: torch.Tensor) -> torch.Tensor:  # (B, S, H * D) -> (B, S, H, D)
            return x.view(b, x.shape[1], attn.heads, -1)

        q, k, v = (heads(proj(hidden_states)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:  # per head, over D: the same in this layout as in diffusers' (B, H, S, D)
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        text = None
        if encoder_hidden_states is None:
            out = self.image(q, k, v)
        else:
            projections = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            q_text, k_text, v_text = (heads(proj(encoder_hidden_states)) for proj in projections)
            if attn.norm_added_q is not None:
                q_text = attn.norm_added_q(q_text)
            if attn.norm_added_k is not None:
                k_text = attn.norm_added_k(k_text)
            out, text = self.joint(q, k, v, q_text, k_text, v_text)
            text = text.reshape(b, text.shape[1], -1).to(q.dtype)
            if not attn.context_pre_only:
                text = attn.to_add_out(text)
        out = out.reshape(b, out.shape[1], -1).to(q.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        return out if text is None else (out, text)


def split_sequence(model, cp: CPGroups) -> None:
    """SD3's image tokens split over the cp ranks from the patch embedding to the output projection, gathered whole
    again before diffusers unpatchifies them; every Attention module's processor exchanges heads for tokens."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.set_processor(UlyssesJointAttnProcessor(cp))
    model.pos_embed.register_forward_hook(lambda _m, _args, out: shard_tokens(out, cp.cp, cp.cp_rank))
    model.proj_out.register_forward_hook(lambda _m, _args, out: gather_tokens(out, cp.cp_group))


def parallelize(model, cfg: TrainConfig, cp: CPGroups | None = None):
    """`model` with its adapters (finetune=lora: the joint attention's linears, the rest frozen), its image tokens split
    over `cp` (parallel.cp > 1: SD3; recipes/t2i/config.py refuses Flux), activation checkpointing (per transformer
    block: SD3's JointTransformerBlock; Flux's double- and single-stream blocks) and the toggles applied, ready for the
    engine (DeepSpeed ZeRO over what trains: every weight in a full fine-tune, over dp x cp ranks)."""
    if cfg.finetune == "lora":
        apply_lora(model, cfg.lora)
    if cp is not None:
        split_sequence(model, cp)
    blocks = [*model.transformer_blocks, *getattr(model, "single_transformer_blocks", ())]
    apply_toggles(model, cfg.toggles, block_types=tuple({type(b) for b in blocks}), recompute_widening=True)
    return model
