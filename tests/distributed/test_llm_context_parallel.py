"""Context parallelism (parallel.cp=2) on packed documents, against one process: the attention of random documents
under cp_method=allgather and alltoall (outputs and gradients, fp32) equals SDPA with the whole row's document + causal
mask, and
llm_tiny's per-step losses equal the single-process run's, at cp=2 and at cp=2 x pp=2 (4 ranks); moe_tiny's at cp=2, its
auxiliary losses and expert load counted over the whole rows."""

from __future__ import annotations

import json

import pytest
import torch

from common.tools.launcher import spawn_ranks
from tests.conftest import losses, run_train
from tests.fixtures.runs import LLM_10_STEPS, MOE_16_STEPS

pytestmark = pytest.mark.distributed
CP = 2
METHODS = ("allgather", "alltoall")
ROW_LEN = 48  # divisible by 2 * CP
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def _random_batch():
    """Two packed rows of random documents (one row ends in padding), and q/k/v for the whole rows."""
    from common.data.packing import pack_samples

    g = torch.Generator().manual_seed(0)
    lengths = [17, 5, 20, 9, 13, 30]  # rows: [30, 17] + padding and [20, 13, 9, 5] (FFD)
    docs = [torch.randint(0, 100, (n,), generator=g) for n in lengths]
    packed = pack_samples([{"input_ids": d, "labels": d} for d in docs], ROW_LEN, pad_id=0)
    shapes = {"q": HEADS, "k": KV_HEADS, "v": KV_HEADS}
    qkv = {name: torch.randn(packed.num_rows, ROW_LEN, h, HEAD_DIM, generator=g) for name, h in shapes.items()}
    return packed, qkv, torch.randn(packed.num_rows, ROW_LEN, HEADS, HEAD_DIM, generator=g)


def _cp_attention(method: str) -> dict:
    """On each cp rank: its queries' attention under `method` (keys/values gathered, or heads exchanged), and the
    gradients of its slices of q, k, v (from the same upstream gradient as the reference)."""
    import torch.distributed as tdist

    from recipes.llm.context_parallel import ContextShard, chunk_positions
    from recipes.llm.model import attend

    packed, qkv, upstream = _random_batch()
    rank = tdist.get_rank()
    idx = chunk_positions(ROW_LEN, CP, rank)
    shard = ContextShard.of(packed, CP, rank, method)
    mine = {name: t[:, idx].clone().requires_grad_() for name, t in qkv.items()}
    out = attend(
        mine["q"], mine["k"], mine["v"], shard.model_inputs(tdist.group.WORLD, torch.device("cpu"))["attn_mask"]
    )
    (out * upstream[:, idx]).sum().backward()
    result = {"idx": idx.tolist(), "out": out.detach().tolist()}
    return result | {f"grad_{name}": t.grad.tolist() for name, t in mine.items()}


@pytest.mark.parametrize("method", METHODS)
def test_cp_attention_matches_unsplit_masked_attention(tmp_path, method):
    from recipes.llm.model import attend

    packed, qkv, upstream = _random_batch()
    ref = {name: t.clone().requires_grad_() for name, t in qkv.items()}
    expected = attend(ref["q"], ref["k"], ref["v"], packed.attention_mask_4d())
    (expected * upstream).sum().backward()

    got = {
        key: torch.zeros_like(qkv["q"] if key in ("out", "grad_q") else qkv["k"])
        for key in ("out", "grad_q", "grad_k", "grad_v")
    }
    for rank in spawn_ranks(_cp_attention, (method,), CP, tmp_path):
        idx = torch.tensor(rank["idx"])
        for key in got:  # back into row order
            got[key][:, idx] = torch.tensor(rank[key])
    reference = {"out": expected.detach(), "grad_q": ref["q"].grad, "grad_k": ref["k"].grad, "grad_v": ref["v"].grad}
    for key, want in reference.items():
        err = (got[key] - want).abs().max().item()
        print(f"cp={CP} {method} {key}: max |cp - unsplit| = {err:.1e} (max |unsplit| {want.abs().max().item():.1e})")
        assert want.abs().max() > 0 and err <= 1e-5, key


def test_a_document_never_sees_another_or_a_later_token():
    """The shard's mask is the whole row's mask at the rank's query rows and the gathered key columns."""
    from recipes.llm.context_parallel import ContextShard, chunk_positions, gathered_positions

    packed, _, _ = _random_batch()
    full = packed.attention_mask_4d()
    keys = gathered_positions(ROW_LEN, CP)
    assert sorted(keys.tolist()) == list(range(ROW_LEN))
    for rank in range(CP):
        idx = chunk_positions(ROW_LEN, CP, rank)
        n = ROW_LEN // (2 * CP)
        assert idx.tolist() == [*range(rank * n, (rank + 1) * n), *range((2 * CP - 1 - rank) * n, (2 * CP - rank) * n)]
        shard = ContextShard.of(packed, CP, rank)
        assert torch.equal(shard.mask, full[:, :, idx][..., keys])
        assert shard.mask.shape == (packed.num_rows, 1, ROW_LEN // CP, ROW_LEN)
        # alltoall: every token of the row attends (with this rank's heads), in the gathered order on both axes.
        assert torch.equal(ContextShard.of(packed, CP, rank, "alltoall").mask, full[:, :, keys][..., keys])
    assert sum(ContextShard.of(packed, CP, r).num_labels for r in range(CP)) == packed.num_labels
    assert sum(ContextShard.of(packed, CP, r).num_real_tokens for r in range(CP)) == packed.num_real_tokens


@pytest.fixture(scope="module")
def runs(trained):
    """The single-process reference is test_llm_layouts' (the same arguments: one cached run); the cp=2 run the same
    arguments on 2 ranks (its step-5 checkpoint resumes under cp=1 below)."""
    single = [*LLM_10_STEPS, "trainer.micro_batch_size=8"]
    return trained(single), trained([*single, f"parallel.cp={CP}"], nproc=CP)


def test_cp2_losses_match_single_process(runs):
    ref, got = (losses(r) for r in runs)
    assert sorted(got) == sorted(ref) == list(range(1, 11))
    worst = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in ref)
    print(f"llm_tiny cp={CP} vs one process: max relative loss difference over {len(ref)} steps = {worst:.1e}")
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    assert ref[10] < ref[1]
    # The held-out loss too: the same documents, the same token count, under the split.
    ref_eval, got_eval = (json.loads((r / "eval.json").read_text()) for r in runs)
    assert got_eval["val_tokens"] == ref_eval["val_tokens"]
    assert got_eval["val_loss"] == pytest.approx(ref_eval["val_loss"], rel=1e-5)


def test_cp2_pp2_losses_match_single_process(runs, trained):
    """cp x pp on 4 ranks: each stage holds its cp rank's chunks of every pipeline microbatch (the padding rows of a
    round too) and the rank's rows of their masks, and exchanges keys/values with the other cp rank of its stage.
    A stage that saw another chunk's mask, positions or targets would move the losses by far more than 1e-5."""
    ref_run = runs[0]
    run_dir = trained([*LLM_10_STEPS, "trainer.micro_batch_size=8", f"parallel.cp={CP}", "parallel.pp=2"], nproc=4)
    ref, got = losses(ref_run), losses(run_dir)
    assert sorted(got) == sorted(ref) == list(range(1, 11))
    worst = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in ref)
    print(f"llm_tiny cp={CP} x pp=2 vs one process: max relative loss difference over {len(ref)} steps = {worst:.1e}")
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    ref_eval, got_eval = (json.loads((r / "eval.json").read_text()) for r in (ref_run, run_dir))
    assert got_eval["val_tokens"] == ref_eval["val_tokens"]
    assert got_eval["val_loss"] == pytest.approx(ref_eval["val_loss"], rel=1e-5)


def test_moe_cp2_matches_single_process(trained):
    """moe_tiny at cp=2 on 2 ranks against test_moe_tiny's one-process run: each cp rank routes its chunks of the rows,
    and the routing statistics (tokens per expert, token count) are summed over dp x cp before the load-balancing and
    z losses are formed, so the losses, the aux terms and each layer's expert load are the whole rows' (counted per cp
    chunk instead, the aux term moved by up to 2e-3 relative, the z term by 1e-2 and the layer-1 load by 2% here)."""
    from common.metrics import read_metrics

    # The cp run skips the held-out eval (compared by the llm_tiny tests above): ~4 s less.
    ref_run = trained(MOE_16_STEPS)
    cp_run = trained([*MOE_16_STEPS, f"parallel.cp={CP}", "trainer.eval=false"], nproc=CP)
    ref, got = ({r["step"]: r for r in read_metrics(run / "metrics.jsonl")} for run in (ref_run, cp_run))
    assert sorted(got) == sorted(ref) == [4, 8, 12, 16]
    keys = ["loss", "aux_loss", "z_loss", *(k for k in ref[4] if k.startswith("moe.layer") and k.endswith("max_load"))]
    assert len(keys) == 6  # 3 MoE layers
    worst = {k: max(abs(got[s][k] - ref[s][k]) / abs(ref[s][k]) for s in ref) for k in keys}
    print(f"moe_tiny cp={CP} vs one process, max relative difference over steps 4-16: {worst}")
    for step in ref:
        for key in keys:
            assert got[step][key] == pytest.approx(ref[step][key], rel=1e-5), (step, key)


@pytest.mark.parametrize("direction", ["cp2_to_cp1", "cp1_to_cp2"])
def test_checkpoint_resumes_across_cp(runs, tmp_path, direction):
    """DCP reshards over the mesh: a checkpoint written at cp=2 resumes in one process (and one written in one process
    resumes at cp=2) with the uninterrupted run's losses."""
    ref_run, cp_run = runs
    source, nproc, extra = (cp_run, 1, []) if direction == "cp2_to_cp1" else (ref_run, CP, [f"parallel.cp={CP}"])
    resumed = tmp_path / "resumed"
    run_train(
        [
            *LLM_10_STEPS,
            "trainer.micro_batch_size=8",
            "trainer.eval=false",
            "checkpoint.final=false",
            *extra,
            f"run.dir={resumed}",
            f"run.resume={source / 'checkpoints' / 'step_0000005'}",
        ],
        nproc=nproc,
    )
    ref, got = losses(ref_run), losses(resumed)
    assert sorted(got) == list(range(6, 11))
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
