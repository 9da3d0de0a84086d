"""The language model's attention kernels: `toggles.attention` → transformers' attn_implementation, torch's own
varlen FlashAttention kernel as a transformers attention function (no flash-attn package), and SDPA for
generation and padded evaluation. A leaf: it imports nothing from recipes/vlm."""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface, LlavaForConditionalGeneration

from common.varlen import varlen_causal_attention  # torch's own FlashAttention varlen kernel; CUDA only

# toggles.attention -> the language model's attention implementation. `flash` is torch's own varlen
# FlashAttention kernel, registered with transformers by register_varlen_attention (no flash-attn package).
# The vision tower runs SDPA under sdpa and flash (its images are neither packed nor padded).
VARLEN_ATTENTION = "kiln_varlen"  # no "flash" in the name: transformers would look for a flash-attn kernel
TEXT_ATTENTION = {"sdpa": "sdpa", "eager": "eager", "flash": VARLEN_ATTENTION}


def attn_implementation(attention: str) -> dict[str, str]:
    """transformers' per-sub-config attn_implementation for `toggles.attention`."""
    vision = "eager" if attention == "eager" else "sdpa"
    return {"text_config": TEXT_ATTENTION[attention], "vision_config": vision, "": vision}


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (AttentionInterface) over packed rows: torch's varlen flash kernel.

    The packed batch arrives as one flattened row (`PackedBatch.model_inputs("flash")`): q/k/v are
    [1, heads, R*L, head_dim] and `cu_seq_lens_{q,k}` / `max_length_{q,k}` are the segment boundaries
    that build the CPU path's block-diagonal mask (common/data/packing.py). The kernel takes
    [tokens, heads, head_dim], shares K/V heads across query groups (GQA: common/varlen.py) and is
    causal within each segment with window (-1, 0). Returns [1, R*L, heads, head_dim] as transformers expects.
    """
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is None or attention_mask is not None or query.shape[0] != 1 or not getattr(module, "is_causal", True):
        raise ValueError(
            "the varlen flash attention takes packed rows only: one flattened row with cu_seq_lens_q/k "
            "and no attention mask (PackedBatch.model_inputs('flash'))"
        )
    if dropout:
        raise ValueError("the varlen flash attention has no dropout")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, head_dim]
    out = varlen_causal_attention(
        q, k, v, cu_q, kwargs["cu_seq_lens_k"], kwargs["max_length_q"], kwargs["max_length_k"], scale=scaling
    )
    return out.unsqueeze(0), None


def register_varlen_attention() -> None:
    """Make `toggles.attention=flash` (VARLEN_ATTENTION) a transformers attention implementation. It has
    no mask function on purpose: transformers then builds no mask at all, the point of varlen."""
    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)


@contextlib.contextmanager
def eval_attention(model: LlavaForConditionalGeneration, attention: str):
    """Generation and padded evaluation batches under SDPA: the varlen kernel takes packed rows only. Training
    resumes with the implementation the model had, which under parallel.cp is the varlen kernel wrapped in Ulysses'
    all-to-all (recipes/vlm/context_parallel.py), not the bare one."""
    if attention != "flash":
        yield
        return
    training = model.config.text_config._attn_implementation
    model.set_attn_implementation({"text_config": "sdpa"})
    try:
        yield
    finally:
        model.set_attn_implementation({"text_config": training})
