"""Context parallelism for the LLM (``parallel.cp``): each packed row's sequence split over the ``cp`` mesh dim.

Load balance (torchtitan's and Megatron's): the row is cut into ``2 * cp`` equal chunks and cp rank ``r`` holds
chunks ``r`` and ``2 * cp - 1 - r``, an early and a late one, so every rank does the same causal work.

``cp_method=allgather`` (Llama 3's context parallelism): each rank all-gathers the keys and values of the whole row
over the cp group (with autograd: the backward sums the key/value gradients of every rank's queries back to the rank
that holds them) and computes its own queries' attention with the document + causal mask of those query rows,
built from the packing metadata (``PackedBatch.attention_mask_4d``) at the tokens' global positions. Nothing
else changes: RoPE takes each token's position within its document (``position_ids``), the loss each token's
next-token target, shifted on the whole row before the split, so no target crosses a chunk edge.

``cp_method=alltoall`` (Ulysses, DeepSpeed's sequence parallelism): an all-to-all turns each rank's ``[L/cp tokens,
H heads]`` queries, keys and values into ``[L tokens, H/cp heads]``, the whole row in the gathered order (rank 0's
chunks, then rank 1's, ...); each rank attends with its heads over the whole row, with the row's document + causal
mask in that order on both axes, and a second all-to-all brings ``[L/cp tokens, H heads]`` back. Each rank then
needs whole key/value heads: cp must divide the key/value heads (per tp rank), refused at composition otherwise.
Per layer a rank sends ``(cp-1)/cp`` of its own q, k, v and attention output (a volume that stays flat as cp grows
with L/cp fixed), where the all-gather sends its keys and values to each of the ``cp - 1`` others; but every rank
holds the whole row's ``[L x L]`` mask (SDPA's dense mask, the CPU path).

Under tensor parallelism (cp x tp) each rank exchanges its own heads over its cp group: the sequence-parallel regions
work on the rank's chunks unchanged. Under pipeline parallelism (cp x pp) each round's rows are split as here
(``shard_rows``) and every stage attends over its own cp group (recipes/llm/pipeline_parallel.py; masked SDPA: the
varlen kernel under cp x pp is refused at composition). An MoE routes each rank's tokens and sums its routing
statistics over dp x cp before forming the auxiliary losses (recipes/llm/moe_losses.py); expert parallelism is refused
with cp (recipes/llm/config.py).

Two kernels after the exchange, the same attention: masked SDPA with the dense mask rows above (``sdpa``, the CPU
path), or torch's varlen FlashAttention kernel (``toggles.attention=flash``, CUDA; common/varlen.py) on segments built
from the same packing metadata (``PackedBatch.row_segments``), with no ``[L/cp x L]`` mask at all (``VarlenSegments``):

* alltoall: the gathered row is put back in row order (an index_select), attended over the row's own ``cu_seqlens``
  (documents and padding tail, as without cp), and the output put back in the gathered order.
* allgather: the rank's queries are two contiguous row ranges (its early and late chunk); each document ``[s, e)``
  cuts them into pieces ``[a, b)``, and piece ``[a, b)`` attends keys ``[s, b)``, index_selected from the gathered
  keys/values (copies: each key up to once per piece that reads it, so at most about ``L + L/(2 cp)`` keys per row
  and rank). The pieces tile the rank's queries in their local order, so the queries and the output need no copy.
  The kernel aligns causality at the bottom right of each segment pair (below), so query ``a + i`` sees keys
  ``s .. a + i``.

The segments are built on the host once per batch (``ContextShard.of``), ``max_q`` / ``max_k`` as Python ints: the
kernel needs no device read per layer.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from common.data.packing import IGNORE_INDEX, PackedBatch
from common.varlen import varlen_causal_attention


def chunk_positions(seq_len: int, cp: int, cp_rank: int) -> Tensor:
    """The row positions cp rank ``cp_rank`` holds, in its local order: chunk ``cp_rank`` then chunk
    ``2 * cp - 1 - cp_rank`` of the ``2 * cp`` equal chunks (``seq_len`` divisible by ``2 * cp``)."""
    n = seq_len // (2 * cp)
    early = torch.arange(cp_rank * n, (cp_rank + 1) * n)
    late = torch.arange((2 * cp - 1 - cp_rank) * n, (2 * cp - cp_rank) * n)
    return torch.cat([early, late])


def gathered_positions(seq_len: int, cp: int) -> Tensor:
    """The row positions of the keys/values after the all-gather: rank 0's chunks, then rank 1's, ..."""
    return torch.cat([chunk_positions(seq_len, cp, r) for r in range(cp)])


def row_documents(packed: PackedBatch) -> list[list[tuple[int, int]]]:
    """Per row, its segments ``[s, e)`` in row positions: the documents, then the padding tail (a segment of its own,
    as ``cu_seqlens`` and the dense mask have it)."""
    out = []
    for lengths in packed.row_segments().tolist():
        ends = torch.tensor([n for n in lengths if n > 0]).cumsum(0).tolist()
        out.append(list(zip([0, *ends[:-1]], ends)))
    return out


class VarlenSegments(NamedTuple):
    """A cp rank's attention after the exchange as torch's varlen kernel takes it (``toggles.attention=flash``): the
    flattened ``[rows * tokens]`` queries (reordered by ``q_index`` where set) and the keys/values ``k_index`` picks
    out of the flattened exchanged ones, cut into segments ``cu_q`` / ``cu_k`` (segment i: queries
    ``cu_q[i]..cu_q[i+1]`` over keys ``cu_k[i]..cu_k[i+1]``, causal at the bottom right); ``out_index`` puts the
    output back in the queries' order. Host tensors until ``to``; ``max_q`` / ``max_k`` Python ints."""

    cu_q: Tensor  # int32 [N+1]
    cu_k: Tensor  # int32 [N+1]
    max_q: int
    max_k: int
    k_index: Tensor  # long [sum of key segments]: rows of the flattened keys/values, segment after segment
    q_index: Tensor | None = None  # long [rows * tokens]: the queries in segment order (None: already in it)
    out_index: Tensor | None = None  # long [rows * tokens]: the inverse of q_index

    def to(self, device: torch.device) -> "VarlenSegments":
        return self._replace(**{k: v.to(device) for k, v in self._asdict().items() if isinstance(v, Tensor)})

    @classmethod
    def whole_rows(cls, packed: PackedBatch, cp: int) -> "VarlenSegments":
        """``alltoall``: the whole rows in the gathered order -> row order, attended over the row's own documents
        (``packed.cu_seqlens``, as the unsplit varlen path), -> the gathered order again."""
        length = packed.row_len
        gathered = gathered_positions(length, cp)  # gathered index -> row position
        row_order = torch.argsort(gathered)  # row position -> gathered index
        offsets = torch.arange(packed.num_rows)[:, None] * length
        to_rows = (offsets + row_order).flatten()
        cu, longest = packed.cu_seqlens, packed.max_seqlen
        return cls(cu, cu, longest, longest, to_rows, to_rows, (offsets + gathered).flatten())

    @classmethod
    def rank_queries(cls, packed: PackedBatch, cp: int, cp_rank: int) -> "VarlenSegments":
        """``allgather``: rank ``cp_rank``'s queries (its early and late chunk of every row, in its local order) over
        the gathered keys/values. Each segment ``[s, e)`` of a row cuts a chunk into a piece ``[a, b)`` of queries,
        whose keys are the row's ``[s, b)``: at the gathered positions of those tokens, so the keys need no reordering
        first. The kernel aligns the causal diagonal at the bottom right of a segment pair with fewer queries than keys:
        query i attends key j iff ``j <= i + Lk - Lq`` (FlashAttention's convention since flash-attn 2.1, whose kernel
        torch vendors). torch's ``varlen_attn`` docstring says only that ``window_size=(-1, 0)`` is causal; its
        ``mha_varlen_fwd`` (aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp) turns causality off when
        every segment has one query, which is the same attention only if that query sees all its keys: bottom right.
        The gpu-marked test in tests/unit/test_llm_cp_varlen.py checks it on the kernel. Here ``Lk - Lq = a - s``:
        query ``a + i`` attends keys ``s .. a + i``, exactly the document + causal mask's row."""
        length, n = packed.row_len, packed.row_len // (2 * cp)
        row_order = torch.argsort(gathered_positions(length, cp))  # row position -> gathered index
        chunks = ((cp_rank * n, (cp_rank + 1) * n), ((2 * cp - 1 - cp_rank) * n, (2 * cp - cp_rank) * n))
        q_lens, k_lens, k_index = [], [], []
        for r, documents in enumerate(row_documents(packed)):
            for lo, hi in chunks:
                for s, e in documents:
                    a, b = max(s, lo), min(e, hi)
                    if a < b:
                        q_lens.append(b - a)
                        k_lens.append(b - s)
                        k_index.append(r * length + row_order[s:b])
        cu_q, cu_k = (
            torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(torch.int32) for lens in (q_lens, k_lens)
        )
        return cls(cu_q, cu_k, max(q_lens), max(k_lens), torch.cat(k_index))


def varlen_segments_attention(q: Tensor, k: Tensor, v: Tensor, seg: VarlenSegments) -> Tensor:
    """``[B, Sq, Hq, hd]`` queries over ``[B, Sk, Hkv, hd]`` exchanged keys/values -> ``[B, Sq, Hq, hd]``: the varlen
    kernel on ``seg``'s segments (common/varlen.py: GQA, the kernel call)."""
    b, s = q.shape[:2]
    q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    if seg.q_index is not None:
        q = q.index_select(0, seg.q_index)
    k, v = k.index_select(0, seg.k_index), v.index_select(0, seg.k_index)
    out = varlen_causal_attention(q, k, v, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k)
    if seg.out_index is not None:
        out = out.index_select(0, seg.out_index)
    return out.view(b, s, *out.shape[1:])


def next_token_targets(labels: Tensor) -> Tensor:
    """``[R, L]`` unshifted labels -> the label each position predicts (the next one's); -100 at a row's end."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)


class ContextParallelMask:
    """What a layer's attention gets under context parallelism in place of a mask: the document + causal mask rows it
    needs (``allgather``: the rank's query rows, ``[R, 1, L/cp, L]``; ``alltoall``: every row, ``[R, 1, L, L]``; bool,
    rows and columns in the gathered order) or, for the varlen kernel, the same attention as ``VarlenSegments``; the
    cp group, and the method."""

    def __init__(self, mask: Tensor | VarlenSegments, group, method: str = "allgather"):
        self.mask, self.group, self.method = mask, group, method

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return (attend_alltoall if self.method == "alltoall" else attend_gathered)(q, k, v, self)

    def gather(self, x: Tensor) -> Tensor:
        """``[B, S/cp, H, hd]`` of every cp rank -> ``[B, S, H, hd]``, rank after rank (their local orders)."""
        from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor

        b, s = x.shape[:2]
        out = wait_tensor(all_gather_single_autograd(x.contiguous(), 0, self.group))  # [cp*B, S/cp, H, hd]
        return out.view(-1, b, s, *x.shape[2:]).transpose(0, 1).flatten(1, 2)

    def heads_to_sequence(self, x: Tensor) -> Tensor:
        """``[B, S/cp, H, hd]`` on every cp rank -> ``[B, S, H/cp, hd]``: cp rank j keeps heads ``j*H/cp ..`` of every
        rank's tokens, rank after rank (their local orders, as ``gather``). Contiguous head groups keep GQA's pairing:
        query head h and its key/value head ``h // n_rep`` land on the same rank."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

        b, s, h, hd = x.shape
        cp = self.group.size()
        send = x.view(b, s, cp, h // cp, hd).permute(2, 0, 1, 3, 4).contiguous()  # [cp (to), B, S/cp, H/cp, hd]
        got = wait_tensor(all_to_all_single_autograd(send, None, None, self.group))  # [cp (from), ...]
        return got.transpose(0, 1).reshape(b, cp * s, h // cp, hd)

    def sequence_to_heads(self, x: Tensor) -> Tensor:
        """The inverse of ``heads_to_sequence``: ``[B, S, H/cp, hd]`` -> this rank's ``[B, S/cp, H, hd]``."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

        b, n, hc, hd = x.shape
        cp = self.group.size()
        send = x.view(b, cp, n // cp, hc, hd).transpose(0, 1).contiguous()  # [cp (to: its tokens), B, S/cp, H/cp, hd]
        got = wait_tensor(all_to_all_single_autograd(send, None, None, self.group))  # [cp (heads from), ...]
        return got.permute(1, 2, 0, 3, 4).reshape(b, n // cp, cp * hc, hd)


def masked_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """SDPA of ``[B, Sq, Hq, hd]`` queries over ``[B, Sk, Hkv, hd]`` keys/values with a bool mask -> ``[B, Sq, Hq, hd]``
    (key/value heads repeated per query head, as the unsplit path does)."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def exchanged_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | VarlenSegments) -> Tensor:
    """The attention after the exchange, on this rank alone: SDPA with the dense mask rows, or the varlen kernel on
    the same attention's segments."""
    if isinstance(mask, VarlenSegments):
        return varlen_segments_attention(q, k, v, mask)
    return masked_sdpa(q, k, v, mask)


def attend_gathered(q: Tensor, k: Tensor, v: Tensor, cp: ContextParallelMask) -> Tensor:
    """Attention of this rank's ``[B, S/cp, Hq, hd]`` queries over every rank's keys/values -> ``[B, S/cp, Hq, hd]``:
    the rank's rows of the document + causal mask."""
    return exchanged_attention(q, cp.gather(k), cp.gather(v), cp.mask)


def attend_alltoall(q: Tensor, k: Tensor, v: Tensor, cp: ContextParallelMask) -> Tensor:
    """Ulysses: this rank's ``[B, S/cp, H, hd]`` q, k, v -> its ``H/cp`` heads over the whole row, attended with the
    whole row's document + causal mask (gathered order on both axes) -> ``[B, S/cp, Hq, hd]`` back."""
    # No local names for the exchanged q, k, v: those the kernel does not keep (k and v before their repetition per
    # query head) are freed before the inverse exchange allocates its buffers (common/memory.py: cp_transient_bytes).
    return cp.sequence_to_heads(exchanged_attention(*(cp.heads_to_sequence(t) for t in (q, k, v)), cp.mask))


def shard_rows(rows: dict[str, Tensor], cp: int, cp_rank: int, method: str = "allgather") -> dict[str, Tensor]:
    """Whole packed rows' model inputs -> cp rank ``cp_rank``'s share, under the same names: every ``[R, L]`` tensor
    at the rank's positions (``chunk_positions``), ``labels`` (unshifted) turned into each position's next-token
    target first (an MoE pipeline's per-row ``labelled`` counts the rank's targets), and ``attn_mask``
    (``[R, 1, L, L]``) cut to the rows the rank attends with (allgather: its queries'; alltoall: every token's) and
    the keys in the gathered order. The one split of a batch: the training step's (:meth:`ContextShard.of`) and each
    pipeline round's, padding rows included (recipes/llm/pipeline_parallel.py)."""
    seq_len = rows["input_ids"].shape[1]
    idx, keys = chunk_positions(seq_len, cp, cp_rank), gathered_positions(seq_len, cp)
    out = {}
    for name, t in rows.items():
        if name == "attn_mask":
            out[name] = t[:, :, keys if method == "alltoall" else idx][..., keys]
        elif name == "labels":
            out[name] = next_token_targets(t)[:, idx]
        elif name == "labelled":  # [R]: each row's labelled count becomes the rank's (its targets')
            out[name] = (next_token_targets(rows["labels"])[:, idx] != IGNORE_INDEX).sum(1)
        else:
            out[name] = t[:, idx]
    return out


@dataclasses.dataclass
class ContextShard:
    """cp rank's share of a packed batch: its positions of every row (``chunk_positions``), each token's
    next-token target, and its query rows of the row's mask (columns in the gathered order), or under
    ``attention="flash"`` the varlen kernel's segments of the same attention."""

    input_ids: Tensor  # [R, L/cp]
    position_ids: Tensor  # [R, L/cp] position within the document
    targets: Tensor  # [R, L/cp] the next token's label (-100: none)
    mask: Tensor | VarlenSegments  # [R, 1, L/cp (alltoall: L), L] bool, True = attend; flash: VarlenSegments
    real_tokens: Tensor  # [R, L/cp] bool: the documents' tokens, not the padding (the MoE's routing statistics)
    num_labels: int  # labelled targets on this rank (the loss's count)
    method: str = "allgather"

    @classmethod
    def of(
        cls, packed: PackedBatch, cp: int, cp_rank: int, method: str = "allgather", attention: str = "sdpa"
    ) -> "ContextShard":
        rows = {"input_ids": packed.input_ids, "labels": packed.labels, "position_ids": packed.position_ids}
        if attention == "flash":  # segments, no quadratic mask
            alltoall = method == "alltoall"
            mask = (
                VarlenSegments.whole_rows(packed, cp) if alltoall else VarlenSegments.rank_queries(packed, cp, cp_rank)
            )
        else:  # allgather: this rank's queries attend; alltoall: every token of the row does (this rank's heads).
            rows["attn_mask"] = packed.attention_mask_4d()
        mine = shard_rows(rows, cp, cp_rank, method)
        if attention != "flash":
            mask = mine["attn_mask"]
        lengths = torch.tensor([sum(lens) for lens in packed.seq_lens])
        real = chunk_positions(packed.row_len, cp, cp_rank)[None, :] < lengths[:, None]
        return cls(
            input_ids=mine["input_ids"],
            position_ids=mine["position_ids"],
            targets=mine["labels"],
            mask=mask,
            real_tokens=real,
            num_labels=int((mine["labels"] != IGNORE_INDEX).sum()),
            method=method,
        )

    @property
    def num_real_tokens(self) -> int:
        return int(self.real_tokens.sum())

    def model_inputs(self, group, device: torch.device) -> dict:
        return {
            "position_ids": self.position_ids.to(device),
            "attn_mask": ContextParallelMask(self.mask.to(device), group, self.method),
        }
