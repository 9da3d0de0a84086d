"""The LLM's varlen attention path (toggles.attention=flash): the cu_seqlens it hands the kernel describe exactly
the dense mask's attention pattern (whole batch, pipeline microbatches, padded rows), and the model gives the
dense path's logits and gradients with a CPU stand-in for the kernel (the real kernel: the gpu-marked test)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from common.data.packing import cu_seqlens_of_rows, pack_samples
from common.errors import ConfigError
from common.toggles import _save_matmuls
from recipes.llm import model as llm_model
from recipes.llm.data import model_inputs
from recipes.llm.model import LlamaArgs, Transformer
from recipes.llm.pipeline_parallel import _stage_view, _VarlenStage, pad_rows
from recipes.llm.sizing import memory_spec
from scripts.kiln.launch import compose

ARGS = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=128, max_seq_len=64)
ROW = 48
PAD = 0


def _batch(n: int = 11, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        ids = torch.randint(1, ARGS.vocab_size, (int(torch.randint(2, 30, (), generator=g)),), generator=g)
        samples.append({"input_ids": ids, "labels": ids})
    batch = pack_samples(samples, ROW, PAD)
    assert batch.num_rows > 2 and any(sum(lens) < ROW for lens in batch.seq_lens), "want several rows, some padded"
    return batch


def allowed_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[T, T] bool over the flattened tokens, built from the boundaries alone: i may attend j iff both lie
    in the same segment [a, b) and j <= i."""
    allowed = torch.zeros(total, total, dtype=torch.bool)
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        allowed[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    return allowed


def dense_as_flat(mask_4d: torch.Tensor) -> torch.Tensor:
    """[R, 1, L, L] per-row masks as one [R*L, R*L] matrix: rows never attend to each other."""
    rows, _, length, _ = mask_4d.shape
    return torch.block_diag(*mask_4d[:, 0]) if rows else torch.zeros(0, 0, dtype=torch.bool)


def test_cu_seqlens_describe_exactly_the_dense_mask():
    batch = _batch()
    total = batch.input_ids.numel()
    assert torch.equal(allowed_from_cu_seqlens(batch.cu_seqlens, total), dense_as_flat(batch.attention_mask_4d()))
    # What the trainer hands the kernel is that batch's cu_seqlens, and the row form gives them back.
    segments = model_inputs(batch, "flash", torch.device("cpu"))["attn_mask"]
    cu, longest = cu_seqlens_of_rows(batch.row_segments())
    assert torch.equal(segments.cu_seqlens, batch.cu_seqlens) and torch.equal(cu, batch.cu_seqlens)
    assert segments.max_seqlen == longest == int(batch.cu_seqlens.diff().max())
    assert "attn_mask" in model_inputs(batch, "sdpa", torch.device("cpu"))


@pytest.mark.parametrize("microbatches", [2, 3])
def test_each_pipeline_microbatch_gets_its_own_segments(microbatches):
    # As the pipeline runs it: the batch padded with empty rows, then split by the schedule's own splitter.
    batch = _batch(seed=1)
    rows = batch.num_rows + 2
    flash, dense = pad_rows(batch, rows, PAD, "flash"), pad_rows(batch, rows, PAD, "sdpa")
    _, chunks = split_args_kwargs_into_chunks(
        (), {"row_segments": flash["row_segments"], "attn_mask": dense["attn_mask"]}, microbatches
    )
    assert len(chunks) == microbatches
    for chunk in chunks:
        cu, longest = cu_seqlens_of_rows(chunk["row_segments"])
        mask = chunk["attn_mask"]
        assert int(cu[-1]) == mask.shape[0] * ROW and longest == int(cu.diff().max())
        assert torch.equal(allowed_from_cu_seqlens(cu, int(cu[-1])), dense_as_flat(mask))


def per_segment_sdpa(calls: list):
    """CPU stand-in for torch's varlen kernel: causal SDPA within each segment, GQA by SDPA's enable_gqa."""

    def varlen(q, k, v, cu_seqlens, max_seqlen):
        calls.append(max_seqlen)
        assert q.dim() == 3 and cu_seqlens.dtype == torch.int32 and int(cu_seqlens[-1]) == q.shape[0]
        assert k.shape[1] == ARGS.n_kv_heads, "K/V reach the kernel unrepeated"
        out = torch.empty_like(q)
        for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            seg = [t[a:b].transpose(0, 1) for t in (q, k, v)]
            out[a:b] = F.scaled_dot_product_attention(*seg, is_causal=True, enable_gqa=True).transpose(0, 1)
        return out

    return varlen


def _model() -> Transformer:
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    return model


def test_varlen_path_gives_the_dense_logits_and_gradients(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(llm_model, "varlen_attention", per_segment_sdpa(calls))
    batch = _batch(seed=2)
    results = {}
    for attention in ("sdpa", "flash"):
        model = _model()
        logits = model(batch.input_ids, **model_inputs(batch, attention, torch.device("cpu")))
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch.labels[:, 1:].flatten(), ignore_index=-100)
        loss.backward()
        results[attention] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    assert calls == [batch.max_seqlen] * ARGS.n_layers  # the flash path really ran the kernel, once per layer
    torch.testing.assert_close(results["flash"][0], results["sdpa"][0], atol=1e-5, rtol=0)
    for name, grad in results["sdpa"][1].items():
        torch.testing.assert_close(results["flash"][1][name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_pipeline_stage_runs_each_microbatch_on_its_segments(monkeypatch):
    monkeypatch.setattr(llm_model, "varlen_attention", per_segment_sdpa([]))
    batch = _batch(seed=3)
    model = _model().eval()
    stage = _VarlenStage(_stage_view(model, list(range(ARGS.n_layers)), first=True, last=True))
    rows = batch.num_rows + 1
    flash, dense = pad_rows(batch, rows, PAD, "flash"), pad_rows(batch, rows, PAD, "sdpa")
    args, kwargs = split_args_kwargs_into_chunks(
        (flash["input_ids"],),
        {"position_ids": flash["position_ids"], "row_segments": flash["row_segments"], "attn_mask": dense["attn_mask"]},
        2,
    )
    with torch.no_grad():
        for (ids,), kw in zip(args, kwargs):
            got = stage(ids, position_ids=kw["position_ids"], row_segments=kw["row_segments"])
            want = model(ids, position_ids=kw["position_ids"], attn_mask=kw["attn_mask"])
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_flash_is_offered_and_planned_without_the_dense_mask():
    flash = compose(["recipe=llm_tiny", "toggles.attention=flash", "toggles.precision=bf16"])
    sdpa = compose(["recipe=llm_tiny"])
    assert not memory_spec(flash).block.dense_mask and not memory_spec(flash).block.repeat_kv
    assert memory_spec(sdpa).block.dense_mask and memory_spec(sdpa).block.repeat_kv
    with pytest.raises(ConfigError, match="toggles.attention=eager"):
        compose(["recipe=llm_tiny", "toggles.attention=eager"])
    # Selective activation checkpointing keeps the kernel's output instead of recomputing attention.
    from torch.nn.attention import varlen
    from torch.utils.checkpoint import CheckpointPolicy

    assert _save_matmuls(None, torch.ops.aten.add.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE
    assert (
        varlen.varlen_attn
        and _save_matmuls(None, torch.ops.torch_attn._varlen_attn.default) == CheckpointPolicy.MUST_SAVE
    )


@pytest.mark.gpu
def test_varlen_kernel_matches_the_dense_mask_on_cuda():
    # The real kernel (torch.nn.attention.varlen, bf16) against SDPA with the dense mask, same weights and batch.
    # bf16 on both sides: they agree to bf16 rounding (logits |max| ~4 here), while a leak across documents or a
    # wrong GQA head mapping moves logits by O(1).
    torch.manual_seed(0)
    batch = _batch(n=24, seed=4)
    device = torch.device("cuda")
    real = torch.zeros_like(batch.labels, dtype=torch.bool)
    for r, lens in enumerate(batch.seq_lens):
        real[r, : sum(lens)] = True
    out = {}
    for attention in ("sdpa", "flash"):
        model = _model().to(device, torch.bfloat16)
        logits = model(batch.input_ids.to(device), **model_inputs(batch, attention, device))
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch.labels[:, 1:].flatten().to(device))
        loss.backward()
        out[attention] = (logits.float()[real.to(device)], {n: p.grad.float() for n, p in model.named_parameters()})
    torch.testing.assert_close(out["flash"][0], out["sdpa"][0], atol=3e-2, rtol=3e-2)
    for name, grad in out["sdpa"][1].items():
        err = (out["flash"][1][name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert err < 3e-2, f"{name}: relative gradient error {err:.3g}"
