"""The memory model: per-GPU bytes of model states and activations for a recipe's model and a layout.

One model for every place that predicts memory: `run.dry_run` (scripts/kiln/launch.py), the measured
run.dir/memory.json next to its prediction (common/deepspeed.py), and the layout planner
(scripts/plan.py, scripts/kiln/planner.py). Each recipe describes its model as a `ModelSpec`
(`recipes/<family>/sizing.py:memory_spec`, counted from its own builder on the meta device);
`estimate(spec, layout)` does the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

# Everything is bytes per GPU: model states per ZeRO stage / FSDP, activations per layer counted
# tensor by tensor, pipeline in-flight microbatches. GB = 1e9 (the ZeRO paper's unit), GiB = 2**30
# (what we print).
GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of weights, gradients and optimizer state (the ZeRO paper's 2 + 2 + K)."""

    weights: float
    grads: float
    optimizer: float


# Rajbhandari et al. 2020 §3.1: mixed-precision Adam keeps fp16 weights and grads (2 + 2) and
# K = 12 bytes of fp32 master weights, momentum and variance.
MIXED_ADAM = StateBytes(2, 2, 12)
FP32_ADAM = StateBytes(4, 4, 8)
# DeepSpeed's ZeRO-1/2 optimizer also holds an fp32 copy of its gradient partition for the step:
# "18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit + 8_optimizer_states_32bit"
# (deepspeed/runtime/zero/stage_1_and_2.py, estimate_zero2_model_states_mem_needs), i.e. K = 16.
DEEPSPEED_MIXED = StateBytes(2, 2, 16)
# In fp32 its ZeRO-1/2 optimizer still keeps a separate fp32 partition of the weights for the
# step (measured on dit_tiny, 2 ranks: +4 B/param/dp over FP32_ADAM), i.e. K = 12; ZeRO-0 steps a
# plain torch optimizer and ZeRO-3 steps its fp32 partitions in place (K = 8).
DEEPSPEED_FP32_ZERO12 = StateBytes(4, 4, 12)


def deepspeed_state_bytes(stage: int, precision: str) -> StateBytes:
    """Bytes per parameter of what DeepSpeed allocates at a ZeRO stage and precision."""
    if precision != "fp32":
        return DEEPSPEED_MIXED
    return DEEPSPEED_FP32_ZERO12 if stage in (1, 2) else FP32_ADAM


# FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) shards the fp32 parameters
# themselves and keeps fp32 sharded gradients; the bf16 copies exist only while a unit is gathered.
FSDP_MIXED = StateBytes(4, 4, 8)


def nf4_bytes(numel: int) -> float:
    """Bytes of torchao's NF4Tensor of `numel` weights (QLoRA's base, Dettmers et al. 2023; common/lora.py:
    quantize_base): 4-bit codes, one 8-bit scale per 64 weights, one fp32 per 256 scales, and per tensor its
    16 fp32 code values and the scales' fp32 mean."""
    return numel * (0.5 + 1 / 64 + 4 / (64 * 256)) + 16 * 4 + 4


def model_state_bytes(
    num_params: float, stage: int, dp: int, per_param: StateBytes, gathered_params: float = 0.0, compute_bytes: int = 2
) -> dict[str, float]:
    """Per-rank weights, gradients and optimizer state under ZeRO stage 0-3 (Rajbhandari et al. 2020,
    Figure 1: P_os shards the optimizer state, P_os+g also the gradients, P_os+g+p also the weights).

    Stage 3 (and FSDP full shard) also holds one gathered unit at a time: its weights and gradients
    in the compute dtype (DeepSpeed's estimate_zero3_model_states_mem_needs counts 4 bytes x the
    largest layer for 16-bit).
    """
    weights = num_params * per_param.weights / (dp if stage >= 3 else 1)
    grads = num_params * per_param.grads / (dp if stage >= 2 else 1)
    optim = num_params * per_param.optimizer / (dp if stage >= 1 else 1)
    gathered = 2 * compute_bytes * gathered_params if stage >= 3 and dp > 1 else 0.0
    return {
        "weights": weights,
        "grads": grads,
        "optimizer": optim,
        "gathered": gathered,
        "total": weights + grads + optim + gathered,
    }


# ---- activations --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One transformer layer, described by the ops that decide what it keeps for backward.

    Korthikanti et al. 2022 (§4.1) count the tensors a GPT-3 layer saves; these switches say
    which of those ops a given architecture has, so the same count covers Llama and DiT too.
    """

    hidden: int  # the residual stream's width: norms, the layer input, the output projection's and MLP's outputs
    heads: int
    ffn: int  # MLP inner size (4h in GPT-3)
    kv_heads: int = 0  # 0: as many as heads (multi-head attention)
    # 0: hidden // heads. A config's head_dim can make heads x head_dim differ from hidden (Qwen3-4B and Qwen3-VL-4B:
    # 32 x 128 = 4096 over 2560; Qwen3-30B-A3B: 4096 over 2048; Gemma): q, k, v and the attention output are that wide.
    head_dim: int = 0
    # layernorm | rmsnorm (fp32 statistics) | adaln_zero (DiT) | fp32_adaln (Wan's: diffusers' WanTransformerBlock
    # runs an FP32LayerNorm on an fp32 copy of the residual stream and modulates its fp32 output, then casts it to the
    # compute dtype for the projections; the attention's gate multiplies its output as it is, the MLP's an fp32 copy)
    norm: str = "layernorm"
    mlp: str = "gelu"  # gelu: fc1 -> gelu -> fc2 | swiglu: down(silu(gate) * up)
    dropout: bool = True  # on attention probabilities, attention output and MLP output
    attention: str = (
        "eager"  # eager: softmax(QK^T)V keeps a*s*s scores | fused: flash/SDPA kernels keep out + logsumexp
    )
    repeat_kv: bool = True  # GQA: k/v repeated to every query head before the kernel (kept at full size)
    dense_mask: bool = False  # fused SDPA handed a [b,1,s,s] bool mask converts it to a bias per layer and keeps it
    megatron_sp: bool = (
        True  # TP+SP: linears keep their sequence shard (Megatron); False: DTensor keeps the gathered input
    )
    # selective AC keeps: all but the s^2 attention core (Korthikanti §5) | save_matmuls (common/toggles.py's
    # policy) | save_narrow_matmuls (the same with recompute_widening: up projections recomputed too)
    selective: str = "attention_core"
    qk_norm: bool = False  # an RMSNorm per head on q and k before the kernel (SD3.5, Flux; Qwen3's language model)
    # diffusers' q/k RMSNorm multiplies its input itself by the fp32 1/rms, so it keeps the input beside the fp32 copy
    # its statistics took; transformers' (Qwen3RMSNorm and its copies) multiplies the fp32 copy: False.
    qk_norm_keeps_input: bool = True
    # torch.nn.RMSNorm over all heads at once (one 1/rms per token: Wan's rms_norm_across_heads) in place of the above:
    # "fused" (CUDA: torch's _fused_rms_norm keeps its input and the fp32 1/rms, _fused_rms_norm_backward's inputs) or
    # "composite" (elsewhere: aten's rms_norm upcasts, keeping an fp32 copy, the fp32 1/rms and the fp32 normalized x,
    # which the weight multiplies in fp32). "": not torch's.
    qk_norm_torch: str = ""
    # A cross-attention sub-block after the self-attention (Wan's attn2) over this many context tokens (the prompt's):
    # its norm's input, q over the layer's tokens, k and v over the context's (whole on every cp rank: Ulysses splits
    # only the self-attention), the kernel's output; no gate. 0: none.
    cross_tokens: int = 0
    # A second adaLN-gated self-attention sub-block (SD3.5's dual attention, `attn2`, over the image tokens only), as
    # the share of layers x tokens it covers: (layers with it / layers) x (its tokens / seq). Its tensors are counted
    # at that share of the layer's (exact in the sum over layers for fused attention, whose tensors are linear in s).
    attention2: float = 0.0
    # The share of layers x tokens whose stream ends at the attention (SD3's last layer: `context_pre_only`, its text
    # tokens get no output projection, no MLP): their post-attention tensors are not kept.
    pre_only: float = 0.0
    # Attention and MLP side by side on one modulated norm output, one projection back from their concatenation
    # [attention output ; MLP activation] (Flux's single-stream block; Dehghani et al. 2023's parallel layers): one
    # norm, no output projection of the attention's own, the projection's input h + ffn wide.
    parallel: bool = False
    # One qkv projection whose output q, k and v are views of (Qwen-VL's vision blocks): v keeps the whole output
    # alive, beside the new q and k that RoPE writes.
    fused_qkv: bool = False
    # Attention run image by image (window by window) and concatenated (transformers' SDPA / eager path of the
    # Qwen-VL towers; their varlen kernel writes one output): the projection keeps the concatenation, a second copy.
    chunked_attention: bool = False
    # Under context parallelism, the LLM's varlen kernel on host-built segments (toggles.attention=flash;
    # recipes/llm/context_parallel.py VarlenSegments) in place of SDPA's mask rows: allgather copies each query
    # piece's keys/values out of the gathered ones (cp_varlen_keys), alltoall puts q, k, v in row order and the output
    # back (index_select copies). No mask either way (dense_mask False).
    cp_varlen: bool = False

    @property
    def kv_fraction(self) -> float:
        return 1.0 if self.repeat_kv or not self.kv_heads else self.kv_heads / self.heads

    @property
    def attention_width(self) -> int:
        """heads x head_dim: the width of q, of the attention's output and of the output projection's input."""
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def kv_width(self) -> int:
        """kv_heads x head_dim: the width of k and v as projected (before GQA repeats them)."""
        return (self.kv_heads or self.heads) * (self.head_dim or self.hidden // self.heads)


class Saved(NamedTuple):
    name: str
    nbytes: float
    tp_sharded: bool  # divided by the tensor-parallel degree (with sequence parallelism)
    quadratic: bool = False  # grows with s^2: what Korthikanti's selective recomputation drops


def _norm_saved(block: Block, where: str, sbh: float, sb: float, e: int) -> list[Saved]:
    if block.norm == "layernorm":  # keeps its input (Korthikanti: 2sbh); the output is the next linear's input
        return [Saved(f"{where} norm input", e * sbh, True)]
    if block.norm == "rmsnorm":
        # HF/Kiln RMSNorm: x.float() * rsqrt(mean(x^2)) then weight * h.to(dtype): pow and mul keep the
        # fp32 input, mul keeps 1/rms, the weight multiply keeps the normalized x.
        return [
            Saved(f"{where} norm input (fp32)", 4 * sbh, True),
            Saved(f"{where} norm 1/rms", 4 * sb, True),
            Saved(f"{where} norm normalized", e * sbh, True),
        ]
    if block.norm == "fp32_adaln":  # Block.norm: the fp32 copy, the fp32 modulated output, the gated output
        return [
            Saved(f"{where} norm input (fp32)", 4 * sbh, True),
            Saved(f"{where} norm output (fp32)", 4 * sbh, True),
            Saved(
                f"{where} gated output" + (" (fp32)" if where == "mlp" else ""),
                (4 if where == "mlp" else e) * sbh,
                True,
            ),
        ]
    # adaLN-Zero (Peebles & Xie 2023): LayerNorm input, its output (kept by the (1 + scale) multiply),
    # and the sub-block's output (kept by the gate multiply).
    return [
        Saved(f"{where} norm input", e * sbh, True),
        Saved(f"{where} norm output", e * sbh, True),
        Saved(f"{where} gated output", e * sbh, True),
    ]


def _qk_norm_saved(block: Block, s: int, b: int, e: int, k_seq: int = 0) -> list[Saved]:
    """diffusers' RMSNorm on q and k: `x.to(float32).pow(2)` keeps an fp32 copy (the input itself in fp32), the
    `x * rsqrt(...)` multiply keeps x and the fp32 1/rms per head, the weight multiply the normalized x. transformers'
    (Block.qk_norm_keeps_input False) multiplies the fp32 copy instead: x itself is not kept where it is not fp32.
    torch.nn.RMSNorm across heads (Block.qk_norm_torch): one 1/rms per token. `k_seq`: k's tokens where they are not
    q's `s` (a cross-attention's context)."""
    if not block.qk_norm:
        return []
    if block.qk_norm_torch:
        out = []
        for name, n, width in (("q", s * b, block.attention_width), ("k", (k_seq or s) * b, block.kv_width)):
            if block.qk_norm_torch == "fused":
                out.append(Saved(f"{name} norm input", e * n * width, True))
            else:
                out.append(Saved(f"{name} norm input (fp32)", 4 * n * width, True))
                out.append(Saved(f"{name} norm normalized (fp32)", 4 * n * width, True))
            out.append(Saved(f"{name} norm 1/rms (fp32)", 4 * n, True))
        return out
    sbq, sba = s * b * block.attention_width, s * b * block.heads  # over q's heads x head_dim
    keeps = block.qk_norm_keeps_input
    kv = (block.kv_heads or block.heads) / block.heads  # k's heads: the norm runs before GQA repeats them
    return [
        Saved(f"{name} norm {what}", nbytes, True)
        for name, frac in (("q", 1.0), ("k", kv * (k_seq or s) / s))
        for what, nbytes in (
            ("input", e * sbq * frac if keeps else 0.0),
            ("input (fp32)", 4 * sbq * frac if e != 4 or not keeps else 0.0),
            ("1/rms (fp32)", 4 * sba * frac),
            ("normalized", e * sbq * frac),
        )
    ]


def _attention2_saved(block: Block, s: int, b: int, e: int, recompute: str) -> list[Saved]:
    """The second attention sub-block (Block.attention2): its modulated input, the kernel's tensors and the gated
    output without AC; with save_matmuls AC, its projections and kernel output (the modulation is per sample)."""
    if not block.attention2 or recompute == "full":
        return []
    sbh = s * b * block.hidden
    if recompute == "selective" and block.selective in ("save_matmuls", "save_narrow_matmuls"):
        inner = [t for t in _save_matmuls_saved(block, s, b, e) if t.name in SAVED_BY_ATTENTION_MATMULS]
    else:
        inner = [Saved("modulated input", e * sbh, True)] + _attention_saved(block, s, b, e)
        inner += _qk_norm_saved(block, s, b, e) + [Saved("gated output", e * sbh, True)]
    return [t._replace(name=f"second attention {t.name}", nbytes=t.nbytes * block.attention2) for t in inner]


def _cross_attention_saved(block: Block, s: int, b: int, e: int, recompute: str) -> list[Saved]:
    """The cross-attention sub-block (Block.cross_tokens): q over this rank's s tokens, k and v over the context's.
    Without AC: its norm's input (fp32 under fp32_adaln; its output cast is q's projection input), the projection
    input, the q/k norms, the kernel's q, k, v, output and logsumexp (its output is the output projection's input; the
    residual add keeps nothing). With save_matmuls AC: the projections' and the kernel's outputs."""
    t = block.cross_tokens
    if not t or recompute == "full":
        return []
    sbh, sbq, tbk = s * b * block.hidden, s * b * block.attention_width, t * b * block.kv_width
    kernel = [
        Saved("cross attention output", e * sbq, True),
        Saved("cross logsumexp", 4 * block.heads * s * b, True),
    ]
    if recompute == "selective" and block.selective in ("save_matmuls", "save_narrow_matmuls"):
        return [
            Saved("cross q projection", e * sbq, True),
            Saved("cross k, v projections", 2 * e * tbk, True),
            *kernel,
            Saved("cross output projection", e * sbh, False),
        ]
    norm = 4 if block.norm == "fp32_adaln" else e
    qk_norm = [kept._replace(name=f"cross {kept.name}") for kept in _qk_norm_saved(block, s, b, e, k_seq=t)]
    return [
        Saved("cross norm input" + (" (fp32)" if norm == 4 else ""), norm * sbh, True),
        Saved("cross q projection input", e * sbh, True),
        *qk_norm,
        Saved("cross q, k, v", e * (sbq + 2 * tbk), True),
        *kernel,
    ]


AFTER_ATTENTION = ("output projection", "gate, up projections", "fc1 output", "down projection")
SAVED_BY_ATTENTION_MATMULS = ("q, k, v projections", "attention output", "logsumexp", "output projection")


def _attention_saved(block: Block, s: int, b: int, e: int, kv_seq: int = 0, mask_side: int = 0) -> list[Saved]:
    """`kv_seq`: the keys' sequence length where it is not the queries' `s` (context parallelism's all-gather: the
    rank's s = L/cp queries attend over the row's L gathered keys and values, which the kernel keeps; the mask is
    [s x kv_seq]). `mask_side`: a square [mask_side x mask_side] mask instead (the all-to-all: every rank attends
    over the whole row with heads/cp heads, so its kernel keeps the whole [L x L] mask, while its q, k, v and output
    are the bytes of s = L/cp tokens with every head)."""
    # q, k, v, the kernel's output and the projection's input are heads x head_dim wide (Block.attention_width).
    sbq, a, kv = s * b * block.attention_width, block.heads, block.kv_fraction
    kv_seq = kv_seq or s
    fused_qkv = [Saved("q, k projected (v keeps the fused output)", e * sbq * (1 + kv), True)]
    fused_qkv = fused_qkv if block.fused_qkv else []
    mask_bytes = e * b * (mask_side * mask_side if mask_side else s * kv_seq)
    if block.attention == "fused":
        # Flash/SDPA kernels keep q, k, v, their output and the fp32 logsumexp, never the scores; they
        # write the output as [b, s, a, d], so the reshape before the projection is a view of it.
        out = [
            Saved("q, k, v", e * sbq * (1 + 2 * kv * kv_seq / s), True),
            *fused_qkv,
            Saved("attention output", e * sbq, True),
            Saved("logsumexp", 4 * a * s * b, True),
        ]
        if block.chunked_attention:
            out.append(Saved("attention outputs concatenated", e * sbq, True))
        if block.dense_mask:  # broadcast over heads: every TP rank converts and keeps the whole mask
            out.append(Saved("attention mask as bias", mask_bytes, False, quadratic=True))
        return out
    out = [Saved("q, k", e * sbq * (1 + kv), True), *fused_qkv]
    out.append(Saved("softmax output", e * a * s * s * b, True, quadratic=True))
    if block.dropout:
        out += [
            Saved("softmax dropout mask", a * s * s * b, True, quadratic=True),
            Saved("softmax dropout output", e * a * s * s * b, True, quadratic=True),
        ]
    return out + [Saved("v", e * sbq * kv, True), Saved("projection input", e * sbq, True)]


def _mlp_saved(block: Block, s: int, b: int, e: int) -> list[Saved]:
    sbf = s * b * block.ffn
    if block.mlp == "gelu":
        return [Saved("gelu input", e * sbf, True), Saved("fc2 input", e * sbf, True)]
    return [Saved("gate, silu(gate), up, product", 4 * e * sbf, True)]


def _save_matmuls_saved(block: Block, s: int, b: int, e: int, widening: bool = True) -> list[Saved]:
    """Selective AC with common/toggles.py's policy (`_save_matmuls`): keep the outputs of the matmuls
    and the attention kernel, recompute norms, rope, activations from the layer input; without
    `widening`, the up projections are recomputed too. Row-parallel outputs are kept as
    full-sequence partial sums, before reduce-scatter. (A DiT's adaLN modulation matmul is per
    sample, b x 6h: not counted.)"""
    sbh, sbf, sbq = s * b * block.hidden, s * b * block.ffn, s * b * block.attention_width
    kv = (block.kv_heads or block.heads) / block.heads
    up = (
        Saved("gate, up projections", 2 * e * sbf, True)
        if block.mlp == "swiglu"
        else Saved("fc1 output", e * sbf, True)
    )
    return [
        Saved("layer input", e * sbh, True),
        Saved("q, k, v projections", e * sbq * (1 + 2 * kv), True),
        Saved("attention output", e * sbq, True),
        Saved("logsumexp", 4 * block.heads * s * b, True),
        Saved("output projection", e * sbh, False),
        *([up] if widening else []),
        Saved("down projection", e * sbh, False),
    ]


def layer_saved(
    block: Block,
    *,
    seq: int,
    batch: int,
    act_bytes: int,
    recompute: str = "none",
    cp: int = 1,
    cp_method: str = "allgather",
) -> list[Saved]:
    """Every tensor one layer keeps for backward (generalized Korthikanti et al. 2022, §4.1 and §5).

    With GPT-3's ops in 16-bit (layernorm, 4h gelu MLP, dropout, eager attention) the sum is exactly
    s·b·h·34 + 5·a·s²·b; `full` keeps only the layer input (2·s·b·h), `selective` drops the s² terms.
    Masks of dropout are 1 byte; softmax statistics of layernorm are not counted (as in the paper).
    Context parallelism (cp > 1): each rank holds seq/cp tokens of every row. `cp_method=allgather`: its attention
    kernel keeps the row's gathered keys and values (seq) and its [seq/cp x seq] rows of the mask; under the varlen
    kernel (Block.cp_varlen) no mask, and the keys/values it keeps are its copies, at most cp_varlen_keys per row (the
    gathered ones are freed once copied: cp_transient_bytes). `alltoall`
    (Ulysses: DeepSpeed's DistributedAttention, the LLM's own exchange): the kernel keeps q, k, v and its output for
    the whole row with heads/cp heads, the bytes of seq/cp tokens with every head, and the whole [seq x seq] mask;
    the inverse all-to-all's result is a new tensor, the output projection's input, kept beside the kernel's output.
    """
    s, b, e = seq // cp, batch, act_bytes
    sbh, sb = s * b * block.hidden, s * b
    if recompute == "full":
        return [Saved("layer input", e * sbh, True)]
    if recompute == "selective" and block.selective in ("save_matmuls", "save_narrow_matmuls"):
        widening = block.selective == "save_matmuls"
        kept = _save_matmuls_saved(block, s, b, e, widening=widening)
        if block.parallel:  # the one projection back is the "down projection"
            kept = [t for t in kept if t.name != "output projection"]
        kept = [t._replace(nbytes=t.nbytes * (1 - block.pre_only)) if t.name in AFTER_ATTENTION else t for t in kept]
        return kept + _attention2_saved(block, s, b, e, recompute) + _cross_attention_saved(block, s, b, e, recompute)
    out = _norm_saved(block, "attention", sbh, sb, e) + [Saved("qkv input", e * sbh, block.megatron_sp)]
    ulysses = cp > 1 and cp_method == "alltoall"
    attention = (
        _attention_saved(block, s, b, e, mask_side=seq)
        + [Saved("attention output after the all-to-all (projection input)", e * s * b * block.attention_width, True)]
        if ulysses
        else _attention_saved(block, s, b, e, kv_seq=cp_varlen_keys(seq, cp) if block.cp_varlen else seq)
    )
    out += attention + _qk_norm_saved(block, s, b, e) + _attention2_saved(block, s, b, e, "")
    out += _cross_attention_saved(block, s, b, e, "")
    if block.dropout:
        out.append(Saved("attention dropout mask", sbh, True))
    if block.parallel:  # the MLP reads the attention's (modulated) input; the projection's input is a new tensor
        out += [
            Saved("gelu input", e * s * b * block.ffn, True),
            Saved(
                "projection input [attention output ; MLP activation]",
                e * s * b * (block.attention_width + block.ffn),
                True,
            ),
        ]
        return [t for t in out if not t.quadratic] if recompute == "selective" else out
    mlp = _norm_saved(block, "mlp", sbh, sb, e) + [Saved("mlp input", e * sbh, block.megatron_sp)]
    mlp += _mlp_saved(block, s, b, e)
    if block.dropout:
        mlp.append(Saved("mlp dropout mask", sbh, True))
    out += [t._replace(nbytes=t.nbytes * (1 - block.pre_only)) for t in mlp]
    if recompute == "selective":
        out = [t for t in out if not t.quadratic]
    return out


def per_gpu_bytes(saved: list[Saved], tp: int = 1) -> float:
    return sum(t.nbytes / (tp if t.tp_sharded else 1) for t in saved)


def layer_activation_bytes(
    block: Block,
    *,
    seq: int,
    batch: int,
    act_bytes: int,
    tp: int = 1,
    recompute: str = "none",
    cp: int = 1,
    cp_method: str = "allgather",
) -> float:
    """Bytes one layer keeps for backward on one GPU of a tp-way tensor (+ sequence) parallel group (and a cp-way
    context parallel group: `seq` is the whole row's)."""
    saved = layer_saved(
        block, seq=seq, batch=batch, act_bytes=act_bytes, recompute=recompute, cp=cp, cp_method=cp_method
    )
    return per_gpu_bytes(saved, tp)


def cp_transient_bytes(
    block: Block, *, seq: int, batch: int, act_bytes: int, tp: int = 1, cp: int = 1, cp_method: str = "allgather"
) -> float:
    """What context parallelism's exchange holds live around one layer's attention, beyond what the layer keeps.

    `allgather` (recipes/llm/context_parallel.py): the gathered keys and values of the row (2 x seq x kv_heads x
    head_dim, this rank's heads), and under SDPA the rank's [seq/cp x seq] bool rows of the document + causal mask
    (the varlen kernel, Block.cp_varlen, takes host-built segments instead: no mask).
    `alltoall` (Ulysses): DeepSpeed's DistributedAttention (deepspeed/sequence/layer.py single_all_to_all) sends
    each of q, k, v, then the kernel's output, one after the other, from a permuted contiguous copy into an
    `empty_like` receive buffer, then permutes that into the result the kernel (or the output projection) keeps:
    two buffers of the exchanged tensor live beside its result, the largest being q's or the output's (seq/cp x
    every head of this tp rank); the LLM's own exchange allocates the same three. Plus, with a dense mask, the
    whole row's [seq x seq] bool mask on every rank (recipes/llm/context_parallel.py; the VLM's transformers mask).
    Backward exchanges the gradients the same way, one at a time: the same two buffers."""
    if cp == 1:
        return 0.0
    if cp_method == "alltoall":
        mask = batch * seq * seq if block.dense_mask else 0
        # cp_varlen: the output the kernel keeps is put back in the gathered order by a copy (index_select), which
        # the inverse exchange's send copy and receive buffer then join: three q-sized buffers. (Before the kernel,
        # the exchanged q, k, v beside their row-order copies are one q and two k-sized ones: no more.)
        buffers = 3 if block.cp_varlen else 2
        return buffers * (seq // cp) * batch * block.attention_width * act_bytes / tp + mask
    # Under cp_varlen the gathered keys/values live until the kernel's copies of them (cp_varlen_keys) are taken.
    mask = batch * (seq // cp) * seq if block.dense_mask else 0
    return 2 * seq * batch * block.kv_width * act_bytes / tp + mask


def cp_varlen_keys(seq: int, cp: int) -> int:
    """The most keys a cp rank's varlen kernel gets per row under `allgather` (recipes/llm/context_parallel.py:
    VarlenSegments.rank_queries): the rank's chunks [lo, hi) hold n = seq/(2 cp) queries each, and a document [s, e)
    cuts a chunk into a piece [a, b) that gets the copied keys [s, b). Over a chunk the pieces' keys are its n
    queries plus a - s for the one piece whose document starts before lo, at most lo: at most hi keys. The early
    chunk ends at (r + 1) n, the late one at (2 cp - r) n: (2 cp + 1) n = seq + seq/(2 cp) keys on every rank, reached
    when a document starts the row and reaches into the rank's late chunk (a document spanning the row: every rank)."""
    return seq + seq // (2 * cp) if cp > 1 else seq  # cp=1: the row, as the varlen path without cp attends it


def head_saved(
    block: Block,
    *,
    seq: int,
    batch: int,
    vocab: int,
    act_bytes: int,
    loss: bool = True,
    vocab_parallel: bool = False,
    loss_seq: int = 0,
) -> list[Saved]:
    """What a language model keeps after its last layer: the final norm, the output projection's
    input (gathered over TP), and with the loss the fp32 log-probabilities that cross_entropy's
    log_softmax keeps (the recipes upcast the logits first). At 8k tokens x 128k vocabulary the
    last term alone is 4 GiB per sequence: the logits matter. `loss_seq`: the loss's tokens where
    they are not the head's (context parallelism gathering the logits of the whole row)."""
    sbh, sb = seq * batch * block.hidden, seq * batch
    out = _norm_saved(block, "final", sbh, sb, act_bytes) + [Saved("head input", act_bytes * sbh, block.megatron_sp)]
    if loss:
        out.append(Saved("log-probabilities (fp32)", 4 * (loss_seq or seq) * batch * vocab, vocab_parallel))
    return out


def logits_transient_bytes(
    *, seq: int, batch: int, vocab: int, act_bytes: int, tp: int = 1, vocab_parallel: bool = False
) -> float:
    """Live only around the loss: the logits in the compute dtype and their fp32 copy."""
    return seq * batch * vocab * (act_bytes + 4) / (tp if vocab_parallel else 1)


def reference_logps_bytes(
    *, seq: int, batch: int, vocab: int, act_bytes: int, tp: int = 1, vocab_parallel: bool = False
) -> float:
    """A no-grad forward's peak at its answers' log-probs (common/preference.py answer_logps): the logits in the compute
    dtype, the fp32 copy of the labelled positions' rows and logsumexp's fp32 working tensor of the same size, at
    most every position labelled (nothing is kept for backward)."""
    return seq * batch * vocab * (act_bytes + 8) / (tp if vocab_parallel else 1)


def microbatches_in_flight(schedule: str, pp: int, microbatches: int, rank: int) -> float:
    """Microbatches whose activations pipeline rank `rank` holds at its peak, in units of its layers.

    GPipe keeps all m. 1F1B (Narayanan et al. 2021) warms rank r up with p - r forwards, so the first
    stage holds p. Interleaved 1F1B (v = 2 chunks of 1/v of the rank's layers): torch's schedule warms
    up with (v-1)·p + 2·(p-1-r) chunk forwards; for r = 0 that is Korthikanti §4.2.3's L·(1 + (p-1)/(p·v)).
    """
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(pp - rank, microbatches)
    v = 2
    return min((v - 1) * pp + 2 * (pp - 1 - rank) + 1, microbatches * v) / v


# ---- a model and a layout ----------------------------------------------------------------------


@dataclass(frozen=True)
class LayerType:
    """One kind of layer in a model's stack: its Block, how many, and the trainable parameters of one.

    `seq` x `batch`: its own tokens per micro-batch where they are not the spec's rows (a VLM's vision tower over all
    the micro-batch's patches: `seq` the span one attention covers, an image or a window, and `batch` how many such
    spans; every term but eager attention's s^2 is linear in seq x batch). Such a layer is not split by cp."""

    block: Block
    layers: int
    params: int
    seq: int = 0  # 0: the spec's seq and micro-batch rows
    batch: int = 0


@dataclass(frozen=True)
class ModelSpec:
    """What the planner knows about a recipe's model: shapes from its config, parameter counts from
    its own builder on the meta device (scripts/plan.py fills it in)."""

    name: str
    block: Block
    layers: int
    seq: int
    micro_batch: int
    layer_params: int  # trainable parameters of one transformer layer
    first_params: int  # trainable parameters outside the layers on the first pipeline stage (embeddings)
    last_params: int = 0  # ... on the last stage (final norm, output projection)
    frozen_params: int = 0  # never trained (the VLM's vision tower, a LoRA run's base): weights only
    frozen_bytes: float = 0  # bytes of all frozen weights; 0: frozen_params in the compute dtype (DeepSpeed casts them)
    gather_unit_params: int = 0  # ZeRO-3 / FSDP: the largest unit gathered at once
    vocab: int = 0  # > 0: the last stage computes logits and a cross-entropy over this vocabulary
    precision: str = "bf16"
    sharding: str = "deepspeed"  # deepspeed: the layout's ZeRO stage | fsdp: FSDP2 full shard whenever dp > 1
    ac_modes: tuple[str, ...] = ("none", "full")
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0  # 0: pp
    vocab_parallel: bool = False  # TP keeps the logits sharded over the vocabulary (loss parallel)
    context_parallel: bool = False  # the recipe splits rows over parallel.cp ranks (the planner varies cp)
    largest_trainable: int = 0  # elements of the largest trainable parameter (DeepSpeed: cp x ZeRO-3's bucket rule)
    cp_method: str = "allgather"  # parallel.cp_method: what cp ranks exchange (allgather: keys/values; alltoall: heads)
    # Under cp the output projection's tokens are gathered and the loss taken on the whole rows on every cp rank (the
    # DeepSpeed recipes: common/ulysses.py gather_tokens), so the logits are not divided by cp.
    cp_whole_loss: bool = False
    # Mixture of Experts: the routed experts of the largest MoE layer (in layer_params and gather_unit_params),
    # their count, and the (token, expert) pairs per token whose rows travel by all-to-all under expert parallelism.
    expert_params: int = 0
    experts: int = 0
    top_k: int = 0
    ema: bool = False  # an fp32 EMA of the trainable weights (the DiT's, common/ema.py): held like them, in "optimizer"
    # Bytes held whole on every GPU whatever the ZeRO stage, in "weights": frozen models beside the engine (a
    # text-to-image run's text encoders and VAE) and the trained model's buffers (ZeRO partitions parameters only).
    unsharded_bytes: float = 0
    # Bytes kept for backward per micro-batch outside the layers and their AC (a VLM's projector over the image
    # features), on the first pipeline stage.
    outside_layers_bytes: float = 0
    note: str = ""  # what the estimate holds and leaves out, printed under it (run.dry_run, scripts/plan.py)
    # A frozen copy of the trained model beside it (preference optimization's live reference: recipes/llm/sizing.py),
    # built and sharded as the trained weights: their bytes once more in "weights" (no gradients, no optimizer state),
    # and its no-grad forward, which runs first on each micro-batch and frees what it made before the trained model's
    # forward: its peak (one layer's working set, or the logits at the log-probs) is live without the kept activations.
    reference_copy: bool = False
    # Further layer types after `block` x `layers` (Flux's single-stream blocks after its dual-stream ones), each with
    # its own activations and parameters. Not split over pipeline stages (the planner offers pp = 1 with them).
    more_layers: tuple[LayerType, ...] = ()

    @property
    def layer_types(self) -> tuple[LayerType, ...]:
        return (LayerType(self.block, self.layers, self.layer_params), *self.more_layers)

    @property
    def total_params(self) -> int:
        layers = sum(t.layers * t.params for t in self.layer_types)
        return layers + self.first_params + self.last_params + self.frozen_params

    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    zero_stage: int  # FSDP full shard counts as 3
    ac: str
    ep: int = 1  # MoE: the experts split over ep of the dp (x cp) ranks
    cp: int = 1  # context parallelism: each row's sequence split over cp ranks; FSDP shards over dp x cp

    def sharding(self, spec: ModelSpec) -> str:
        if spec.sharding == "fsdp":
            return "fsdp" if self.zero_stage == 3 else "none"
        return f"zero{self.zero_stage}"


def _state_bytes_per_param(spec: ModelSpec, stage: int) -> StateBytes:
    if spec.sharding == "fsdp":
        return FSDP_MIXED  # fp32 parameters either way; bf16 only changes the gathered copies
    return deepspeed_state_bytes(stage, spec.precision)


def estimate_rank(spec: ModelSpec, layout: Layout, rank: int = 0) -> dict[str, float]:
    """Peak bytes on one GPU of pipeline rank `rank`: states + stored activations + the largest
    transient (the logits around the loss, or one layer recomputed in backward under AC)."""
    p, tp, e, cp = layout.pp, layout.tp, spec.act_bytes, layout.cp
    if p > 1 and spec.more_layers:
        raise ValueError(f"{spec.name}: a pipeline split of several layer types is not modelled (pp={p})")
    first, last = rank == 0, rank == p - 1
    types = [(t, t.layers // p) for t in spec.layer_types]  # (type, this rank's layers of it)
    params = (sum(n * t.params for t, n in types) + first * spec.first_params + last * spec.last_params) / tp
    # Expert parallelism: each rank's experts are FSDP-sharded over the dp*cp/ep others, so the states stay
    # params / (dp*cp), but a gathered MoE layer holds only its 1/ep of the experts.
    gathered = (spec.gather_unit_params - spec.expert_params * (1 - 1 / layout.ep)) / tp
    shard = layout.dp * cp  # FSDP shards over dp x cp (the ranks that split a step's tokens)
    states = model_state_bytes(
        params,
        layout.zero_stage,
        shard,
        _state_bytes_per_param(spec, layout.zero_stage),
        gathered_params=gathered,
        compute_bytes=e,
    )
    states["weights"] += (spec.frozen_bytes or spec.frozen_params * e) / (shard if layout.zero_stage >= 3 else 1)
    # The reference copy: the trained model's weights again, sharded the same way. Its parameters do not require grad,
    # so a dp=1 bf16 run caches no bf16 copies of them (autocast caches leaf tensors that require grad only), and its
    # FSDP units, gathered one at a time in the compute dtype, stay under the trained model's "gathered" (weights and
    # gradients), which is not live while the reference runs.
    states["weights"] *= 2 if spec.reference_copy else 1
    states["weights"] += spec.unsharded_bytes
    if spec.ema:  # 4 bytes per trainable parameter, partitioned only where the weights are (ZeRO-3)
        states["optimizer"] += 4 * params / (shard if layout.zero_stage >= 3 else 1)
    if spec.sharding == "fsdp" and shard == 1 and e == 2:
        states["gathered"] += 2 * params  # no FSDP policy to cast: autocast caches bf16 weight copies

    microbatches = spec.pp_microbatches or p
    rows = math.ceil(spec.micro_batch / microbatches) if p > 1 else spec.micro_batch
    shape = dict(seq=spec.seq, batch=rows, act_bytes=e)

    def own(t: LayerType) -> dict:  # a layer type's tokens and cp split: its own, or the rows split over cp
        return dict(seq=t.seq, batch=t.batch, act_bytes=e, cp=1) if t.seq else dict(shape, cp=cp)

    split = dict(tp=tp, cp_method=spec.cp_method)
    per_microbatch = sum(n * layer_activation_bytes(t.block, recompute=layout.ac, **split, **own(t)) for t, n in types)
    per_microbatch += first * spec.outside_layers_bytes
    # Under AC, the largest layer recomputed in backward; under cp, the largest layer's exchange buffers.
    recomputed = [layer_activation_bytes(t.block, **split, **own(t)) for t, _ in types]
    transient = max(recomputed) if layout.ac != "none" else 0.0
    transient += max(cp_transient_bytes(t.block, **split, **own(t)) for t, _ in types)
    loss_seq = spec.seq if spec.cp_whole_loss else spec.seq // cp
    shape["seq"] = spec.seq // cp  # the head sees this rank's tokens only (the loss: loss_seq)
    if spec.experts:  # each token's top_k rows, permuted by expert: sent, received and combined back (one layer)
        transient = max(transient, 3 * spec.top_k * spec.seq * rows * spec.block.hidden * e)
    if last and spec.vocab:
        per_microbatch += per_gpu_bytes(
            head_saved(spec.block, vocab=spec.vocab, vocab_parallel=spec.vocab_parallel, loss_seq=loss_seq, **shape), tp
        )
        shape["seq"] = loss_seq
        transient = max(
            transient, logits_transient_bytes(vocab=spec.vocab, tp=tp, vocab_parallel=spec.vocab_parallel, **shape)
        )
    activations = microbatches_in_flight(spec.pp_schedule, p, microbatches, rank) * per_microbatch
    if spec.reference_copy:  # its peak replaces activations + transient where it is larger
        peak = reference_forward_bytes(spec, types, split, own, last=last, tp=tp, **shape)
        transient = max(transient, peak - (activations if p == 1 else 0.0))  # pp > 1: other micro-batches in flight
    parts = {k: states[k] for k in ("weights", "grads", "optimizer", "gathered")}
    parts.update(activations=activations, transient=transient)
    return {**parts, "total": sum(parts.values()), "rank": rank}


def reference_forward_bytes(spec: ModelSpec, types, split: dict, own, *, last: bool, tp: int, **shape) -> float:
    """The reference copy's no-grad forward at its peak on one GPU: one layer's working set (bounded by what the layer
    would keep for backward without AC, plus under cp its exchange), or on the last stage the logits of the
    micro-batch at the log-probs (`shape`: the loss's tokens and this rank's rows)."""
    layer = max(
        layer_activation_bytes(t.block, **split, **own(t)) + cp_transient_bytes(t.block, **split, **own(t))
        for t, _ in types
    )
    if not (last and spec.vocab):
        return layer
    return max(layer, reference_logps_bytes(vocab=spec.vocab, tp=tp, vocab_parallel=spec.vocab_parallel, **shape))


def estimate(spec: ModelSpec, layout: Layout) -> dict[str, float]:
    """The worst pipeline rank: the first holds the most microbatches, the last the logits."""
    return max((estimate_rank(spec, layout, r) for r in {0, layout.pp - 1}), key=lambda d: d["total"])


def configured_layout(
    spec: ModelSpec, *, dp: int, tp: int, pp: int, zero_stage: int, ac: str, ep: int = 1, cp: int = 1
) -> Layout:
    """The Layout a config describes: FSDP recipes shard fully whenever dp x cp > 1 (counted as stage 3)."""
    stage = (3 if dp * cp > 1 else 0) if spec.sharding == "fsdp" else zero_stage
    return Layout(dp=dp, tp=tp, pp=pp, zero_stage=stage, ac=ac, ep=ep, cp=cp)


def describe_sharding(spec: ModelSpec, layout: Layout) -> str:
    over = f"dp={layout.dp}" + (f" x cp={layout.cp}" if layout.cp > 1 else "")  # the ranks that split the tokens
    if spec.sharding == "fsdp":
        experts = f", experts split over ep={layout.ep}" if layout.ep > 1 else ""
        return (f"FSDP over {over}" if layout.zero_stage == 3 else "no sharding (dp=1)") + experts
    return f"ZeRO stage {layout.zero_stage} over {over}"


def dry_run_report(spec: ModelSpec, layout: Layout) -> str:
    """What `run.dry_run=true` prints: the size and the per-GPU estimate of the configured layout, in
    the planner's columns (scripts/plan.py lists the same numbers for every layout)."""
    est = estimate(spec, layout)
    n = spec.total_params
    states = est["weights"] + est["grads"] + est["optimizer"] + est["gathered"]
    lines = [
        f"recipe {spec.name}: {n:,} parameters ({n / 1e9:.2f}B)",
        f"per GPU at dp={layout.dp} tp={layout.tp} pp={layout.pp}"
        + (f" cp={layout.cp}" if layout.cp > 1 else "")
        + f", {describe_sharding(spec, layout)}, "
        f"{spec.precision}, micro batch {spec.micro_batch} x {spec.seq} tokens, AC {layout.ac}"
        + (f" (pipeline rank {est['rank']}, the fullest)" if layout.pp > 1 else "")
        + ":",
    ]
    lines += [f"  {key:<12}{est[key] / GIB:10.2f} GiB" for key in MEMORY_COLUMNS]
    lines.append(
        f"model states per GPU: {states:,.0f} bytes (weights {est['weights']:,.0f} + grads {est['grads']:,.0f} "
        f"+ optimizer {est['optimizer']:,.0f} + gathered {est['gathered']:,.0f})"
    )
    if spec.note:
        lines.append(spec.note)
    return "\n".join(lines)


MEMORY_COLUMNS = ("weights", "grads", "optimizer", "gathered", "activations", "transient", "total")


def preference_reference(cfg, params: int, copy: str) -> tuple[bool, str]:
    """(whether a run holds a live frozen reference copy, the note line saying which reference is counted) under
    ``cfg.preference.loss`` (a TrainConfig): a copy of the ``params`` weights unless the loss takes no reference,
    finetune=lora runs the base with its adapter off, or preference.reference=precomputed; ``copy`` says how the
    family holds it (dtype, sharding). (False, "") without preference.loss."""
    pref = cfg.preference
    if not pref.enabled:
        return False, ""
    held = pref.needs_reference and cfg.finetune != "lora" and pref.reference != "precomputed"
    if held:
        size = f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.2f}M"
        what = (
            f"a frozen reference copy of {size} {copy} (weights only; its no-grad "
            "forward's peak, before the policy's, in transient where larger)"
        )
    elif not pref.needs_reference:
        what = "reference-free loss: none"
    elif cfg.finetune == "lora":
        what = "LoRA: the base with the adapter off, no copy"
    else:
        what = "precomputed reference log-probs: no copy"
    return held, f"preference.loss={pref.loss}, reference: {what}"


def count_params(module, trainable_only: bool = False) -> int:
    """Parameters of a module (0 for None: a pipeline stage may lack its ends)."""
    if module is None:
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def largest_trainable(model) -> int:
    """Elements of the model's largest trainable parameter (common/deepspeed.py check_cp_zero3)."""
    return max((p.numel() for p in model.parameters() if p.requires_grad), default=0)


def largest_module_params(model) -> int:
    """DeepSpeed ZeRO-3 gathers module by module: the largest module's own parameters (its rule in
    deepspeed/runtime/zero/stage3.py:model_to_params)."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
