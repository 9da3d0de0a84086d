"""The LLM's state-dict adapter to transformers (torchtitan's StateDictAdapter): Kiln names <-> Hugging Face names."""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import Tensor

from recipes.llm.model import LlamaArgs

# --------------------------------------------------------------------------------------------
# transformers adapter (torchtitan's StateDictAdapter): the one place Kiln names meet Hugging Face
# names, used by loading (model.init_from, tests) and by every export.
#
# The architecture picks the transformers model (hf_model_type): Llama, Qwen3 (q/k norm), Mixtral,
# Qwen3-MoE or Qwen2-MoE (shared expert). Dense weights are a pure rename in both directions (see the
# RoPE convention note in recipes/llm/model.py): the tensors are shared, not copied. Experts are stacked
# [E, out, in] in Kiln and one tensor per expert in the safetensors that save_pretrained writes (and released
# checkpoints hold; transformers 5 fuses them only in memory): to_hf_state_dict gives each expert's slice as a view
# of the stacked weight (so loading writes straight into it), from_hf_state_dict stacks them (a copy).
# Keys are plain module FQNs (what get_model_state_dict / DCP produce); pipeline stages may pass partial
# dicts, and each key is renamed on its own. Tied embeddings have ONE tensor in Hugging Face format,
# model.embed_tokens.weight (save_pretrained writes no lm_head.weight for them): Kiln's output.weight
# maps onto it, which is what the last pipeline stage, holding the output projection without the
# embedding, loads and exports.
# --------------------------------------------------------------------------------------------

HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
_ATTENTION_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_QKV_BIAS_KEYS = {f"attention.w{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"}
_QK_NORM_KEYS = {f"attention.{x}_norm.weight": f"self_attn.{x}_norm.weight" for x in "qk"}
_SWIGLU = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_DENSE_KEYS = {f"feed_forward.{w}.weight": f"mlp.{hf}.weight" for w, hf in _SWIGLU.items()}
_SHARED_KEYS = {f"moe.shared_expert.{w}.weight": f"mlp.shared_expert.{hf}.weight" for w, hf in _SWIGLU.items()}
_TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_TOP_KEYS_INV = {v: k for k, v in _TOP_KEYS.items()}
_KILN_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_KILN_EXPERTS = re.compile(r"moe\.experts\.(w[123])")
# Per-expert names on disk: Mixtral keeps its original checkpoint names, the Qwen MoEs nn.Linear-style ones.
_HF_EXPERTS = {
    "mixtral": re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight"),
    "qwen": re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.weight"),
}


def hf_model_type(args: LlamaArgs) -> str:
    """The transformers ``model_type`` that has exactly this architecture; ValueError naming what has none."""
    moe = args.moe
    if moe is None:
        if args.qkv_bias:
            raise ValueError("q/k/v biases without MoE (Qwen2) are not supported")
        return "qwen3" if args.qk_norm else "llama"
    if moe.shared_ffn_dim:
        if not moe.shared_gate or args.qk_norm:
            raise ValueError(
                "a shared expert is Qwen2-MoE's: with its sigmoid gate (moe.shared_gate) and without qk_norm"
            )
        return "qwen2_moe"
    if args.qkv_bias:
        raise ValueError("q/k/v biases are Qwen2-MoE's: they need its shared expert (moe.shared_ffn_dim)")
    if args.qk_norm:
        return "qwen3_moe"
    if moe.norm_topk_prob and moe.first_dense_layers == 0 and moe.interval == 1:
        return "mixtral"
    raise ValueError(
        "an MoE without qk_norm or a shared expert is Mixtral's, which renormalizes the top-k "
        "probabilities (moe.norm_topk_prob) and has no dense layers (moe.first_dense_layers=0, moe.interval=1)"
    )


def _layer_keys(args: LlamaArgs, layer_id: int) -> dict[str, str]:
    """Kiln -> Hugging Face names of one layer's weights, experts excepted."""
    keys = dict(_ATTENTION_KEYS)
    if args.qkv_bias:
        keys |= _QKV_BIAS_KEYS
    if args.qk_norm:
        keys |= _QK_NORM_KEYS
    if not args.is_moe_layer(layer_id):
        return keys | _DENSE_KEYS
    if hf_model_type(args) == "mixtral":
        return keys | {"moe.router.gate.weight": "block_sparse_moe.gate.weight"}
    keys["moe.router.gate.weight"] = "mlp.gate.weight"
    if args.moe.shared_ffn_dim:
        keys |= _SHARED_KEYS | {"moe.shared_gate.weight": "mlp.shared_expert_gate.weight"}
    return keys


def _expert_key(model_type: str, w: str, expert: int) -> str:
    if model_type == "mixtral":
        return f"block_sparse_moe.experts.{expert}.{w}.weight"
    return f"mlp.experts.{expert}.{_SWIGLU[w]}.weight"


def _held_experts(t: Tensor) -> tuple[int, tuple[Tensor, ...]]:
    """(the global index of the first expert this rank holds, views of the held experts' ``[out, in]`` slices).
    A DTensor is sharded over the experts (FSDP2's Shard(0); expert parallelism's; both: FSDP2's _StridedShard(0)
    over edp of ep's Shard(0), a contiguous block of an ep rank's block): its local rows."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(t, DTensor):
        return 0, t.unbind(0)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(
        not (p.is_replicate() or p.is_shard(0) or (isinstance(p, _StridedShard) and p.dim == 0)) for p in t.placements
    ):
        raise RuntimeError(f"experts sharded as {t.placements}: only over the experts (Shard(0))")
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return offset[0], t.to_local().unbind(0)


def to_hf_config(args: LlamaArgs, **token_ids: int | list[int] | None):
    """The transformers config of the same architecture (``LlamaConfig``, ``Qwen3Config``, ``MixtralConfig``,
    ``Qwen3MoeConfig`` or ``Qwen2MoeConfig``: :func:`hf_model_type`).

    ``token_ids``: ``bos_token_id``, ``eos_token_id``, ``pad_token_id`` (any ``*_token_id``). Those
    not given are None rather than the configs' defaults (e.g. 1 and 2), which would silently belong
    to some other tokenizer.
    """
    import transformers  # imported here: the model itself needs only torch

    bad = [k for k in token_ids if not k.endswith("_token_id")]
    if bad:
        raise TypeError(f"to_hf_config takes only *_token_id keyword arguments, got {bad}")
    ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **token_ids}
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        rope.update(rope_type="llama3", **dataclasses.asdict(args.rope_scaling))
    common = dict(
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
        **ids,
    )
    model_type, moe = hf_model_type(args), args.moe
    if model_type == "llama":
        return transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    if model_type == "qwen3":
        return transformers.Qwen3Config(**common, attention_bias=False, use_sliding_window=False)
    routed = dict(num_experts_per_tok=moe.top_k)
    if model_type == "mixtral":
        return transformers.MixtralConfig(
            **{**common, "intermediate_size": moe.ffn_dim},
            **routed,
            num_local_experts=moe.num_experts,
            sliding_window=None,
        )
    qwen_moe = dict(
        **routed,
        num_experts=moe.num_experts,
        moe_intermediate_size=moe.ffn_dim,
        norm_topk_prob=moe.norm_topk_prob,
        decoder_sparse_step=moe.interval,
        mlp_only_layers=list(range(moe.first_dense_layers)),
        use_sliding_window=False,
    )
    if model_type == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, **qwen_moe, attention_bias=False)
    return transformers.Qwen2MoeConfig(
        **common, **qwen_moe, shared_expert_intermediate_size=moe.shared_ffn_dim, qkv_bias=args.qkv_bias
    )


def to_hf_state_dict(sd: dict[str, Tensor], args: LlamaArgs) -> dict[str, Tensor]:
    """Kiln ``Transformer`` keys -> the keys of :func:`hf_model_type`'s checkpoints (the same tensors; each
    expert a view of its stacked weight, under its global index). Unknown keys raise.

    Tied: ``output.weight`` becomes ``model.embed_tokens.weight`` when the dict has no embedding
    (a last pipeline stage), and is dropped when it has (the same tensor): no ``lm_head.weight``.
    """
    model_type = hf_model_type(args)
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
        layer = int(m.group(1)) if m is not None else args.n_layers
        if layer < args.n_layers and args.is_moe_layer(layer) and (e := _KILN_EXPERTS.fullmatch(m.group(2))):
            first, experts = _held_experts(t)
            for i, expert in enumerate(experts):
                out[f"model.layers.{layer}.{_expert_key(model_type, e.group(1), first + i)}"] = expert
            continue
        names = _layer_keys(args, layer) if layer < args.n_layers else {}
        if m is None or m.group(2) not in names:
            raise KeyError(
                f"not a Kiln {HF_ARCHITECTURES[model_type]} state-dict key for {args.n_layers} layers: {key!r}"
            )
        out[f"model.layers.{layer}.{names[m.group(2)]}"] = t
    return out


def from_hf_state_dict(sd: dict[str, Tensor], args: LlamaArgs) -> dict[str, Tensor]:
    """Hugging Face keys (of :func:`hf_model_type`'s checkpoints) -> Kiln ``Transformer`` keys: the same
    tensors, but experts stacked (a copy; every expert of a layer must be there). Unknown keys raise.

    ``rotary_emb.inv_freq`` entries (older checkpoints saved them) are recomputed here, so dropped.
    Tied: ``output.weight`` is the embedding (an ``lm_head.weight`` some exports still carry is
    ignored, as transformers ignores it).
    """
    model_type = hf_model_type(args)
    expert_pattern = _HF_EXPERTS["mixtral" if model_type == "mixtral" else "qwen"]
    to_kiln = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3", "w1": "w1", "w2": "w2", "w3": "w3"}
    out: dict[str, Tensor] = {}
    experts: dict[str, dict[int, Tensor]] = {}
    for key, t in sd.items():
        if key.endswith("rotary_emb.inv_freq") or (key == "lm_head.weight" and args.tie_embeddings):
            continue
        if key in _TOP_KEYS_INV:
            out[_TOP_KEYS_INV[key]] = t
            continue
        m = _HF_LAYER.fullmatch(key)
        layer = int(m.group(1)) if m is not None else args.n_layers
        if layer < args.n_layers and args.is_moe_layer(layer) and (e := expert_pattern.fullmatch(m.group(2))):
            experts.setdefault(f"layers.{layer}.moe.experts.{to_kiln[e.group(2)]}", {})[int(e.group(1))] = t
            continue
        names = {v: k for k, v in _layer_keys(args, layer).items()} if layer < args.n_layers else {}
        if m is None or m.group(2) not in names:
            raise KeyError(f"not a {HF_ARCHITECTURES[model_type]} state-dict key for {args.n_layers} layers: {key!r}")
        out[f"layers.{layer}.{names[m.group(2)]}"] = t
    for key, by_index in experts.items():
        if sorted(by_index) != list(range(args.moe.num_experts)):
            missing = sorted(set(range(args.moe.num_experts)) - by_index.keys())
            raise KeyError(f"{key}: experts {missing} missing of {args.moe.num_experts}")
        out[key] = torch.stack([by_index[i] for i in range(args.moe.num_experts)])
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def is_expert_key(key: str) -> bool:
    """A Kiln key of stacked expert weights (what :func:`to_hf_state_dict` splits into per-expert views)."""
    return _KILN_EXPERTS.search(key) is not None
