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

Under tensor parallelism (cp x tp) each rank exchanges its own heads over its cp group: the
sequence-parallel regions work on the rank's chunks unchanged. Under pipeline parallelism (cp x pp) each round's rows
are split as here (``shard_rows``) and every stage attends over its own cp group (recipes/llm/pipeline.py). An MoE
routes each rank's tokens and sums its routing statistics over dp x cp before forming the auxiliary losses
(recipes/llm/moe_losses.py); expert parallelism is refused with cp (recipes/llm/config.py). Masked SDPA (torch's
kernels), the CPU path; the varlen kernel (``toggles.attention=flash``) is not wired under cp yet: refused at
composition (recipes/llm/config.py).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from common.data.packing import IGNORE_INDEX, PackedBatch


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


def next_token_targets(labels: Tensor) -> Tensor:
    """``[R, L]`` unshifted labels -> the label each position predicts (the next one's); -100 at a row's end."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)


class ContextParallelMask:
    """What a layer's attention gets under context parallelism in place of a mask: the document + causal mask rows it
    needs (``allgather``: the rank's query rows, ``[R, 1, L/cp, L]``; ``alltoall``: every row, ``[R, 1, L, L]``; bool,
    rows and columns in the gathered order), the cp group, and the method."""

    def __init__(self, mask: Tensor, group, method: str = "allgather"):
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


def attend_gathered(q: Tensor, k: Tensor, v: Tensor, cp: ContextParallelMask) -> Tensor:
    """Attention of this rank's ``[B, S/cp, Hq, hd]`` queries over every rank's keys/values -> ``[B, S/cp, Hq, hd]``:
    SDPA with the rank's rows of the document + causal mask."""
    return masked_sdpa(q, cp.gather(k), cp.gather(v), cp.mask)


def attend_alltoall(q: Tensor, k: Tensor, v: Tensor, cp: ContextParallelMask) -> Tensor:
    """Ulysses: this rank's ``[B, S/cp, H, hd]`` q, k, v -> its ``H/cp`` heads over the whole row, attended with the
    whole row's document + causal mask (gathered order on both axes) -> ``[B, S/cp, Hq, hd]`` back."""
    q, k, v = (cp.heads_to_sequence(t) for t in (q, k, v))
    return cp.sequence_to_heads(masked_sdpa(q, k, v, cp.mask))


def shard_rows(rows: dict[str, Tensor], cp: int, cp_rank: int, method: str = "allgather") -> dict[str, Tensor]:
    """Whole packed rows' model inputs -> cp rank ``cp_rank``'s share, under the same names: every ``[R, L]`` tensor
    at the rank's positions (``chunk_positions``), ``labels`` (unshifted) turned into each position's next-token
    target first (an MoE pipeline's per-row ``labelled`` counts the rank's targets), and ``attn_mask``
    (``[R, 1, L, L]``) cut to the rows the rank attends with (allgather: its queries'; alltoall: every token's) and
    the keys in the gathered order. The one split of a batch: the training step's (:meth:`ContextShard.of`) and each
    pipeline round's, padding rows included (recipes/llm/pipeline.py)."""
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
    next-token target, and its query rows of the row's mask (columns in the gathered order)."""

    input_ids: Tensor  # [R, L/cp]
    position_ids: Tensor  # [R, L/cp] position within the document
    targets: Tensor  # [R, L/cp] the next token's label (-100: none)
    mask: Tensor  # [R, 1, L/cp (alltoall: L), L] bool, True = attend
    real_tokens: Tensor  # [R, L/cp] bool: the documents' tokens, not the padding (the MoE's routing statistics)
    num_labels: int  # labelled targets on this rank (the loss's count)
    method: str = "allgather"

    @classmethod
    def of(cls, packed: PackedBatch, cp: int, cp_rank: int, method: str = "allgather") -> "ContextShard":
        rows = {
            "input_ids": packed.input_ids,
            "labels": packed.labels,
            "position_ids": packed.position_ids,
            "attn_mask": packed.attention_mask_4d(),
        }
        mine = shard_rows(rows, cp, cp_rank, method)
        lengths = torch.tensor([sum(lens) for lens in packed.seq_lens])
        real = chunk_positions(packed.row_len, cp, cp_rank)[None, :] < lengths[:, None]
        return cls(
            input_ids=mine["input_ids"],
            position_ids=mine["position_ids"],
            targets=mine["labels"],
            mask=mine["attn_mask"],
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
