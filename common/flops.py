"""FLOPs of a train step (counted with torch's FlopCounterMode), device peak FLOP/s, and MFU.

Wiring into the step loop (common/trainer.py, StepFlops)::

    from common.flops import FlopCounter, mfu, peak_flops, precision_key

    with FlopCounter() as fc:                # first step only: counting dispatches every op in Python
        stats = trainer.train_step(timer)
    flops = fc.global_flops()                # collective: the job's FLOPs per optimizer step
    peak = peak_flops(dist.device, precision_key(cfg.toggles))   # per device, FLOP/s
    # every logged step (drop the counted first step's time: counting slows it):
    record.update(flops_per_step=flops, achieved_tflops=flops / step_time / world_size / 1e12,
                  mfu=mfu(flops, step_time, peak, world_size))

Steps whose shapes change (packed LLM/VLM rows: the row count varies) do work proportional to
their slots, so scale: ``flops * slots / counted_slots`` with slots = tokens / token_utilization.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time

import torch
import torch.utils._pytree as pytree
from torch.utils.flop_counter import (
    FlopCounterMode,
    _FlopCounterMode,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)


def _cpu_flash_attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_flash_attention_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# ---- attention kernels torch's table may not know ---------------------------------------------
# One convention for every kernel, torch's for SDPA: forward = the two matmuls Q K^T and P V
# (4 s_q s_k h d for d_qk = d_v = d), backward = five (the four gradients plus the Q K^T that fused
# kernels recompute), and no causal discount (causal kernels skip about half the tiles; the
# 6N + 12LHS formula and PaLM's MFU count them anyway). Variable-length (packed) kernels count each
# sequence on its own: sum over sequences of 4 s_i^2 h d forward. So MFU does not depend on which
# kernel ran, only on what was computed.


def _seq_lengths(cu_seqlens: torch.Tensor, max_len: int) -> list[int]:
    """Sequence lengths of a cu_seqlens tensor; max_len each when its values are unknown (meta/fake)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(cu_seqlens, FakeTensor) or cu_seqlens.device.type == "meta":
        return [int(max_len)] * (cu_seqlens.numel() - 1)
    return cu_seqlens.diff().tolist()


def varlen_attention_flops(
    query, key, value, cu_seqlens_q, cu_seqlens_k, max_q: int, max_k: int, *, grad_out=None
) -> int:
    """FLOPs of packed attention on [total, heads, dim] q/k/v: forward, or backward with grad_out."""
    _, h_q, d_q = query.shape
    _, h_k, _ = key.shape
    d_v = value.shape[-1]
    cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    total = 0
    for s_q, s_k in zip(_seq_lengths(cu_seqlens_q, max_q), _seq_lengths(cu_seqlens_k, max_k), strict=True):
        q, k, v = (1, h_q, s_q, d_q), (1, h_k, s_k, d_q), (1, h_k, s_k, d_v)
        total += sdpa_flop_count(q, k, v) if grad_out is None else sdpa_backward_flop_count((1, h_q, s_q, d_v), q, k, v)
    return total


def _bhsd(shape) -> tuple[int, int, int, int]:
    """flash-attn's [batch, seq, heads, dim] as SDPA's [batch, heads, seq, dim]."""
    b, s, h, d = shape
    return b, h, s, d


def _flash_attn_flops(q, k, v, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(_bhsd(q.shape), _bhsd(k.shape), _bhsd(v.shape))


def _flash_attn_backward_flops(dout, q, k, v, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(_bhsd(dout.shape), _bhsd(q.shape), _bhsd(k.shape), _bhsd(v.shape))


def _flash_attn_varlen_flops(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args, out_val=None, **kwargs
) -> int:
    return varlen_attention_flops(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def _flash_attn_varlen_backward_flops(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *args,
    out_val=None,
    **kwargs,
) -> int:
    return varlen_attention_flops(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, grad_out=dout)


def _torch_varlen_flops(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *args, out_val=None, **kwargs) -> int:
    return varlen_attention_flops(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)


def _torch_varlen_out_flops(
    out, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *args, out_val=None, **kwargs
) -> int:
    return varlen_attention_flops(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)


def _torch_varlen_backward_flops(
    grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, *args, out_val=None, **kwargs
) -> int:
    return varlen_attention_flops(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, grad_out=grad_out)


# Custom ops by qualified name: flash-attn registers its ops when imported (namespace flash_attn in
# 2.6-2.7, flashattn later; same arguments), which may happen after a counter is made, and Kiln
# never imports it itself. torch's varlen ops have formulas in torch's table once
# torch.nn.attention.varlen is imported (torch 2.13); Kiln's are for a torch whose table lacks them.
ATTENTION_FORMULAS_BY_NAME = {
    **{
        f"{ns}::{op}": formula
        for ns in ("flash_attn", "flashattn")
        for op, formula in (
            ("_flash_attn_forward", _flash_attn_flops),
            ("_flash_attn_backward", _flash_attn_backward_flops),
            ("_flash_attn_varlen_forward", _flash_attn_varlen_flops),
            ("_flash_attn_varlen_backward", _flash_attn_varlen_backward_flops),
        )
    },
    "torch_attn::_varlen_attn": _torch_varlen_flops,
    "torch_attn::_varlen_attn_out": _torch_varlen_out_flops,
    "torch_attn::_varlen_attn_backward": _torch_varlen_backward_flops,
}


class _FormulaTable(dict):
    """FLOP formulas by op (what FlopCounterMode looks up), plus formulas by qualified op name for
    ops that need not exist yet: an op is matched by name the first time the counter meets it."""

    def __init__(self, by_op: dict, by_name: dict):
        super().__init__(by_op)
        known = {getattr(op, "_qualified_op_name", None) for op in by_op}
        self.by_name = {name: f for name, f in by_name.items() if name not in known}

    def __contains__(self, op) -> bool:
        if dict.__contains__(self, op):
            return True
        formula = self.by_name.get(getattr(op, "_qualified_op_name", None))
        if formula is not None:
            self[op] = formula
        return formula is not None


def _shard_count(out) -> int:
    """How many ranks split the computation of a DTensor op's output (1 for plain tensors).

    torch's counter sees a DTensor op once, at global shapes, and not the local op DTensor then
    runs. An output that is sharded or partial on a mesh dimension was computed in pieces over
    that dimension; a replicated one was computed whole on every rank.
    """
    from torch.distributed.tensor import DTensor

    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, DTensor):
            mesh = leaf.device_mesh
            return math.prod(mesh.size(i) for i, p in enumerate(leaf.placements) if not p.is_replicate())
    return 1


def _local(formula):
    """A raw-argument formula that counts this rank's share of a DTensor op."""

    def count(*args, out_val=None, **kwargs):
        return formula(*args, out_val=out_val, **kwargs) // _shard_count(out_val)

    count._get_raw = True
    return count


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """torch._grouped_mm (an MoE's experts): 2 FLOPs per multiply-add, each row of a 2-D operand meeting
    one group. Forward (tokens [M, K] x experts [G, K, N]) and input gradient: 2 M K N, the tokens each
    multiplied by their one expert (so only routed, active weights count); weight gradient (grads^T
    [N, M] x tokens [M, K], grouped along M): 2 N M K; batched 3-D x 3-D: 2 G M K N."""
    if len(a_shape) == 3 and len(b_shape) == 3:
        return 2 * math.prod(a_shape) * b_shape[-1]
    return 2 * math.prod(a_shape[-2:]) * b_shape[-1]


def _formulas() -> _FormulaTable:
    # torch's registry knows the CUDA SDPA kernels (flash, efficient, cuDNN; forward and backward)
    # but not the CPU flash kernel that F.scaled_dot_product_attention picks on CPU, which would
    # then count as zero FLOPs.
    try:  # registers torch's varlen formulas in flop_registry (the module does it on import)
        import torch.nn.attention.varlen  # noqa: F401
    except ImportError:  # an older torch: Kiln's formulas below stand in
        pass
    kiln = {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_flops,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_attention_backward_flops,
        torch.ops.aten._grouped_mm: _grouped_mm_flops,  # not in torch's registry: MoE experts would count zero
    }
    raw = {**flop_registry, **{op: shape_wrapper(f) for op, f in kiln.items()}}
    return _FormulaTable(
        {op: _local(f) for op, f in raw.items()}, {name: _local(f) for name, f in ATTENTION_FORMULAS_BY_NAME.items()}
    )


class _GlobalFlopCounterMode(FlopCounterMode):
    """FlopCounterMode without its per-module breakdown: the module tracker's autograd hooks make
    pipelining's stage backward (autograd.grad) fail, and they reorder gradient accumulation
    enough to change the counted step's last bits. Its formulas are a _FormulaTable."""

    def __init__(self, formulas: _FormulaTable):
        super().__init__(display=False)
        self.flop_registry = formulas

    def __enter__(self):
        self.flop_counts.clear()
        self.mode = _FlopCounterMode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *args):
        b = self.mode.__exit__(*args)
        self.mode = None
        return b


class FlopCounter:
    """``with FlopCounter() as fc: <forward + backward + optimizer step>``; then ``fc.flops``.

    Counts the matmul, convolution and attention FLOPs that run on this rank, forward and
    backward (2 per multiply-add; elementwise ops and the optimizer update are not counted, as
    in every MFU convention). Attention is counted the same whichever kernel runs (SDPA's math,
    flash, efficient and cuDNN kernels, the CPU flash kernel, torch's varlen_attn, flash-attn's
    dense and varlen ops): without the causal discount, as the 6N + 12LHS formula and PaLM's MFU
    do, but with the Q K^T that the fused kernels recompute in backward (torch's formula: 5
    matmuls, not 4); packed rows per sequence. Activation checkpointing's recomputed
    forward is counted too, which makes the ratio a hardware rather than a model FLOPs utilization.

    ``flops`` is this rank's share in every layout, so the sum over ranks is the job's FLOPs per
    step: DTensor ops (tensor parallelism) count their global shapes once, divided over the mesh
    dimensions their output is sharded or partial on; FSDP2 computes on gathered plain weights
    and data parallel ranks each count their own batch.
    """

    def __init__(self) -> None:
        self._mode = _GlobalFlopCounterMode(_formulas())
        self.flops = 0

    def __enter__(self) -> FlopCounter:
        # The counted step runs eagerly. A dispatch mode cannot be compiled: with one present, dynamo skips a compiled
        # block's frame and marks its code to be skipped for good, so a run whose first step was counted would never
        # compile (toggles.compile=true ran eagerly on an H100, step time and memory equal to compile=false).
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(torch.compiler.set_stance("force_eager"))
        self._stack.enter_context(self._mode)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)
        self.flops = self._mode.get_total_flops()

    def by_op(self) -> dict[str, int]:
        return {str(op): n for op, n in self._mode.get_flop_counts().get("Global", {}).items()}

    def global_flops(self) -> int:
        """Sum of ``flops`` over all ranks (every rank must call it: it is a collective)."""
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.flops
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        total = torch.tensor(self.flops, dtype=torch.int64, device=device)
        dist.all_reduce(total)
        return int(total.item())


def count_step_flops(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), flops)``: FLOPs that one call of ``fn`` runs on this rank."""
    with FlopCounter() as fc:
        result = fn(*args, **kwargs)
    return result, fc.flops


# Dense (no sparsity) tensor-core peaks in TFLOP/s from NVIDIA's datasheets: H100 SXM5 / H200
# SXM ("H100 Tensor Core GPU" and "H200 Tensor Core GPU" datasheets; the sparse figures there are
# twice these), H100 PCIe, H100 NVL / H200 NVL, and A100 (SXM4 and PCIe share the peaks; "A100
# Tensor Core GPU" datasheet). fp32 is the non-tensor-core rate; tf32 is fp32 matmuls on tensor
# cores (toggles.tf32). A100 has no fp8.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0},
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
    "H200 SXM": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
    "H200 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
}


def gpu_model(device_name: str) -> str | None:
    """The PEAK_TFLOPS row of a ``torch.cuda.get_device_name()`` string, or None.

    Names seen: "NVIDIA H100 80GB HBM3" (SXM5), "NVIDIA H100 PCIe", "NVIDIA H100 NVL",
    "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe".
    """
    name = device_name.upper()
    for chip in ("H200", "H100"):
        if chip in name:
            if "NVL" in name:
                return f"{chip} NVL"
            return "H100 PCIe" if chip == "H100" and "PCIE" in name else f"{chip} SXM"
    return "A100" if "A100" in name else None


def precision_key(toggles) -> str:
    """The PEAK_TFLOPS column for Kiln's toggles: fp32 matmuls run as tf32 when toggles.tf32 is on."""
    return "tf32" if toggles.precision == "fp32" and toggles.tf32 else toggles.precision


def peak_flops(device: torch.device | str, precision: str, override: float | None = None) -> float:
    """Peak FLOP/s of one device: ``override`` if given, the datasheet table on a known GPU, or a
    measured fp32/bf16 matmul rate on CPU. An unknown GPU raises ValueError (pass override)."""
    if override is not None:
        if override <= 0:
            raise ValueError(f"peak FLOP/s override must be positive, got {override}")
        return float(override)
    device = torch.device(device)
    if device.type == "cpu":
        dtype = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16}.get(precision)
        if dtype is None:
            raise ValueError(f"no CPU matmul peak for precision {precision!r} (fp32, bf16)")
        return measure_cpu_matmul_peak(dtype)
    if device.type != "cuda":
        raise ValueError(f"no peak FLOP/s for device type {device.type!r}; pass override")
    name = torch.cuda.get_device_name(device)
    model = gpu_model(name)
    if model is None:
        raise ValueError(f"no peak FLOP/s table for {name!r} (known: {', '.join(PEAK_TFLOPS)}); pass override")
    table = PEAK_TFLOPS[model]
    if precision not in table:
        raise ValueError(f"{model} has no {precision} peak (has {', '.join(table)})")
    return table[precision] * 1e12


def measure_cpu_matmul_peak(dtype: torch.dtype = torch.float32) -> float:
    """Matmul FLOP/s of this process's CPU threads: one thread's best rate times torch's thread
    count (under torchrun, OMP_NUM_THREADS=1: the rate of one rank).

    Measured on one thread because a multi-threaded matmul waits for its slowest thread: on a
    shared 2-core machine two threads measured 3 to 68 GFLOP/s from run to run, one thread a
    steady 100 (and two threads 198 when the machine was quiet). Cached per process.
    """
    return torch.get_num_threads() * _one_thread_matmul_peak(dtype)


@functools.cache
def _one_thread_matmul_peak(dtype: torch.dtype, size: int = 512, repeats: int = 40) -> float:
    """Best of ``repeats`` ``size``-square matmuls after a warm-up (oneDNN/MKL pick kernels,
    buffers page in); a few ms each, so the best one ran without being preempted."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)  # the global RNG belongs to training: resume must replay it
        a, b = (torch.randn(size, size, generator=gen).to(dtype) for _ in range(2))
        out = torch.mm(a, b)
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * size**3 / best


def mfu(flops_per_step: float, step_time_s: float, peak: float, world_size: int = 1) -> float:
    """Model FLOPs utilization: the job's FLOPs per step over what ``world_size`` devices at
    ``peak`` FLOP/s could do in the step's time."""
    return flops_per_step / (step_time_s * peak * world_size)
