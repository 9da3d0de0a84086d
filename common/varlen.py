"""torch's own FlashAttention varlen kernel (`torch.nn.attention.varlen.varlen_attn`, CUDA, bf16/fp16), causal within
each packed segment: the one call behind `toggles.attention=flash` in the LLM and the VLM's language model."""

from __future__ import annotations

import functools
import inspect

import torch


@functools.cache
def _kernel():
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float | None = None,
) -> torch.Tensor:
    """``[T, Hq, hd]`` queries over ``[T, Hkv, hd]`` keys/values -> ``[T, Hq, hd]``; ``cu_*`` are the int32 segment
    boundaries, ``max_*`` the longest segment (a Python int: no device sync). With grouped-query attention the kernel
    shares each key/value head among its query heads where torch's kernel takes ``enable_gqa`` (torch 2.13); an older
    torch's kernel (2.11 has none) gets key/value head h repeated for query heads h*n_rep.. (transformers' repeat_kv),
    which computes the same attention."""
    varlen_attn, has_gqa = _kernel()
    gqa = {}
    if q.shape[1] != k.shape[1]:
        if has_gqa:
            gqa["enable_gqa"] = True
        else:
            n_rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0), **gqa)
