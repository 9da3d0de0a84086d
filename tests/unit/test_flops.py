"""FLOP counting (tiny Llama vs 6N + attention, every attention kernel a run may use against a hand
count), peak FLOP/s tables, measured CPU peak, MFU. On ranks and in real train steps:
tests/distributed/test_flops_ranks.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.flops import (
    ATTENTION_FORMULAS_BY_NAME,
    PEAK_TFLOPS,
    FlopCounter,
    _one_thread_matmul_peak,
    count_step_flops,
    gpu_model,
    mfu,
    peak_flops,
    precision_key,
)
from recipes.llm.model import Transformer
from tests.fixtures.flops import ARGS, BATCH, SDPA_BACKWARD_RECOMPUTE, SEQ, flops_per_token, llama_step, tiny_llama


def expected_llama_flops(slots: int, seq: int) -> tuple[float, float]:
    """(6 N per slot, attention per slot) of recipes/llm/model.py's estimate."""
    linear = flops_per_token(ARGS, 0)
    return linear * slots, (flops_per_token(ARGS, seq) - linear) * slots


def test_llama_counted_flops_match_6n_plus_attention():
    model, tokens = tiny_llama()
    _, flops = count_step_flops(llama_step, model, tokens)
    with FlopCounter() as fc:
        llama_step(model, tokens)
    by_op = fc.by_op()
    linear, attention = expected_llama_flops(BATCH * SEQ, SEQ)
    # Every matmul is a weight of N: 2N forward + 4N backward per token, exactly. The embedding is
    # a lookup (not in N, no FLOPs); the lm head is in N. The first layer's input gradient is
    # still computed (the embedding table needs it), so there is no "missing first layer" term.
    assert by_op["aten.mm"] == linear
    cpu_attention = sum(v for k, v in by_op.items() if "attention" in k)
    assert cpu_attention == pytest.approx(attention * SDPA_BACKWARD_RECOMPUTE, rel=1e-12)
    assert flops == fc.flops
    ratio = fc.flops / (linear + attention)
    print(f"counted / (6N + 12LHS) = {ratio:.4f} (llm_tiny, seq {SEQ})")
    assert 1.0 < ratio < 1.0 + (SDPA_BACKWARD_RECOMPUTE - 1)  # only attention's recompute differs


def test_moe_experts_count_their_routed_tokens_only():
    """An MoE step counts the active parameters: every token through the router, its top_k experts and the
    shared expert, none of the other experts' weights (the grouped GEMM has its own formula; torch's
    registry has none, and the experts would count zero)."""
    import dataclasses

    from recipes.llm.model import MoEArgs

    moe = MoEArgs(num_experts=8, top_k=2, ffn_dim=64, shared_ffn_dim=32, first_dense_layers=0, interval=1)
    args = dataclasses.replace(ARGS, moe=moe, head_dim=ARGS.head_dim)
    model = Transformer(args)
    model.init_weights(seed=0)
    tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with FlopCounter() as fc:
        llama_step(model, tokens)
    by_op = fc.by_op()
    a, n = args, BATCH * SEQ
    experts = 6 * n * a.n_layers * moe.top_k * 3 * a.dim * moe.ffn_dim  # routed tokens only, 2 fwd + 4 bwd
    assert by_op["aten._grouped_mm"] == experts
    attention = 2 * a.dim * a.n_heads * a.head_dim + 2 * a.dim * a.n_kv_heads * a.head_dim
    dense = (
        a.n_layers * (attention + a.dim * moe.num_experts + 3 * a.dim * moe.shared_ffn_dim + a.dim)
        + a.dim * a.vocab_size
    )
    assert by_op["aten.mm"] == 6 * n * dense  # router, shared expert and its gate, attention, lm head
    total_params = sum(p.numel() for p in model.parameters())
    print(f"moe step: {fc.flops:.3e} FLOPs; experts {experts / fc.flops:.0%}; params {total_params}")


# ---- every attention kernel, against a hand count ------------------------------------------------
# Hand counts: Q K^T and P V are 2 s_q s_k d multiply-adds per head, 2 FLOPs each -> 4 s_q s_k h d
# forward; backward is 5 such matmuls (torch's SDPA formula, recompute included) -> 10 s_q s_k h d.
# No causal discount. Packed kernels: per sequence. GPU kernels run on the meta device (their meta
# kernels give the shapes), cu_seqlens stay on the CPU so the counter reads the real lengths.
B, H, H_KV, S, D = 2, 4, 2, 64, 32
LENGTHS = [10, 30, 60]  # three packed documents
CU = torch.tensor([0, 10, 40, 100], dtype=torch.int32)


def hand_forward(lengths: list[int], heads: int = H, dim: int = D) -> int:
    return sum(4 * s * s * heads * dim for s in lengths)


def meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=torch.bfloat16)


def test_torch_sdpa_gpu_kernels_count_like_sdpa():
    """flash, efficient and cuDNN SDPA kernels, forward and backward (torch 2.13 has their formulas)."""
    q = meta(B, H, S, D)
    aten = torch.ops.aten
    with FlopCounter() as fc:
        out, lse, cu_q, cu_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(q, q, q)
        aten._scaled_dot_product_flash_attention_backward(
            out, q, q, q, out, lse, cu_q, cu_k, max_q, max_k, 0.0, False, seed, offset
        )
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, q, q, None, True)
        aten._scaled_dot_product_efficient_attention_backward(
            out, q, q, q, None, out, lse, seed, offset, 0.0, [True, True, True, False]
        )
        out, lse, cu_q, cu_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
            q, q, q, None, True
        )
        aten._scaled_dot_product_cudnn_attention_backward(
            out, q, q, q, out, lse, seed, offset, meta(0), meta(0), meta(0), S, S, 0.0, False
        )
    forward = B * hand_forward([S])
    assert fc.by_op() == {
        f"aten._scaled_dot_product_{kernel}_attention{part}": forward * (2.5 if part else 1)
        for kernel in ("flash", "efficient", "cudnn")
        for part in ("", "_backward")
    }


def test_torch_varlen_attention_counts_each_sequence():
    """torch.nn.attention.varlen.varlen_attn's ops (GQA: 4 query heads over 2 kv heads), through the counter."""
    import torch.nn.attention.varlen  # noqa: F401  (defines the torch_attn ops)

    q, kv = meta(100, H, D), meta(100, H_KV, D)
    with FlopCounter() as fc:
        out, lse, rng = torch.ops.torch_attn._varlen_attn(q, kv, kv, CU, CU, 60, 60, True, None, [-1, 0], True)
        torch.ops.torch_attn._varlen_attn_backward(out, q, kv, kv, out, lse, CU, CU, 60, 60, True, rng)
    assert fc.by_op() == {
        "torch_attn._varlen_attn": hand_forward(LENGTHS),
        "torch_attn._varlen_attn_backward": hand_forward(LENGTHS) * 5 // 2,
    }
    # Kiln's stand-ins for a torch without these formulas count the same, also with unknown lengths
    # (meta cu_seqlens: every sequence as long as the longest).
    fwd, bwd = (ATTENTION_FORMULAS_BY_NAME[f"torch_attn::_varlen_attn{p}"] for p in ("", "_backward"))
    assert fwd(q, kv, kv, CU, CU, 60, 60, True) == hand_forward(LENGTHS)
    assert bwd(out, q, kv, kv, out, lse, CU, CU, 60, 60, True, rng) == hand_forward(LENGTHS) * 5 // 2
    assert fwd(q, kv, kv, CU.to("meta"), CU.to("meta"), 60, 60, True) == hand_forward([60, 60, 60])


@pytest.mark.parametrize("ns", ["flash_attn", "flashattn"])
def test_flash_attn_package_ops(ns):
    """flash-attn's custom ops (its [batch, seq, heads, dim] and packed [total, heads, dim] layouts),
    called with flash-attn's argument order; flash-attn itself is never imported."""
    f = {
        op: ATTENTION_FORMULAS_BY_NAME[f"{ns}::_flash_attn_{op}"]
        for op in ("forward", "backward", "varlen_forward", "varlen_backward")
    }
    q, kv = meta(B, S, H, D), meta(B, S, H_KV, D)
    assert f["forward"](q, kv, kv, 0.0, D**-0.5, True, -1, 0, 0.0, None, False) == B * hand_forward([S])
    assert (
        f["backward"](q, q, kv, kv, q, None, None, None, None, 0.0, D**-0.5, True, -1, 0, 0.0, None, False)
        == B * hand_forward([S]) * 5 // 2
    )
    q, kv = meta(100, H, D), meta(100, H_KV, D)
    assert f["varlen_forward"](q, kv, kv, CU, CU, 60, 60, 0.0, D**-0.5, True) == hand_forward(LENGTHS)
    assert (
        f["varlen_backward"](
            q, q, kv, kv, q, None, None, None, None, CU, CU, 60, 60, 0.0, D**-0.5, True, -1, 0, 0.0, None, False
        )
        == hand_forward(LENGTHS) * 5 // 2
    )


def test_ops_named_in_the_table_count_even_when_registered_after_the_counter(monkeypatch):
    """flash-attn registers its ops when imported, possibly after a FlopCounter exists: the counter
    matches ops by name when it first meets them. A CPU op stands in under a test namespace."""
    monkeypatch.setitem(
        ATTENTION_FORMULAS_BY_NAME,
        "kiln_flops_test::bshd_attention",
        ATTENTION_FORMULAS_BY_NAME["flash_attn::_flash_attn_forward"],
    )
    counter = FlopCounter()

    @torch.library.custom_op("kiln_flops_test::bshd_attention", mutates_args=())
    def bshd_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2).contiguous()

    q = torch.randn(B, S, H, D)
    with counter:
        bshd_attention(q, q, q)
    assert counter.by_op() == {"kiln_flops_test.bshd_attention": B * hand_forward([S])}


# ---- peaks and MFU -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,model",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA A100-SXM4-40GB", "A100"),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_gpu_names_match_datasheet_rows(name, model):
    assert gpu_model(name) == model


def test_datasheet_peaks_are_dense():
    assert PEAK_TFLOPS["H100 SXM"]["bf16"] == 989.4  # 1979 with sparsity
    assert PEAK_TFLOPS["H200 SXM"] == PEAK_TFLOPS["H100 SXM"]  # same compute, more and faster memory
    assert PEAK_TFLOPS["A100"]["bf16"] == 312.0 and "fp8" not in PEAK_TFLOPS["A100"]
    for row in PEAK_TFLOPS.values():  # the datasheets' ratios: tf32 half of bf16, fp8 twice
        assert row["fp16"] == row["bf16"]
        assert row["tf32"] == pytest.approx(row["bf16"] / 2, rel=1e-3)
        assert "fp8" not in row or row["fp8"] == pytest.approx(2 * row["bf16"], rel=1e-3)


def test_peak_flops_on_gpu_uses_the_table(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops("cuda:0", "bf16") == 989.4e12
    assert peak_flops("cuda:0", "tf32") == 494.7e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match="no fp8 peak"):
        peak_flops("cuda:0", "fp8")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    with pytest.raises(ValueError, match="pass override"):
        peak_flops("cuda:0", "bf16")
    assert peak_flops("cuda:0", "bf16", override=1e15) == 1e15


def test_precision_key_maps_tf32_toggle():
    from types import SimpleNamespace as NS

    assert precision_key(NS(precision="fp32", tf32=True)) == "tf32"
    assert precision_key(NS(precision="fp32", tf32=False)) == "fp32"
    assert precision_key(NS(precision="bf16", tf32=True)) == "bf16"


def test_cpu_peak_is_measured_fast_and_cached():
    import time

    _one_thread_matmul_peak.cache_clear()
    start = time.perf_counter()
    peak = peak_flops("cpu", "fp32")
    elapsed = time.perf_counter() - start
    print(
        f"CPU fp32 matmul peak {peak / 1e9:.1f} GFLOP/s measured in {elapsed:.2f} s ({torch.get_num_threads()} threads)"
    )
    assert peak > 1e8 and elapsed < 1.5  # < 1 s on an idle machine; slack for shared CI cores
    assert peak_flops("cpu", "fp32") == peak  # cached per process


def test_mfu():
    # 1 TFLOP per step over 2 devices of 1 TFLOP/s in 1 s: half the capacity used.
    assert mfu(1e12, 1.0, 1e12, world_size=2) == pytest.approx(0.5)


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def test_a_counted_step_leaves_compiled_modules_compiling():
    # Every fresh run counts its first step's FLOPs (profile.count_flops). That step must not stop torch.compile for the
    # rest of the run: under a dispatch mode dynamo skips a compiled module's frame and marks its code to be skipped.
    import torch._dynamo

    torch._dynamo.reset()
    block = _Mlp()  # a module of its own: dynamo does not trace torch.nn's own forwards as the compiled frame
    block.compile(backend="eager")  # dynamo's decision is what is tested, not a backend
    x = torch.randn(4, 8)
    with FlopCounter() as counter:
        block(x).sum().backward()
    assert counter.flops == 5 * 2 * 4 * 8 * 16  # 2 matmuls forward, 3 backward (x needs no gradient)
    torch._dynamo.utils.counters.clear()
    block(x).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
