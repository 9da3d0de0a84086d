"""Freeze per training stage, the attention kernels, then the toggles: kernels → fp8 → AC → compile (ZeRO comes
last, when common/engine.py:DeepSpeedEngine wraps the model)."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention.varlen import varlen_attn  # torch's own FlashAttention varlen kernel; CUDA only
from transformers import LlavaForConditionalGeneration
from transformers.modeling_layers import GradientCheckpointingLayer

from common.config import TrainConfig
from common.toggles import apply_toggles
from recipes.vlm.model import VARLEN_ATTENTION, attn_implementation


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function (AttentionInterface) over packed rows: torch's varlen flash kernel.

    The packed batch arrives as one flattened row (`PackedBatch.model_inputs("flash")`): q/k/v are
    [1, heads, R*L, head_dim] and `cu_seq_lens_{q,k}` / `max_length_{q,k}` are the segment boundaries
    that build the CPU path's block-diagonal mask (common/data/packing.py). The kernel takes
    [tokens, heads, head_dim], shares K/V heads across query groups itself (GQA, no repeat) and is
    causal within each segment with window (-1, 0). Returns [1, R*L, heads, head_dim] as transformers expects.
    """
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is None or attention_mask is not None or query.shape[0] != 1 or not getattr(module, "is_causal", True):
        raise ValueError("the varlen flash attention takes packed rows only: one flattened row with cu_seq_lens_q/k "
                         "and no attention mask (PackedBatch.model_inputs('flash'))")
    if dropout:
        raise ValueError("the varlen flash attention has no dropout")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, head_dim]
    out = varlen_attn(q, k, v, cu_q, kwargs["cu_seq_lens_k"], kwargs["max_length_q"], kwargs["max_length_k"],
                      scale=scaling, window_size=(-1, 0), enable_gqa=q.shape[1] != k.shape[1])
    return out.unsqueeze(0), None


def register_varlen_attention() -> None:
    """Make `toggles.attention=flash` (VARLEN_ATTENTION) a transformers attention implementation. It has
    no mask function on purpose: transformers then builds no mask at all, the point of varlen."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)


@contextlib.contextmanager
def eval_attention(model: LlavaForConditionalGeneration, attention: str):
    """Generation and padded evaluation batches under SDPA: the varlen kernel takes packed rows only."""
    if attention != "flash":
        yield
        return
    model.set_attn_implementation({"text_config": "sdpa"})
    try:
        yield
    finally:
        model.set_attn_implementation({"text_config": attn_implementation(attention)["text_config"]})


def unused_tower_modules(model: LlavaForConditionalGeneration) -> list[torch.nn.Module]:
    """Tower modules LLaVA's features never reach: the encoder layers after `vision_feature_layer` and
    the post-encoder norm/head (features are hidden states). Frozen even under `vlm.train_vision`: they
    would get no gradient, which ZeRO's gradient buckets do not expect."""
    tower, layer = model.model.vision_tower, model.config.vision_feature_layer
    deepest = max(layer) if isinstance(layer, (list, tuple)) else layer
    layers = tower.encoder.layers
    used = len(layers) + 1 + deepest if deepest < 0 else deepest  # hidden_states[i] = output of i layers
    tail = [getattr(tower, name, None) for name in ("post_layernorm", "head")]
    return list(layers[used:]) + [m for m in tail if m is not None]


def freeze_for_stage(model: LlavaForConditionalGeneration, stage: str, train_vision: bool = False) -> None:
    """align: only the projector learns (LLaVA stage 1). finetune: projector + language model (LLaVA
    stage 2), plus the vision tower with `vlm.train_vision`. Frozen = requires_grad False, so it never
    reaches the optimizer (common/deepspeed.py passes only trainable parameters)."""
    model.requires_grad_(False)
    model.model.multi_modal_projector.requires_grad_(True)
    if stage == "finetune":
        model.model.language_model.requires_grad_(True)
        model.lm_head.requires_grad_(True)
        if train_vision:
            model.model.vision_tower.requires_grad_(True)
            for module in unused_tower_modules(model):
                module.requires_grad_(False)


def parallelize(model: LlavaForConditionalGeneration, cfg: TrainConfig) -> LlavaForConditionalGeneration:
    """`model` frozen for its stage, with its toggles applied, ready for the engine (DeepSpeed ZeRO over the
    trainable parameters; the attention kernel was chosen when the model was built: `toggles.attention`
    → attn_implementation)."""
    freeze_for_stage(model, cfg.vlm.stage, cfg.vlm.train_vision)
    # Blocks: every decoder and vision encoder layer (the layers transformers itself checkpoints);
    # fp8 only in the language model (the tower's widths are often not multiples of 16).
    apply_toggles(model, cfg.toggles, block_types=(GradientCheckpointingLayer,), fp8_module=model.model.language_model)
    return model
