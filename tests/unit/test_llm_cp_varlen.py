"""Context parallelism with the varlen kernel (toggles.attention=flash under parallel.cp, both cp methods): the segments
each cp rank hands the kernel give the unsplit row's attention, checked against SDPA with a document + causal mask
built here from the document lengths (outputs and gradients), on random packed documents, cp=2 and 4, GQA.

The cp ranks are emulated in one process: each gets what its collective returns (``allgather``: every rank's keys
and values in the gathered order; ``alltoall``: its heads of every token in that order) and runs the code that follows
the exchange on a rank (``exchanged_attention``), the same lines on CPU and on CUDA. On CPU the kernel is
tests/fixtures/varlen.py's stand-in, the reference semantics of torch's CUDA-only kernel; the gpu-marked test runs
the real one. The real collectives: tests/distributed/test_llm_context_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common import varlen
from common.data.packing import pack_samples
from recipes.llm.context_parallel import (
    ContextShard,
    VarlenSegments,
    chunk_positions,
    exchanged_attention,
    gathered_positions,
)
from tests.fixtures.varlen import cpu_kernel

ROW = 48  # divisible by 2 * cp for cp = 2 and 4
HEADS, KV_HEADS, HEAD_DIM = 8, 4, 16  # GQA (2 query heads per key/value head); alltoall at cp=4: 2 and 1 per rank
METHODS = ("allgather", "alltoall")


def use_cpu_kernel(monkeypatch, form: str) -> None:
    """The CPU stand-in as common/varlen.py's kernel, in either of its forms (torch 2.13's, or 2.11's: repeat_kv)."""
    monkeypatch.setattr(varlen, "_kernel", lambda: cpu_kernel(form))


def random_batch(seed: int):
    """Random documents packed into rows of ROW tokens: one fills a row, one is a single token, the others random
    (most cross chunk edges); the last row ends in padding."""
    g = torch.Generator().manual_seed(seed)
    lengths = [ROW, 1, *torch.randint(1, ROW, (10,), generator=g).tolist()]
    ones = [torch.ones(n, dtype=torch.long) for n in lengths]  # attention reads no token ids
    packed = pack_samples([{"input_ids": t, "labels": t} for t in ones], ROW, 0)
    assert any(sum(lens) < ROW for lens in packed.seq_lens) and any(lens == [ROW] for lens in packed.seq_lens)
    return packed


def random_qkv(packed, seed: int, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shape = (packed.num_rows, ROW)
    return [
        torch.randn(*shape, h, HEAD_DIM, generator=g).to(device, dtype) for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)
    ]  # q, k, v, and an upstream gradient for the output


def document_causal_mask(seq_lens: list[list[int]], row_len: int) -> torch.Tensor:
    """[R, L, L] bool from the documents' lengths alone: token i attends token j iff both lie in the same document
    (or both in the row's padding tail) and j <= i."""
    masks = []
    for lens in seq_lens:
        pieces = lens + [row_len - sum(lens)]
        doc = torch.repeat_interleave(torch.arange(len(pieces)), torch.tensor(pieces))
        masks.append((doc[:, None] == doc[None, :]) & torch.ones(row_len, row_len, dtype=torch.bool).tril())
    return torch.stack(masks)


def dense_attention(q, k, v, mask):
    """The unsplit row: SDPA over [R, L, H, hd] with the [R, L, L] mask, key/value heads repeated per query head."""
    n_rep = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k.repeat_interleave(n_rep, 2), v.repeat_interleave(n_rep, 2)))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None]).transpose(1, 2)


def cp_attention(packed, q, k, v, cp: int, method: str) -> torch.Tensor:
    """Every cp rank's attention under toggles.attention=flash, one process -> [R, L, H, hd] in row order."""
    gathered = gathered_positions(ROW, cp)  # what an all-gather or the first all-to-all lays out: rank after rank
    device = q.device
    outs = []
    for rank in range(cp):
        segments = ContextShard.of(packed, cp, rank, method, "flash").mask.to(device)
        if method == "allgather":  # its chunks' queries over every rank's keys/values
            mine = chunk_positions(ROW, cp, rank)
            outs.append(exchanged_attention(q[:, mine], k[:, gathered], v[:, gathered], segments))
        else:  # its heads (contiguous groups: query head h with key/value head h // n_rep) of every token
            hq, hk = (
                slice(rank * HEADS // cp, (rank + 1) * HEADS // cp),
                slice(rank * KV_HEADS // cp, (rank + 1) * KV_HEADS // cp),
            )
            outs.append(exchanged_attention(q[:, gathered, hq], k[:, gathered, hk], v[:, gathered, hk], segments))
    # allgather: the ranks' tokens, rank after rank; alltoall: the ranks' heads of every token (gathered order).
    out = torch.cat(outs, dim=1 if method == "allgather" else 2)
    return out[:, torch.argsort(gathered).to(device)]


def outputs_and_grads(fn, q, k, v, upstream):
    """fn(q, k, v) and the gradients of <fn(q, k, v), upstream> with respect to q, k, v, in fp32."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    (out.float() * upstream.float()).sum().backward()
    return {"out": out.detach().float()} | {f"grad_{n}": t.grad.float() for n, t in zip("qkv", leaves)}


# Every method and cp with torch 2.13's kernel form; cp=4 also with 2.11's (key/value heads repeated). One random
# document layout per case, a different one each.
CASES = [(m, cp, "enable_gqa") for m in METHODS for cp in (2, 4)] + [(m, 4, "repeat_kv") for m in METHODS]


@pytest.mark.parametrize("seed,method,cp,kernel", [(i, *case) for i, case in enumerate(CASES)])
def test_cp_varlen_equals_the_unsplit_masked_attention(monkeypatch, seed, method, cp, kernel):
    use_cpu_kernel(monkeypatch, kernel)
    packed = random_batch(seed)
    q, k, v, upstream = random_qkv(packed, seed)
    mask = document_causal_mask(packed.seq_lens, ROW)
    got = outputs_and_grads(lambda *t: cp_attention(packed, *t, cp, method), q, k, v, upstream)
    want = outputs_and_grads(lambda *t: dense_attention(*t, mask), q, k, v, upstream)
    for key, ref in want.items():
        err = (got[key] - ref).abs().max().item()
        print(f"cp={cp} {method} ({kernel}) {key}: max |cp varlen - unsplit| = {err:.1e}")
        assert ref.abs().max() > 0.1 and err <= 1e-5, key


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", METHODS)
def test_segments_allow_exactly_the_masks_pairs(method, cp):
    """Read as the kernel reads them (bottom-right causal), the segments allow exactly the (query, key) pairs of the
    row's document + causal mask at the rank's queries: none more, none less; every query in one segment."""
    packed = random_batch(2)
    mask = document_causal_mask(packed.seq_lens, ROW)
    gathered = gathered_positions(ROW, cp)
    for rank in range(cp):
        seg: VarlenSegments = ContextShard.of(packed, cp, rank, method, "flash").mask
        # Each flattened query (in segment order) and key -> (row, row position).
        queries = ROW // cp if method == "allgather" else ROW
        q_flat = torch.arange(packed.num_rows * queries) if seg.q_index is None else seg.q_index
        if method == "allgather":
            q_row, q_pos = q_flat // queries, chunk_positions(ROW, cp, rank)[q_flat % queries]
        else:
            q_row, q_pos = q_flat // ROW, gathered[q_flat % ROW]
        k_row, k_pos = seg.k_index // ROW, gathered[seg.k_index % ROW]
        assert torch.equal(torch.sort(q_flat).values, torch.arange(len(q_flat))), "each query once"
        allowed = torch.zeros(packed.num_rows, ROW, ROW, dtype=torch.bool)
        cu_q, cu_k = seg.cu_q.tolist(), seg.cu_k.tolist()
        for i in range(len(cu_q) - 1):
            lq, lk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
            qs, ks = torch.arange(cu_q[i], cu_q[i + 1]), torch.arange(cu_k[i], cu_k[i + 1])
            assert len(set(q_row[qs].tolist()) | set(k_row[ks].tolist())) == 1, "a segment stays in its row"
            pairs = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
            t, j = pairs.nonzero(as_tuple=True)
            assert not allowed[q_row[qs[t]], q_pos[qs[t]], k_pos[ks[j]]].any(), "a pair allowed twice"
            allowed[q_row[qs[t]], q_pos[qs[t]], k_pos[ks[j]]] = True
        rows = chunk_positions(ROW, cp, rank) if method == "allgather" else torch.arange(ROW)
        assert torch.equal(allowed[:, rows], mask[:, rows])
        if seg.out_index is not None:  # the output goes back to the queries' order
            assert torch.equal(seg.q_index[seg.out_index], torch.arange(len(q_flat)))


@pytest.mark.parametrize("method", METHODS)
def test_flash_composes_with_cp(method):
    from scripts.kiln.launch import compose  # here: the GPU test's machine may lack Hydra

    cfg = compose(
        ["recipe=llm_tiny", "parallel.cp=2", f"parallel.cp_method={method}", "toggles.attention=flash"]
        + ["toggles.precision=bf16"]
    )
    assert (cfg.parallel.cp, cfg.toggles.attention) == (2, "flash")


def against_the_unsplit_row(method: str, cp: int, device: torch.device, dtype: torch.dtype) -> dict:
    """cp's varlen attention through whatever kernel common/varlen.py has, against that kernel's unsplit run over the
    row's cu_seqlens (the path without cp) and against SDPA with the dense mask in fp32 on the same inputs:
    {(reference, output or gradient): (max |diff|, relative norm of the difference)}, each printed."""
    packed = random_batch(3)
    q, k, v, upstream = random_qkv(packed, 3, device, dtype)
    mask = document_causal_mask(packed.seq_lens, ROW).to(device)
    cu = packed.cu_seqlens.to(device)

    def unsplit(q, k, v):
        flat = (t.flatten(0, 1) for t in (q, k, v))
        return varlen.varlen_causal_attention(*flat, cu, cu, packed.max_seqlen, packed.max_seqlen).view_as(q)

    def dense_fp32(q, k, v):
        return dense_attention(q.float(), k.float(), v.float(), mask)

    got = outputs_and_grads(lambda *t: cp_attention(packed, *t, cp, method), q, k, v, upstream)
    errors = {}
    for name, fn in (("unsplit varlen", unsplit), ("dense SDPA fp32", dense_fp32)):
        for key, ref in outputs_and_grads(fn, q, k, v, upstream).items():
            err, rel = (got[key] - ref).abs().max().item(), ((got[key] - ref).norm() / ref.norm()).item()
            print(f"{device.type} {dtype} cp={cp} {method} vs {name} {key}: max |diff| {err:.1e}, relative {rel:.1e}")
            errors[name, key] = err, rel
    return errors


@pytest.mark.gpu
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", METHODS)
def test_cp_varlen_on_cuda(method, cp):
    """The real kernel (torch.nn.attention.varlen, bf16) through the same segments and lines as the CPU test. bf16
    rounding moves outputs by about one bf16 step (<= 3e-2 at |out| < 8) and gradients by ~1e-2 relative; a token
    attending across a document or a top-left causal diagonal (a piece's queries missing their document's earlier
    keys) moves them by O(1)."""
    errors = against_the_unsplit_row(method, cp, torch.device("cuda"), torch.bfloat16)
    for (name, key), (err, rel) in errors.items():
        assert rel < 3e-2 and (key != "out" or err < 6e-2), f"{key} vs {name}: max |diff| {err:.3g}, relative {rel:.3g}"


def test_the_planner_bounds_the_kernels_copies(monkeypatch):
    """What each cp rank's varlen kernel gets, and keeps for backward (torch's kernel saves its q, k, v), are copies the
    segments make (index_select): under allgather each query piece's keys/values out of the gathered ones, under
    alltoall q, k, v put in row order. Their bytes, measured as the storages the kernel receives, against the
    planner's "q, k, v" for the LLM under toggles.attention=flash (common/memory.py: Block.cp_varlen,
    cp_varlen_keys): allgather's is an upper bound over document layouts, reached on every rank when each row is one
    document (the most keys a piece can copy); alltoall's is exact. cp=2 and 4, fp32 (act_bytes 4)."""
    from common.memory import layer_saved
    from recipes.llm.sizing import memory_spec
    from scripts.kiln.launch import compose  # here: the GPU test's machine may lack Hydra

    block = memory_spec(compose(["recipe=llm_tiny", "toggles.attention=flash", "toggles.precision=bf16"])).block
    # llm_tiny's q and k/v widths are this file's (4 heads x 32 and 2 x 32; here 8 x 16 and 4 x 16): the same bytes.
    assert block.cp_varlen and (block.attention_width, block.kv_width) == (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)
    got = []

    def recording_kernel(q, k, v, *args, **kwargs):
        got.append(sum(t.untyped_storage().nbytes() for t in (q, k, v)))
        return cpu_kernel()[0](q, k, v, *args, **kwargs)

    monkeypatch.setattr(varlen, "_kernel", lambda: (recording_kernel, True))
    whole = pack_samples([{"input_ids": t, "labels": t} for t in [torch.ones(ROW, dtype=torch.long)] * 2], ROW, 0)
    for method, cp in [(m, cp) for m in METHODS for cp in (2, 4)]:
        for name, packed in (("a document per row", whole), ("random documents", random_batch(cp))):
            got.clear()
            cp_attention(packed, *random_qkv(packed, 0)[:3], cp, method)
            saved = layer_saved(block, seq=ROW, batch=packed.num_rows, act_bytes=4, cp=cp, cp_method=method)
            planned = next(t.nbytes for t in saved if t.name == "q, k, v")
            print(f"cp={cp} {method}, {name}: the kernel's q, k, v per rank {got} B; planned {planned:,.0f} B")
            assert len(got) == cp and all(n <= planned for n in got)
            if method == "alltoall" or packed is whole:
                assert all(n == planned for n in got), (method, cp, name)
