"""LLM architecture: a Llama-style decoder (torchtitan layout) and its adapter to transformers' LlamaForCausalLM.

Architecture only: tensor/pipeline/data parallelism, activation checkpointing and compile are
applied to this module from outside (``recipes/llm/parallelize.py``), addressing submodules by
name -- ``layers.<i>.attention.{wq,wk,wv,wo}``, ``layers.<i>.feed_forward.{w1,w2,w3}``.

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
import re
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1+'s RoPE frequency scaling (``rope_type: llama3`` in a Hugging Face config.json)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None,
                  scaling: Llama3RopeScaling | None = None) -> Tensor:
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


def rope_table(head_dim: int, theta: float, max_seq_len: int, device: torch.device | str | None = None,
               scaling: Llama3RopeScaling | None = None) -> Tensor:
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
    """torch's FlashAttention varlen kernel: causal within each segment, ``[T, H, hd]`` -> ``[T, Hq, hd]``,
    with the kernel sharing each key/value head among its query heads (GQA). CUDA only (bf16/fp16)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, window_size=(-1, 0), enable_gqa=True)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | Segments | None) -> Tensor:
    """Causal attention of ``[B, S, Hq, hd]`` queries over ``[B, S, Hkv, hd]`` keys/values -> ``[B, S, Hq, hd]``.

    ``Segments`` (packed rows on CUDA, ``toggles.attention=flash``): the varlen kernel over the flattened
    tokens, no mask at all. Otherwise SDPA with the dense mask (or plain causal). There key/value head h
    is repeated for query heads h*n_rep.. (HF's repeat_kv): SDPA's CUDA kernels that take a mask do not
    support GQA, and ``enable_gqa`` would fall back to the math kernel.
    """
    bsz, seqlen = q.shape[:2]
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
    """Grouped-query attention with RoPE on q and k (the kernel: :func:`attend`)."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn_mask: Tensor | Segments | None) -> Tensor:
        bsz, seqlen, _ = x.shape
        # [B, S, heads, hd]; -1 heads: the local head count under tensor parallelism.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
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


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.layer_id = layer_id  # kept for depth-scaled init; survives pipeline deletion of other layers
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn_mask: Tensor | Segments | None = None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, attn_mask)
        return h + self.feed_forward(self.ffn_norm(h))


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
                attn, ffn = block.attention, block.feed_forward
                for lin in (attn.wq, attn.wk, attn.wv, ffn.w1):
                    nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
                for lin in (attn.wo, ffn.w2, ffn.w3):
                    nn.init.trunc_normal_(lin.weight, mean=0.0, std=depth_std)
                block.attention_norm.reset_parameters()
                block.ffn_norm.reset_parameters()
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

    def forward(self, tokens_or_hidden: Tensor, position_ids: Tensor | None = None,
                attn_mask: Tensor | Segments | None = None) -> Tensor:
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
                raise ValueError(f"expected hidden states [B, S, D] (no tok_embeddings), got shape "
                                 f"{tuple(tokens_or_hidden.shape)}")
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


# --------------------------------------------------------------------------------------------
# transformers adapter (torchtitan's StateDictAdapter): the one place Kiln names meet Hugging Face
# names, used by loading (model.init_from, tests) and by every export.
#
# A pure rename in both directions (see the RoPE convention note above): the tensors are shared,
# not copied. Keys are plain module FQNs (what get_model_state_dict / DCP produce); pipeline
# stages may pass partial dicts, and each key is renamed on its own. Tied embeddings have ONE
# tensor in Hugging Face format, model.embed_tokens.weight (save_pretrained writes no lm_head.weight
# for them): Kiln's output.weight maps onto it, which is what the last pipeline stage, holding the
# output projection without the embedding, loads and exports.
# --------------------------------------------------------------------------------------------

_LAYER_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_KEYS_INV = {v: k for k, v in _LAYER_KEYS.items()}
_TOP_KEYS_INV = {v: k for k, v in _TOP_KEYS.items()}
_KILN_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def to_hf_config(args: LlamaArgs, **token_ids: int | list[int] | None):
    """The ``transformers.LlamaConfig`` of the same architecture.

    ``token_ids``: ``bos_token_id``, ``eos_token_id``, ``pad_token_id`` (any ``*_token_id``). Those
    not given are None rather than LlamaConfig's defaults (1 and 2), which would silently belong
    to some other tokenizer.
    """
    from transformers import LlamaConfig  # imported here: the model itself needs only torch

    bad = [k for k in token_ids if not k.endswith("_token_id")]
    if bad:
        raise TypeError(f"to_hf_config takes only *_token_id keyword arguments, got {bad}")
    ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **token_ids}
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        rope.update(rope_type="llama3", **dataclasses.asdict(args.rope_scaling))
    return LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        hidden_act="silu",
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=args.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        **ids,
    )


def to_hf_state_dict(sd: dict[str, Tensor], args: LlamaArgs) -> dict[str, Tensor]:
    """Kiln ``Transformer`` keys -> ``LlamaForCausalLM`` keys (same tensors). Unknown keys raise.

    Tied: ``output.weight`` becomes ``model.embed_tokens.weight`` when the dict has no embedding
    (a last pipeline stage), and is dropped when it has (the same tensor): no ``lm_head.weight``.
    """
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        if key == "output.weight" and args.tie_embeddings:
            if "tok_embeddings.weight" not in sd:
                out["model.embed_tokens.weight"] = t
            continue
        if key in _TOP_KEYS:
            out[_TOP_KEYS[key]] = t
            continue
        m = _KILN_LAYER.fullmatch(key)
        if m is None or m.group(2) not in _LAYER_KEYS or int(m.group(1)) >= args.n_layers:
            raise KeyError(f"not a Kiln Llama state-dict key for {args.n_layers} layers: {key!r}")
        out[f"model.layers.{m.group(1)}.{_LAYER_KEYS[m.group(2)]}"] = t
    return out


def from_hf_state_dict(sd: dict[str, Tensor], args: LlamaArgs) -> dict[str, Tensor]:
    """``LlamaForCausalLM`` keys -> Kiln ``Transformer`` keys (same tensors). Unknown keys raise.

    ``rotary_emb.inv_freq`` entries (older checkpoints saved them) are recomputed here, so dropped.
    Tied: ``output.weight`` is the embedding (an ``lm_head.weight`` some exports still carry is
    ignored, as transformers ignores it).
    """
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        if key.endswith("rotary_emb.inv_freq") or (key == "lm_head.weight" and args.tie_embeddings):
            continue
        if key in _TOP_KEYS_INV:
            out[_TOP_KEYS_INV[key]] = t
            continue
        m = _HF_LAYER.fullmatch(key)
        if m is None or m.group(2) not in _LAYER_KEYS_INV or int(m.group(1)) >= args.n_layers:
            raise KeyError(f"not a LlamaForCausalLM state-dict key for {args.n_layers} layers: {key!r}")
        out[f"layers.{m.group(1)}.{_LAYER_KEYS_INV[m.group(2)]}"] = t
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out
