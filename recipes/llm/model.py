"""LLM architecture: a Llama-style decoder (torchtitan layout), optionally with Mixture-of-Experts feed-forwards
(Mixtral / Qwen2-MoE / Qwen3-MoE). Its adapter to those transformers models is recipes/llm/hf_adapter.py.

Architecture only: tensor/pipeline/data parallelism, activation checkpointing and compile are
applied to this module from outside (``recipes/llm/parallelize.py``), addressing submodules by
name -- ``layers.<i>.attention.{wq,wk,wv,wo}``, ``layers.<i>.feed_forward.{w1,w2,w3}`` (dense layers) or
``layers.<i>.moe.{router.gate,experts,shared_expert,shared_gate}`` (MoE layers; see :class:`MoE`).

Layout choices that the outside relies on:

* ``layers`` is an ``nn.ModuleDict`` keyed ``"0".."n-1"``: a pipeline stage deletes the layers it
  does not own and every remaining FQN (hence every checkpoint key) is unchanged.
* ``tok_embeddings``, ``norm`` and ``output`` may be set to ``None`` (pipeline stages drop them);
  ``forward`` skips whatever is ``None``.
* Projections reshape with ``-1`` heads, so a column-sharded ``wq/wk/wv`` (each TP rank holding
  ``n_heads/tp`` query and ``n_kv_heads/tp`` key/value heads) runs unchanged.
* The RoPE table is a non-persistent buffer on the root module (not in ``state_dict``); it can
  be built on the meta device and ``init_weights`` recomputes it after ``to_empty``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from common.varlen import varlen_causal_attention
from recipes.llm.context_parallel import ContextParallelMask


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1+'s RoPE frequency scaling (``rope_type: llama3`` in a Hugging Face config.json)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class MoEArgs:
    """Mixture-of-Experts feed-forwards (dropless token-choice top-k routing, softmax router).

    Layer ``i`` is an MoE layer iff ``i >= first_dense_layers`` and ``(i + 1) % interval == 0``: Qwen2/3-MoE's
    ``decoder_sparse_step`` with ``mlp_only_layers = range(first_dense_layers)``; Mixtral: every layer. The
    other layers keep the dense SwiGLU of ``LlamaArgs.ffn_dim``.
    """

    num_experts: int = 8
    top_k: int = 2
    ffn_dim: int = 256  # each routed expert's SwiGLU width (HF moe_intermediate_size; Mixtral's intermediate_size)
    norm_topk_prob: bool = (
        True  # renormalize the top-k probabilities to sum to 1 (Mixtral always; Qwen: norm_topk_prob)
    )
    shared_ffn_dim: int = 0  # 0: no shared expert; else the width of one always-on SwiGLU (Qwen2-MoE's shared expert)
    shared_gate: bool = True  # the shared expert's output scaled by sigmoid(x @ g) per token (Qwen2-MoE)
    first_dense_layers: int = 0
    interval: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"moe top_k ({self.top_k}) must be between 1 and num_experts ({self.num_experts})")
        # torch._grouped_mm needs 16-byte aligned strides (8 elements in bf16): the experts' width.
        if self.ffn_dim <= 0 or self.ffn_dim % 8:
            raise ValueError(f"moe ffn_dim ({self.ffn_dim}) must be a positive multiple of 8 (grouped GEMM alignment)")
        if self.shared_ffn_dim < 0 or self.first_dense_layers < 0 or self.interval < 1:
            raise ValueError("moe shared_ffn_dim and first_dense_layers must be >= 0, interval >= 1")

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_dense_layers and (layer_id + 1) % self.interval == 0


@dataclasses.dataclass
class LlamaArgs:
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 512
    ffn_dim: int = 344  # SwiGLU hidden size, explicit (HF's intermediate_size)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 256  # length of the RoPE table: the longest row the model accepts
    tie_embeddings: bool = False
    # 0: dim // n_heads, filled in here (so dataclasses.replace of dim or n_heads must pass head_dim=0).
    head_dim: int = 0
    rope_scaling: Llama3RopeScaling | None = None  # None: plain RoPE
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on every query and key head, before RoPE
    qkv_bias: bool = False  # Qwen2(-MoE): biases on the q/k/v projections (not on wo)
    moe: MoEArgs | None = None  # None: dense feed-forwards everywhere

    def __post_init__(self) -> None:
        if not self.head_dim:
            if self.dim % self.n_heads:
                raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        for name in ("n_layers", "vocab_size", "ffn_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.moe is not None:
            if self.dim % 8:
                raise ValueError(f"dim ({self.dim}) must be a multiple of 8 with MoE (grouped GEMM alignment)")
            if not any(self.moe.is_moe_layer(i) for i in range(self.n_layers)):
                raise ValueError(
                    f"moe first_dense_layers={self.moe.first_dense_layers} and interval={self.moe.interval} "
                    f"leave no MoE layer among {self.n_layers}"
                )

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(layer_id)


# --------------------------------------------------------------------------------------------
# RoPE
#
# Convention: transformers' Llama ("rotate_half"): the head dim is split in two halves
# [x1 | x2] and pair i is (x1[i], x2[i]) with frequency inv_freq[i]. The original Meta
# checkpoints pair *adjacent* channels (2i, 2i+1) instead, and HF's conversion script permutes
# the rows of q_proj/k_proj to move from one to the other. Using HF's convention here makes a
# Kiln checkpoint and an HF checkpoint the same tensors under different names: the state-dict
# adapter below is a pure rename, with no q/k permutation to get wrong.
# --------------------------------------------------------------------------------------------


def rope_inv_freq(
    head_dim: int, theta: float, device: torch.device | str | None = None, scaling: Llama3RopeScaling | None = None
) -> Tensor:
    """``1 / theta^(2i/d)``, computed exactly as transformers' default RoPE does (fp32 arange). With
    ``scaling``, Llama 3.1's rescaled frequencies, op for op as transformers'
    ``_compute_llama3_parameters`` (same fp32 operations in the same order, hence the same bits)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    if scaling is None:
        return inv_freq
    # Wavelengths below original_len / high_freq_factor keep their frequency, those above
    # original_len / low_freq_factor are slowed down by `factor`, and those between are interpolated.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_table(
    head_dim: int,
    theta: float,
    max_seq_len: int,
    device: torch.device | str | None = None,
    scaling: Llama3RopeScaling | None = None,
) -> Tensor:
    """``[2, max_seq_len, head_dim]`` fp32: cos and sin of every position, halves duplicated (rotate_half).

    ``position * inv_freq`` is the same fp32 product transformers computes per forward, so indexing
    this table with ``position_ids`` gives bit-identical cos/sin.
    """
    inv_freq = rope_inv_freq(head_dim, theta, device, scaling)
    positions = torch.arange(max_seq_len, dtype=torch.float, device=device)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((emb.cos(), emb.sin()))


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[B, S, H, hd]`` by ``cos``/``sin`` broadcastable to it (cast to x's dtype, as HF does)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm with the statistics in fp32 and the weight applied in the input dtype (as HF Llama)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class Segments(NamedTuple):
    """Packed rows as a varlen attention kernel takes them (``PackedBatch.cu_seqlens`` / ``max_seqlen``)."""

    cu_seqlens: Tensor  # int32 [N+1]: boundaries of the N segments (documents, padding tails) over the B*S tokens
    max_seqlen: int  # the longest segment, a Python int (the kernel sizes its grid by it; no device sync)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
    """torch's FlashAttention varlen kernel: causal within each segment, ``[T, H, hd]`` -> ``[T, Hq, hd]`` (GQA:
    common/varlen.py). CUDA only (bf16/fp16)."""
    return varlen_causal_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | Segments | ContextParallelMask | None) -> Tensor:
    """Causal attention of ``[B, S, Hq, hd]`` queries over ``[B, S, Hkv, hd]`` keys/values -> ``[B, S, Hq, hd]``.

    ``ContextParallelMask`` (``parallel.cp``): ``S`` is this rank's share of the row; the cp ranks exchange keys/values
    (``allgather``) or heads (``alltoall``) first, then attend with masked SDPA or the varlen kernel
    (recipes/llm/context_parallel.py).

    ``Segments`` (packed rows on CUDA, ``toggles.attention=flash``): the varlen kernel over the flattened
    tokens, no mask at all. Otherwise SDPA with the dense mask (or plain causal). There key/value head h
    is repeated for query heads h*n_rep.. (HF's repeat_kv): SDPA's CUDA kernels that take a mask do not
    support GQA, and ``enable_gqa`` would fall back to the math kernel.
    """
    bsz, seqlen = q.shape[:2]
    if isinstance(mask, ContextParallelMask):
        return mask.attend(q, k, v)
    if isinstance(mask, Segments):
        out = varlen_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), mask.cu_seqlens, mask.max_seqlen)
        return out.view(bsz, seqlen, *out.shape[1:])
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    n_rep = q.shape[1] // k.shape[1]  # unchanged by TP: q and kv heads shard alike
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None).transpose(1, 2)


class Attention(nn.Module):
    """Grouped-query attention with RoPE on q and k (the kernel: :func:`attend`); optionally Qwen3's per-head
    q/k RMSNorm (``q_norm``/``k_norm``, before RoPE) and Qwen2's q/k/v biases."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # Over head_dim, so per head: unchanged by tensor parallelism's head sharding.
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, attn_mask: Tensor | Segments | ContextParallelMask | None
    ) -> Tensor:
        bsz, seqlen, _ = x.shape
        # [B, S, heads, hd]; -1 heads: the local head count under tensor parallelism.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.wo(attend(q, k, v, attn_mask).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)`` (w1 = HF gate_proj, w3 = up_proj, w2 = down_proj)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# --------------------------------------------------------------------------------------------
# Mixture of Experts (torchtitan's MoE split: router -> token permutation -> grouped experts -> combine)
#
# The steps are separate functions so that expert parallelism can run the experts elsewhere: between
# `permute_tokens` (tokens sorted by expert, `tokens_per_expert` counts) and `GroupedExperts`, an
# all-to-all sends each expert's rows to the rank holding it (the counts become its split sizes) and a
# second one brings the outputs back before `combine_tokens`. Nothing here reads a device value on the
# host: the counts stay tensors (scatter_add, not bincount) and feed the grouped GEMM's offsets directly.
# --------------------------------------------------------------------------------------------


class Routing(NamedTuple):
    """One MoE layer's routing of its ``T`` tokens (all fp32 but the indices)."""

    logits: Tensor  # [T, E] router logits, fp32 (the z-loss's input)
    probs: Tensor  # [T, E] softmax over experts, fp32 (the load-balancing loss's router probabilities)
    weights: Tensor  # [T, k] the chosen experts' combine weights (renormalized if norm_topk_prob)
    experts: Tensor  # [T, k] long, the chosen experts, in decreasing probability


class Router(nn.Module):
    """Token-choice top-k over a softmax of ``gate(x)`` (Mixtral, Qwen-MoE): the logits in the input's
    dtype as transformers computes them, everything after in fp32."""

    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(dim, num_experts, bias=False)

    def forward(self, x: Tensor) -> Routing:
        logits = self.gate(x).float()
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(logits, probs, weights, experts)


def permute_tokens(x: Tensor, experts: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of ``x`` ``[T, D]`` sorted by expert, one row per (token, choice): ``(x_sorted [T*k, D],
    order [T*k], tokens_per_expert [E] long)``. ``order[j]`` is the flat (token * k + choice) index of sorted
    row j; a stable sort keeps each expert's tokens in token order (deterministic)."""
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    tokens_per_expert = torch.zeros(num_experts, dtype=torch.long, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    return x[order // experts.shape[1]], order, tokens_per_expert


def combine_tokens(y_sorted: Tensor, order: Tensor, weights: Tensor) -> Tensor:
    """The inverse of :func:`permute_tokens`: each token's expert outputs weighted and summed -> ``[T, D]``."""
    num_tokens, top_k = weights.shape
    y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted).view(num_tokens, top_k, -1)
    return (y * weights.to(y.dtype).unsqueeze(-1)).sum(dim=1)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLUs as stacked weights (torchtitan's layout; expert e's slice is nn.Linear's
    ``[out, in]``, i.e. Hugging Face's per-expert ``gate_proj``/``down_proj``/``up_proj``), run on rows sorted
    by expert as one grouped GEMM per projection: ``torch._grouped_mm`` with the cumulative row counts as
    int32 offsets (CPU and CUDA alike). Under expert parallelism the first dimension is this rank's experts."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))  # gate_proj
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))  # down_proj
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))  # up_proj

    def forward(self, x: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """``x`` ``[N, D]`` sorted by expert, ``tokens_per_expert`` ``[E]`` summing to N -> ``[N, D]``."""
        offs = tokens_per_expert.cumsum(0, dtype=torch.int32)
        # Under expert parallelism the weights are DTensors split over the experts: this rank's experts. (isinstance,
        # not hasattr: torch.compile traces it.)
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        w1, w2, w3 = (w.to(x.dtype) for w in (w1, w2, w3))  # autocast does not cover _grouped_mm
        h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)


class MoE(nn.Module):
    """Router -> experts (+ an always-on shared expert, optionally sigmoid-gated) for ``[B, S, D]``.

    Dropless: every token reaches its k experts (no capacity factor). After each forward ``self.routing``
    holds this call's :class:`Routing` (the trainer's auxiliary losses read it: :func:`router_sums`).
    """

    def __init__(self, dim: int, moe: MoEArgs):
        super().__init__()
        self.num_experts = moe.num_experts
        self.router = Router(dim, moe.num_experts, moe.top_k, moe.norm_topk_prob)
        self.experts = GroupedExperts(dim, moe.ffn_dim, moe.num_experts)
        self.shared_expert = FeedForward(dim, moe.shared_ffn_dim) if moe.shared_ffn_dim else None
        self.shared_gate = nn.Linear(dim, 1, bias=False) if moe.shared_ffn_dim and moe.shared_gate else None
        self.routing: Routing | None = None

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        routing = self.router(x)
        self.routing = routing
        x_sorted, order, tokens_per_expert = permute_tokens(x, routing.experts, self.num_experts)
        out = combine_tokens(self.experts(x_sorted, tokens_per_expert), order, routing.weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return out.view(shape)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.layer_id = layer_id  # kept for depth-scaled init; survives pipeline deletion of other layers
        self.attention = Attention(args)
        # torchtitan's naming: `feed_forward` (dense) or `moe`, so dense FQNs never change.
        if args.is_moe_layer(layer_id):
            self.moe = MoE(args.dim, args.moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, attn_mask: Tensor | Segments | ContextParallelMask | None = None
    ) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, attn_mask)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    """tok_embeddings -> layers["0".."n-1"] -> norm -> output; any of the three ends may be None."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Built wherever the module is (meta included); recomputed by init_weights after to_empty.
        self.register_buffer("rope_cache", self._rope_table(device=None), persistent=False)

    def _rope_table(self, device: torch.device | str | None) -> Tensor:
        a = self.args
        return rope_table(a.head_dim, a.rope_theta, a.max_seq_len, device=device, scaling=a.rope_scaling)

    # -- init ---------------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialize every parameter (and ``init_buffers``), on whatever device they live.

        Call after ``to_empty`` on a meta-built model (or on a pipeline stage / sharded model:
        each module initializes only what it still holds). torchtitan's scheme: truncated normal
        std 0.02 for the input projections, std ``0.02 / sqrt(2 * (layer_id + 1))`` for the
        projections that write into the residual stream (wo, w2, w3), unit-std embeddings, output
        std ``dim**-0.5``. Tied embeddings get one std-0.02 normal table (HF's init), since a
        unit-std table would also be the output projection.

        ``seed`` seeds a forked RNG (the caller's RNG state is left untouched); ``None`` draws from
        the current global RNG.
        """
        a = self.args
        self.init_buffers()
        with _seeded_rng(seed, self.parameters()):
            if self.tok_embeddings is not None:
                nn.init.normal_(self.tok_embeddings.weight, std=0.02 if a.tie_embeddings else 1.0)
            for block in self.layers.values():
                depth_std = 0.02 / math.sqrt(2 * (block.layer_id + 1))
                attn = block.attention
                # Input projections std 0.02, residual writers depth-scaled (torchtitan; for MoE the
                # router gate and shared gate are input projections, the experts' w2/w3 residual writers).
                inputs, outputs = [attn.wq.weight, attn.wk.weight, attn.wv.weight], [attn.wo.weight]
                moe = getattr(block, "moe", None)
                if moe is None:
                    ffns = [block.feed_forward]
                else:
                    ffns = [moe.experts] if moe.shared_expert is None else [moe.experts, moe.shared_expert]
                for ffn in ffns:
                    w = (
                        (ffn.w1, ffn.w2, ffn.w3)
                        if isinstance(ffn, GroupedExperts)
                        else (ffn.w1.weight, ffn.w2.weight, ffn.w3.weight)
                    )
                    inputs.append(w[0])
                    outputs += w[1:]
                if moe is not None:
                    inputs += [moe.router.gate.weight] + (
                        [moe.shared_gate.weight] if moe.shared_gate is not None else []
                    )
                for w in inputs:
                    nn.init.trunc_normal_(w, mean=0.0, std=0.02)
                for w in outputs:
                    nn.init.trunc_normal_(w, mean=0.0, std=depth_std)
                for lin in (attn.wq, attn.wk, attn.wv):
                    if lin.bias is not None:
                        nn.init.zeros_(lin.bias)
                for norm in (block.attention_norm, block.ffn_norm, attn.q_norm, attn.k_norm):
                    if norm is not None:
                        norm.reset_parameters()
            if self.norm is not None:
                self.norm.reset_parameters()
            if self.output is not None and not a.tie_embeddings:
                std = a.dim**-0.5
                nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """After ``to_empty``: what is not a weight -- the embeddings tied again and the RoPE table.
        Enough before loading weights (a checkpoint, a broadcast); ``init_weights`` starts with it."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            # to_empty (meta -> device) replaces each module's Parameter separately, which unties
            # plain tensors (DTensors are swapped in place and stay tied); tie them again.
            self.output.weight = self.tok_embeddings.weight
        buf = self.rope_cache
        # Computed in fp32 then copied, so a bf16-cast buffer holds the same values HF would cast to.
        self.rope_cache = self._rope_table(device=buf.device).to(buf.dtype)

    # -- forward ------------------------------------------------------------------------------

    def forward(
        self,
        tokens_or_hidden: Tensor,
        position_ids: Tensor | None = None,
        attn_mask: Tensor | Segments | ContextParallelMask | None = None,
    ) -> Tensor:
        """Logits ``[B, S, V]`` if this module has ``output``, else hidden states ``[B, S, D]``.

        tokens_or_hidden: token ids ``[B, S]`` when ``tok_embeddings`` exists (first pipeline stage
            or the whole model), hidden states ``[B, S, D]`` otherwise.
        position_ids: ``[B, S]`` long, RoPE positions; per-document positions for packed rows.
            Default ``arange(S)``.
        attn_mask: ``None`` -> causal. A ``[B, 1, S, S]`` mask for SDPA: bool with True = attend
            (e.g. ``PackedBatch.attention_mask_4d()``, block-diagonal causal), or additive float; it
            replaces causality, so it must be causal itself. Or the same packing as ``Segments``
            (``PackedBatch.cu_seqlens`` / ``max_seqlen``) for the varlen flash kernel (CUDA).
        """
        if self.tok_embeddings is not None:
            if tokens_or_hidden.dim() != 2:
                raise ValueError(f"expected token ids [B, S], got shape {tuple(tokens_or_hidden.shape)}")
            h = self.tok_embeddings(tokens_or_hidden)
        else:
            if tokens_or_hidden.dim() != 3:
                raise ValueError(
                    f"expected hidden states [B, S, D] (no tok_embeddings), got shape {tuple(tokens_or_hidden.shape)}"
                )
            h = tokens_or_hidden
        # From the input, not h: under sequence parallelism the embedding output may be a
        # sequence shard, while token ids (and the RoPE positions) cover the whole row.
        seqlen = tokens_or_hidden.shape[1]
        if seqlen > self.args.max_seq_len:
            # Positions never exceed the row length, so this bounds the table lookup without a
            # device sync on position_ids.max().
            raise ValueError(f"sequence length {seqlen} exceeds max_seq_len {self.args.max_seq_len}")
        if position_ids is None:
            cos, sin = self.rope_cache[:, :seqlen].unsqueeze(-2)  # [S, 1, hd] each: broadcast over batch and heads
        else:
            cos, sin = self.rope_cache[:, position_ids].unsqueeze(-2)  # [B, S, 1, hd] each
        for layer in self.layers.values():
            h = layer(h, cos, sin, attn_mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


@contextlib.contextmanager
def _seeded_rng(seed: int | None, params: Iterator[nn.Parameter]) -> Iterator[None]:
    if seed is None:
        yield
        return
    cuda = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        yield
