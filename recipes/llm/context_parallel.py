"""Context parallelism for the LLM (``parallel.cp``): each packed row's sequence split over the ``cp`` mesh dim.

Load balance (torchtitan's and Megatron's): the row is cut into ``2 * cp`` equal chunks and cp rank ``r`` holds
chunks ``r`` and ``2 * cp - 1 - r``, an early and a late one, so every rank does the same causal work.

``cp_method=allgather`` (Llama 3's context parallelism): each rank all-gathers the keys and values of the whole row
over the cp group (with autograd: the backward sums the key/value gradients of every rank's queries back to the rank
that holds them) and computes its own queries' attention with the document + causal mask of those query rows,
built from the packing metadata (``PackedBatch.attention_mask_4d``) at the tokens' global positions. Nothing
else changes: RoPE takes each token's position within its document (``position_ids``), the loss each token's
next-token target, shifted on the whole row before the split, so no target crosses a chunk edge.

Under tensor parallelism (cp x tp) each rank gathers its own heads' keys/values over its cp group: the
sequence-parallel regions work on the rank's chunks unchanged. Masked SDPA (torch's kernels), the CPU path; the
varlen kernel (``toggles.attention=flash``) is not wired under cp yet: refused at composition
(recipes/llm/config.py).
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
    """What a layer's attention gets under ``cp_method=allgather`` in place of a mask: the rank's query rows of the
    document + causal mask, ``[R, 1, L/cp, L]`` bool, columns in the gathered keys' order, and the cp group the
    keys and values are gathered over."""

    def __init__(self, mask: Tensor, group):
        self.mask, self.group = mask, group

    def gather(self, x: Tensor) -> Tensor:
        """``[B, S/cp, H, hd]`` of every cp rank -> ``[B, S, H, hd]``, rank after rank (their local orders)."""
        from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor

        b, s = x.shape[:2]
        out = wait_tensor(all_gather_single_autograd(x.contiguous(), 0, self.group))  # [cp*B, S/cp, H, hd]
        return out.view(-1, b, s, *x.shape[2:]).transpose(0, 1).flatten(1, 2)


def attend_gathered(q: Tensor, k: Tensor, v: Tensor, cp: ContextParallelMask) -> Tensor:
    """Attention of this rank's ``[B, S/cp, Hq, hd]`` queries over every rank's keys/values -> ``[B, S/cp, Hq, hd]``:
    SDPA with the rank's rows of the document + causal mask (key/value heads repeated per query head, as the
    unsplit path does)."""
    k, v = cp.gather(k), cp.gather(v)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=cp.mask).transpose(1, 2)


@dataclasses.dataclass
class ContextShard:
    """cp rank's share of a packed batch: its positions of every row (``chunk_positions``), each token's
    next-token target, and its query rows of the row's mask (columns in the gathered order)."""

    input_ids: Tensor  # [R, L/cp]
    position_ids: Tensor  # [R, L/cp] position within the document
    targets: Tensor  # [R, L/cp] the next token's label (-100: none)
    mask: Tensor  # [R, 1, L/cp, L] bool, True = attend
    num_labels: int  # labelled targets on this rank (the loss's count)
    num_real_tokens: int

    @classmethod
    def of(cls, packed: PackedBatch, cp: int, cp_rank: int) -> "ContextShard":
        idx = chunk_positions(packed.row_len, cp, cp_rank)
        keys = gathered_positions(packed.row_len, cp)
        mask = packed.attention_mask_4d()[:, :, idx][..., keys]
        targets = next_token_targets(packed.labels)[:, idx]
        lengths = torch.tensor([sum(lens) for lens in packed.seq_lens])
        real = idx[None, :] < lengths[:, None]
        return cls(
            input_ids=packed.input_ids[:, idx],
            position_ids=packed.position_ids[:, idx],
            targets=targets,
            mask=mask,
            num_labels=int((targets != IGNORE_INDEX).sum()),
            num_real_tokens=int(real.sum()),
        )

    def model_inputs(self, group, device: torch.device) -> dict:
        return {
            "position_ids": self.position_ids.to(device),
            "attn_mask": ContextParallelMask(self.mask.to(device), group),
        }
