"""FLOP counting (tiny Llama vs 6N + attention, TP and FSDP2 shares, the three recipes' train steps),
peak FLOP/s tables, measured CPU peak, MFU."""

from __future__ import annotations

import importlib
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.flops import (PEAK_TFLOPS, FlopCounter, _one_thread_matmul_peak, count_step_flops, gpu_model, mfu,
                          peak_flops, precision_key)
from recipes.llm.model import LLAMA_CONFIGS, Transformer, flops_per_token

ARGS = LLAMA_CONFIGS["llm_tiny"]
BATCH, SEQ = 2, 128

# torch counts SDPA backward as 5 matmuls (the 4 of the gradients plus the recomputed Q K^T that
# flash/efficient kernels redo), the 6N + 12LHS formula as 4: counted attention = 3.5/3 of it.
SDPA_BACKWARD_RECOMPUTE = 3.5 / 3


def llama_step(model: torch.nn.Module, tokens: torch.Tensor) -> None:
    logits = model(tokens)
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()


def tiny_llama() -> tuple[Transformer, torch.Tensor]:
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return model, tokens


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


# ---- processes with a process group ------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, job: str, args: tuple, out: str) -> None:
    # gloo on the CPU, on any host: with a GPU visible init_distributed would pick NCCL and cuda:<rank>
    # (the meshes below are CPU meshes). CUDA reads the variable when first used, after this line.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    torch.set_num_threads(1)
    from common.distributed import init_distributed, teardown

    init_distributed()
    try:
        result = globals()[job](*args)
    finally:
        teardown()
    Path(out, f"{rank}.json").write_text(json.dumps(result))


def run_ranks(job: str, args: tuple, world: int, tmp_path: Path) -> list:
    torch.multiprocessing.spawn(_worker, args=(world, _free_port(), job, args, str(tmp_path)), nprocs=world)
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]


def _parallel_llama_flops() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from recipes.llm.parallelize import apply_fsdp, apply_tp

    world = dist.get_world_size()
    model, tokens = tiny_llama()
    apply_tp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), loss_parallel=False)
    with FlopCounter() as tp:
        llama_step(model, tokens)
    model, tokens = tiny_llama()
    apply_fsdp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), "fp32")
    with FlopCounter() as fsdp:
        llama_step(model, tokens)
    return {"tp": tp.flops, "tp_global": tp.global_flops(), "fsdp": fsdp.flops}


def test_parallel_ranks_count_their_share(tmp_path):
    """DTensor ops are seen at global shapes: each TP rank must report half the work. FSDP2 ranks
    gather whole weights and run their own batch: each reports all of it."""
    model, tokens = tiny_llama()
    _, single = count_step_flops(llama_step, model, tokens)
    ranks = run_ranks("_parallel_llama_flops", (), 2, tmp_path)
    assert [r["tp"] for r in ranks] == [single // 2, single // 2]
    assert all(r["tp_global"] == single and r["fsdp"] == single for r in ranks)


TRAINERS = {"dit": "DiTTrainer", "vlm": "VLMTrainer", "llm": "LLMTrainer"}


def _recipe_step_flops(overrides: list[str]) -> dict:
    from common.distributed import init_distributed
    from common.launch import compose
    from common.profiling import StepTimer

    cfg = compose(overrides)
    family = cfg.recipe.family
    trainer = getattr(importlib.import_module(f"recipes.{family}.train"), TRAINERS[family])(
        cfg, init_distributed(), Path(cfg.run.dir))
    trainer.batches = iter(trainer.loader)
    try:
        with FlopCounter() as fc:
            stats = trainer.train_step(StepTimer())
        # The same step's forward alone: backward should add about twice the forward.
        with FlopCounter() as forward, torch.no_grad():
            if family == "llm":
                trainer.micro_step_loss(next(trainer.batches))
            elif family == "dit":
                trainer.diffusion_loss(next(trainer.batches))
    finally:
        trainer.loader.close()
    result = {"flops": fc.flops, "forward": forward.flops, "by_op": fc.by_op()}
    if family == "llm":  # the model computes on every slot of its packed rows, padding included
        slots = round(stats["tokens"] / stats["token_utilization"])
        linear, seq = flops_per_token(trainer.args, 0), cfg.data.max_seq_len
        result["expected"] = slots * (linear + (flops_per_token(trainer.args, seq) - linear) * SDPA_BACKWARD_RECOMPUTE)
        result["formula"] = slots * flops_per_token(trainer.args, seq)
    return result


@pytest.mark.parametrize("recipe", ["dit_tiny", "vlm_tiny", "llm_tiny"])
def test_counts_a_recipe_train_step(recipe, tmp_path):
    """DeepSpeed engines (DiT, VLM) and the plain FSDP-less Llama step count through the Trainer."""
    overrides = [f"recipe={recipe}", "trainer.micro_batch_size=4", "data.num_workers=0", "checkpoint.final=false",
                 f"run.dir={tmp_path / 'run'}"]
    [result] = run_ranks("_recipe_step_flops", (overrides,), 1, tmp_path)
    assert result["flops"] > 0 and any("mm" in op for op in result["by_op"])
    if recipe == "llm_tiny":
        assert result["flops"] == pytest.approx(result["expected"], rel=1e-9)
        print(f"llm_tiny train step: counted / (6N + 12LHS) = {result['flops'] / result['formula']:.4f}")
    if result["forward"]:  # forward + backward = 3x forward for matmuls, a little more with attention
        assert 2.9 < result["flops"] / result["forward"] < 3.5


# ---- peaks and MFU -----------------------------------------------------------------------------

@pytest.mark.parametrize("name,model", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200 SXM"), ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100"), ("NVIDIA A100-SXM4-40GB", "A100"), ("NVIDIA GeForce RTX 4090", None),
])
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
    print(f"CPU fp32 matmul peak {peak / 1e9:.1f} GFLOP/s measured in {elapsed:.2f} s "
          f"({torch.get_num_threads()} threads)")
    assert peak > 1e8 and elapsed < 1.5  # < 1 s on an idle machine; slack for shared CI cores
    assert peak_flops("cpu", "fp32") == peak  # cached per process


def test_mfu():
    # 1 TFLOP per step over 2 devices of 1 TFLOP/s in 1 s: half the capacity used.
    assert mfu(1e12, 1.0, 1e12, world_size=2) == pytest.approx(0.5)
