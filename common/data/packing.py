"""Sequence packing: bin variable-length samples into rows (of max_seq_len tokens, or as short as the samples allow:
``fit_rows``), with per-sample attention isolation.

One metadata structure -- ``cu_seqlens`` / ``max_seqlen`` over the flattened ``[R*L]`` token
stream -- drives both attention paths:

* CPU (``sdpa`` / ``eager``): a 4D block-diagonal causal mask ``[R, 1, L, L]`` derived from the
  same segments, plus per-sample ``position_ids``. transformers does not isolate packed samples
  from ``position_ids`` alone on CPU (sdpa and eager attend across samples: logits off by up to 0.5), so the mask is
  explicit.
* CUDA (``flash``): rows flattened into one ``[1, R*L]`` row; ``cu_seq_lens_{q,k}`` and
  ``max_length_{q,k}`` go to the model as FlashAttentionKwargs and reach torch's varlen FlashAttention
  kernel (``torch.nn.attention.varlen.varlen_attn``: the VLM's ``kiln_varlen`` attention, the LLM's
  ``Segments``).

Segments are the samples AND each row's padding tail (its own segment), so flash never lets a
sample attend to padding, and the 4D mask built from the same segments attends exactly as
flash does. No segment crosses a row, so any group of rows (a pipeline microbatch) has its own
``cu_seqlens``: ``cu_seqlens_of_rows(batch.row_segments()[rows])``, which for all rows is the
batch's. Packing changes speed, not math: with the first label of every sample masked (see
``_build``), the loss with packing on equals the loss with packing off (``pad_samples``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100  # transformers' CrossEntropy ignore_index


def pack_ffd(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of ``lengths`` into bins of ``capacity``; returns indices per bin.

    Deterministic: items are taken longest first, ties by ascending index, and each goes into
    the lowest-numbered bin with room. Within a bin, indices are in placement order. FFD uses at
    most 11/9 * OPT + 6/9 bins (Dosa 2007).
    """
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    for n in lengths:
        if n < 0:
            raise ValueError(f"sample length must be >= 0, got {n}")
        if n > capacity:
            raise ValueError(f"sample of length {n} exceeds the packing capacity {capacity} (data.max_seq_len)")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if len(lengths) <= _SMALL:
        return _ffd_small(lengths, order, capacity)
    # Remaining room per bin; bins [0, num_bins) are open, the rest are empty. Bin `num_bins` is
    # always empty, so argmax (first True) over the open bins plus that one always finds a fit.
    room = np.full(len(lengths) + 1, capacity, dtype=np.int64)
    bins: list[list[int]] = []
    for i in order:
        b = int(np.argmax(room[: len(bins) + 1] >= lengths[i]))
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
        room[b] -= lengths[i]
    return bins


# plan_window's local search: moves and swaps tried per step and start. It bounds a step's planning (a large global
# batch spread over many slots starts well balanced anyway) and, unlike a time limit, plans the same on every rank.
SEARCH_BUDGET = 3000
_SMALL = 48  # up to this many items a Python scan beats numpy's per-call overhead (plan_window packs many small sets)


def _ffd_small(lengths: Sequence[int], order: list[int], capacity: int) -> list[list[int]]:
    """`pack_ffd`'s bins (the same rule: longest first, each into the lowest-numbered bin with room), by a scan."""
    room: list[int] = []
    bins: list[list[int]] = []
    for i in order:
        b = next((b for b, r in enumerate(room) if r >= lengths[i]), len(room))
        if b == len(room):
            room.append(capacity)
            bins.append([])
        bins[b].append(i)
        room[b] -= lengths[i]
    return bins


@dataclass
class PackedBatch:
    """A micro batch laid out as ``R`` rows of ``L`` tokens, with the sample boundaries it holds."""

    input_ids: torch.Tensor  # [R, L] long; pad_id where empty
    labels: torch.Tensor  # [R, L] long; -100 where ignored, at each sample's first position, and on padding
    position_ids: torch.Tensor  # [R, L] long; restart at 0 for every sample; 0 on padding
    seq_lens: list[list[int]]  # per row, the lengths of its samples, in order
    order: list[int]  # sample indices in row-major order of the flattened batch
    cu_seqlens: torch.Tensor  # int32 [S+1]: segment boundaries over [R*L]; samples and padding tails
    max_seqlen: int  # longest segment (padding tails included: flash sizes its grid by it)
    num_real_tokens: int
    num_labels: int  # labelled positions (labels != -100): what a token-mean loss is summed over

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def row_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def utilization(self) -> float:
        """Fraction of token slots that hold sample tokens (the rest is padding compute)."""
        return self.num_real_tokens / self.input_ids.numel()

    def segment_ids(self) -> torch.Tensor:
        """[R, L] long: index of the cu_seqlens segment each token belongs to."""
        boundaries = self.cu_seqlens[1:-1].long()
        flat = torch.arange(self.input_ids.numel())
        return torch.bucketize(flat, boundaries, right=True).view_as(self.input_ids)

    def row_segments(self) -> torch.Tensor:
        """[R, W] int32: each row's segment lengths (its samples, then its padding tail if any), zero-padded
        to the row with most segments. Split by rows with the other tensors, it keeps every group's
        boundaries (:func:`cu_seqlens_of_rows`)."""
        return _row_segments(self.seq_lens, self.row_len)

    def attention_mask_4d(self, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """[R, 1, L, L] mask: query q may attend key k iff both are in the same segment and k <= q.

        Causal within each sample, nothing across samples, real tokens never see padding. Padding
        tails are segments too, so each padding query attends causally within its tail -- at least
        to itself. That keeps every softmax row finite: a fully masked row can give NaN, and in the
        next layer a NaN value reaches real tokens through 0 * NaN in the weighted sum. It is also
        exactly what the varlen kernel does with ``cu_seqlens``, so both paths agree even at
        padding positions (which no loss reads).

        ``dtype=torch.bool``: True = attend (SDPA). A floating dtype gives the additive form (0 or
        the dtype's min), which eager attention needs: it *adds* the mask to the scores, so a bool
        mask there would be silently wrong.
        """
        seg = self.segment_ids()
        pos = torch.arange(self.row_len)
        causal = pos[None, :] <= pos[:, None]  # [L(q), L(k)]
        allowed = (seg[:, :, None] == seg[:, None, :]) & causal
        allowed = allowed[:, None]
        if dtype == torch.bool:
            return allowed
        if not dtype.is_floating_point:
            raise ValueError(f"attention mask dtype must be bool or floating, got {dtype}")
        return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)

    def model_inputs(self, attention: str, device: torch.device | str | None = None) -> dict:
        """Keyword arguments for a transformers causal LM / Llava forward under ``toggles.attention``.

        ``sdpa``: bool 4D mask; ``eager``: additive fp32 4D mask (promotes fine against bf16/fp16
        scores); ``flash``: one ``[1, R*L]`` row and FlashAttentionKwargs -- no attention_mask, since
        transformers only takes the varlen path with explicit cu_seq_lens when the mask is None.
        """
        if attention in ("sdpa", "eager"):
            mask_dtype = torch.bool if attention == "sdpa" else torch.float32
            inputs = {
                "input_ids": self.input_ids,
                "labels": self.labels,
                "position_ids": self.position_ids,
                "attention_mask": self.attention_mask_4d(mask_dtype),
            }
        elif attention == "flash":
            inputs = {
                "input_ids": self.input_ids.reshape(1, -1),
                "labels": self.labels.reshape(1, -1),
                "position_ids": self.position_ids.reshape(1, -1),
                "cu_seq_lens_q": self.cu_seqlens,
                "cu_seq_lens_k": self.cu_seqlens,
                # Python ints: the varlen kernel takes ints; a tensor would be read back from the GPU.
                "max_length_q": self.max_seqlen,
                "max_length_k": self.max_seqlen,
            }
        else:
            raise ValueError(f"toggles.attention must be one of sdpa, eager, flash; got {attention!r}")
        if device is not None:
            inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        return inputs


def _row_segments(seq_lens: list[list[int]], row_len: int) -> torch.Tensor:
    rows = [lens + ([row_len - sum(lens)] if sum(lens) < row_len else []) for lens in seq_lens]
    out = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.int32)
    for r, lens in enumerate(rows):
        out[r, : len(lens)] = torch.tensor(lens, dtype=torch.int32)
    return out


def cu_seqlens_of_rows(row_segments: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_seqlen)`` of the rows' flattened tokens from their :meth:`PackedBatch.row_segments`:
    int32 ``[N+1]`` boundaries of the N non-empty segments in token order, and the longest. Host-side
    (CPU tensors): the kernels take ``max_seqlen`` as a Python int, which a GPU tensor would cost a sync."""
    lengths = row_segments[row_segments > 0]  # row-major: the segments in token order
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lengths.long(), 0).to(torch.int32)
    return cu_seqlens, int(lengths.max())


def _as_tensors(samples: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) of each sample as 1-D long tensors, checked for equal, non-zero length."""
    out = []
    for i, s in enumerate(samples):
        ids = torch.as_tensor(s["input_ids"], dtype=torch.long).reshape(-1)
        lab = torch.as_tensor(s["labels"], dtype=torch.long).reshape(-1)
        if ids.numel() != lab.numel():
            raise ValueError(f"sample {i}: input_ids has {ids.numel()} tokens but labels has {lab.numel()}")
        if ids.numel() == 0:
            raise ValueError(f"sample {i} is empty")
        out.append((ids, lab))
    return out


def _build(
    tensors: list[tuple[torch.Tensor, torch.Tensor]], rows: list[list[int]], row_len: int, pad_id: int
) -> PackedBatch:
    """Lay out samples as ``rows`` (lists of sample indices) of ``row_len`` tokens each."""
    num_rows = len(rows)
    input_ids = torch.full((num_rows, row_len), pad_id, dtype=torch.long)
    labels = torch.full((num_rows, row_len), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((num_rows, row_len), dtype=torch.long)
    seq_lens: list[list[int]] = []
    for r, row in enumerate(rows):
        start = 0
        seq_lens.append([])
        for i in row:
            ids, lab = tensors[i]
            n = ids.numel()
            input_ids[r, start : start + n] = ids
            labels[r, start : start + n] = lab
            # transformers shifts labels inside the loss: position t's label is predicted from
            # token t-1. At a sample's first position that token is the previous sample's last
            # (or the previous row's last, once flattened for flash), so the label is masked.
            # Unpacked, the shift never reads it either -- on and off see the same label set.
            labels[r, start] = IGNORE_INDEX
            position_ids[r, start : start + n] = torch.arange(n)
            seq_lens[r].append(n)
            start += n
    # The segments: each row's samples, then its padding tail as a segment of its own.
    cu_seqlens, max_seqlen = cu_seqlens_of_rows(_row_segments(seq_lens, row_len))
    return PackedBatch(
        input_ids=input_ids,
        labels=labels,
        position_ids=position_ids,
        seq_lens=seq_lens,
        order=[i for row in rows for i in row],
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        num_real_tokens=sum(map(sum, seq_lens)),
        num_labels=int((labels != IGNORE_INDEX).sum()),  # host tensors: no device read
    )


def lay_rows(
    pending: deque, refill: Callable[[], list[dict]], rows: int, row_len: int, *, cut: bool
) -> list[list[dict]]:
    """The next ``rows`` rows of ``row_len`` tokens, laid from a stream of samples in stream order.

    ``pending`` holds the samples read but not yet laid (their order is the stream's); ``refill()`` returns the
    next ones, or nothing when the stream has ended (the rows then stay as filled: short, or empty). Both the
    rows' count and length are fixed, so a micro-batch's size never depends on its documents.

    ``cut=True`` (plain text): rows fill one after the other, and a document longer than the room left is cut:
    its head fills the row, its rest waits in ``pending`` for the next row (of this call or the next one).
    Nothing is padded but the stream's end, nothing is dropped, and each piece is a sample of its own (packing
    masks its first label: one lost target per cut). ``cut=False`` (conversations, never cut): each sample goes
    into the first row with room for it; when none has, the rows are complete and the sample opens the next call.
    """
    laid: list[list[dict]] = [[] for _ in range(rows)]
    room = [row_len] * rows
    while True:
        if not pending:
            pending.extend(refill())
            if not pending:
                return laid
        sample = pending[0]
        n = len(sample["input_ids"])
        if not cut and n > row_len:
            raise ValueError(f"a sample of {n} tokens cannot be laid whole into rows of {row_len}")
        r = next((i for i in range(rows) if room[i] >= (1 if cut else n)), None)
        if r is None:
            return laid
        take = min(n, room[r])
        if take == n:
            laid[r].append(pending.popleft())
        else:  # cut: the head fills the row, the rest stays first in line
            laid[r].append({k: v[:take] for k, v in sample.items()})
            pending[0] = {k: v[take:] for k, v in sample.items()}
        room[r] -= take


def pack_rows(rows: list[list[dict]], row_len: int, pad_id: int) -> PackedBatch:
    """Samples already laid out in rows (:func:`lay_rows`) as a :class:`PackedBatch` of ``len(rows)`` rows of
    ``row_len`` tokens: each row's samples in order, then padding. A row may be empty (all padding)."""
    tensors = _as_tensors([s for row in rows for s in row])
    ordinals = iter(range(len(tensors)))
    return _build(tensors, [[next(ordinals) for _ in row] for row in rows], row_len, pad_id)


ROW_ALIGN = 8  # fit_rows: a row's length is a multiple of this (kernels like aligned shapes)


def pack_samples(samples: list[dict], max_seq_len: int, pad_id: int, *, fit_rows: bool = False) -> PackedBatch:
    """Packing on: FFD-pack ``samples`` into rows of exactly ``max_seq_len`` tokens.

    ``samples``: dicts with ``input_ids`` and ``labels`` (1-D LongTensor or list of ints, same
    length; callers have already put -100 on prompt/image tokens).

    ``fit_rows``: as many rows as FFD needs, but as short as the samples allow: filled evenly (:func:`even_rows`)
    and cut to the longest row's fill, rounded up to a multiple of ROW_ALIGN (never above ``max_seq_len``). The
    padding FFD leaves in its last row is then spread thin: on few samples per rank (a micro-batch of short
    conversations split over dp ranks) it is most of the padding. For callers whose shapes may vary per batch in
    both dimensions (the VLM); the LLM keeps fixed-length rows (sequence and pipeline parallelism want them).

    The VLM reorders ``pixel_values`` by ``PackedBatch.order`` so images line up with the
    ``<image>`` tokens in row-major order.
    """
    if not samples:
        raise ValueError("cannot pack an empty list of samples")
    tensors = _as_tensors(samples)
    rows, row_len = row_layout([ids.numel() for ids, _ in tensors], max_seq_len, fit_rows=fit_rows)
    return _build(tensors, rows, row_len, pad_id)


def row_layout(lengths: Sequence[int], max_seq_len: int, *, fit_rows: bool) -> tuple[list[list[int]], int]:
    """`pack_samples`' rows (indices per row) and row length for samples of ``lengths``, without the tensors."""
    rows = pack_ffd(lengths, max_seq_len)
    if not fit_rows:
        return rows, max_seq_len
    even = even_rows(lengths, len(rows))
    if max(sum(lengths[i] for i in row) for row in even) <= max_seq_len:
        rows = even
    fill = max(sum(lengths[i] for i in row) for row in rows)
    return rows, min(max_seq_len, -(-fill // ROW_ALIGN) * ROW_ALIGN)


def even_rows(lengths: Sequence[int], num_rows: int) -> list[list[int]]:
    """``lengths`` spread over ``num_rows`` rows as evenly as greedy allows: longest first (ties by index), each into
    the least-filled row (the lowest-numbered of equals). Longest-processing-time scheduling: the fullest row holds
    at most 4/3 of the optimum (Graham 1969). Deterministic; within a row, indices in placement order."""
    fill = [0] * num_rows
    rows: list[list[int]] = [[] for _ in range(num_rows)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(num_rows), key=lambda r: (fill[r], r))
        rows[r].append(i)
        fill[r] += lengths[i]
    return rows


def pad_samples(samples: list[dict], pad_id: int, max_seq_len: int | None = None) -> PackedBatch:
    """Packing off: one sample per row, padded to the longest sample (or to ``max_seq_len``: fixed shapes).

    Same structure and label masking as ``pack_samples``, so the two give the same loss.
    """
    if not samples:
        raise ValueError("cannot pad an empty list of samples")
    tensors = _as_tensors(samples)
    lengths = [ids.numel() for ids, _ in tensors]
    row_len = max(lengths) if max_seq_len is None else max_seq_len
    for n in lengths:
        if n > row_len:
            raise ValueError(f"sample of length {n} exceeds data.max_seq_len {row_len}")
    return _build(tensors, [[i] for i in range(len(tensors))], row_len, pad_id)


def plan_window(
    sizes: Sequence[tuple[int, int]], *, steps: int, slots: int, max_seq_len: int, packing: bool = True
) -> list[list[list[int]]]:
    """Which samples of a window of ``steps`` global batches go into which step, and into which of the step's
    ``slots`` micro-batches (data-parallel ranks x accumulation steps), so that both sides of every micro-batch are
    well filled: ``plan[step][slot]`` lists window indices, ascending.

    ``sizes``: per sample ``(tokens, patches)``: its language-model tokens (text + image tokens, as the processor
    makes them) and its vision-tower patches. Every step gets exactly ``len(sizes) / steps`` samples (the global
    batch stays a number of samples), every sample exactly one place; deterministic (ties by index). One step
    (``steps=1``) keeps the step's samples and only chooses who takes which: the step's gradient is the same sum.

    Steps: the window sorted by tokens and dealt out in a snake, so each step holds the same mix of long and short,
    image-heavy and text-only samples: the fillers a micro-batch's rows and tower sequence need. Slots, from two
    starts: the samples, largest first, each to the slot whose larger relative load (tokens against the step's mean
    per slot, patches likewise) grows least (vector LPT scheduling); or the step's FFD rows, as full as rows get,
    dealt to the slots by rows then patches. From each, single moves and swaps between slots are taken (best first,
    at most SEARCH_BUDGET tried) while they lower the step's waste, and the start that ends lower wins. The waste is
    what the collate makes of each slot -- the padding in its rows (`row_layout`: packed with fit_rows, or padded
    one sample per row), over the step's tokens -- plus the tower's idle share: every micro-batch's tower sequence
    as long as the step's longest (memory is sized for it, and the other ranks wait for it at the gradient
    reduction), over the step's patches.
    """
    n = len(sizes)
    if steps <= 0 or slots <= 0 or n % steps:
        raise ValueError(f"a window of {n} samples cannot be cut into {steps} steps")
    tokens = [min(max(int(t), 1), max_seq_len) for t, _ in sizes]
    patches = [int(p) for _, p in sizes]
    order = sorted(range(n), key=lambda i: (-tokens[i], -patches[i], i))
    members: list[list[int]] = [[] for _ in range(steps)]
    for r, i in enumerate(order):
        lap, pos = divmod(r, steps)
        members[pos if lap % 2 == 0 else steps - 1 - pos].append(i)
    return [_StepPlan(m, tokens, patches, slots, max_seq_len, packing).best() for m in members]


class _StepPlan:
    """One step's samples into its slots (`plan_window`)."""

    def __init__(self, members: list[int], tokens: list[int], patches: list[int], slots: int, cap: int, packing: bool):
        self.tokens, self.patches, self.cap, self.packing = tokens, patches, cap, packing
        self.seen: dict[tuple[int, ...], int] = {}  # padding per multiset of lengths
        self.total_tokens = max(1, sum(tokens[i] for i in members))
        self.total_patches = sum(patches[i] for i in members)
        self.members, self.slots = members, slots

    def balanced(self) -> list[list[int]]:
        """Samples, largest first, each to the slot whose larger relative load grows least (vector LPT)."""
        mean_t, mean_p = self.total_tokens / self.slots, max(1, self.total_patches) / self.slots
        out: list[list[int]] = [[] for _ in range(self.slots)]
        load = [[0, 0] for _ in range(self.slots)]
        t, p = self.tokens, self.patches
        for i in sorted(self.members, key=lambda i: (-max(t[i] / mean_t, p[i] / mean_p), i)):
            s = min(
                range(self.slots), key=lambda s: (max((load[s][0] + t[i]) / mean_t, (load[s][1] + p[i]) / mean_p), s)
            )
            out[s].append(i)
            load[s][0] += t[i]
            load[s][1] += p[i]
        return out

    def by_rows(self) -> list[list[int]]:
        """The step's FFD rows (as full as rows get), each to the slot with fewest rows, then fewest patches."""
        rows = [[self.members[j] for j in r] for r in pack_ffd([self.tokens[i] for i in self.members], self.cap)]
        out: list[list[int]] = [[] for _ in range(self.slots)]
        fill = [[0, 0] for _ in range(self.slots)]
        for row in sorted(rows, key=lambda r: (-sum(self.patches[i] for i in r), r[0])):
            s = min(range(self.slots), key=lambda s: (fill[s], s))
            out[s] += row
            fill[s][0] += 1
            fill[s][1] += sum(self.patches[i] for i in row)
        return out

    def best(self) -> list[list[int]]:
        """The better of two starts, each improved by `solve`: balanced loads, or full rows."""
        plans = [self.solve(start) for start in (self.balanced(), self.by_rows())]
        return min(plans, key=lambda p: (p[0], plans.index(p)))[1]

    def padding(self, slot: list[int]) -> int:
        """Empty token slots in the rows the collate lays out for these samples (a function of their lengths)."""
        if not slot:
            return 0
        lengths = tuple(sorted(self.tokens[i] for i in slot))
        if lengths not in self.seen:
            if not self.packing:
                self.seen[lengths] = len(lengths) * lengths[-1] - sum(lengths)
            else:
                rows, row_len = row_layout(lengths, self.cap, fit_rows=True)
                self.seen[lengths] = len(rows) * row_len - sum(lengths)
        return self.seen[lengths]

    def waste(self, padding: list[int], loads: list[int]) -> float:
        idle = len(loads) * max(loads) - self.total_patches
        return sum(padding) / self.total_tokens + (idle / self.total_patches if self.total_patches else 0.0)

    def solve(self, out: list[list[int]]) -> tuple[float, list[list[int]]]:
        """Moves and swaps from the slots with most padding and most patches while the waste falls: (waste, plan)."""
        num = len(out)
        padding = [self.padding(s) for s in out]
        loads = [sum(self.patches[i] for i in s) for s in out]
        best, tried = self.waste(padding, loads), 0
        while tried < SEARCH_BUDGET:  # each change taken lowers the waste
            # From the slots the waste is about (most padding, most patches) to any other: a move or a swap.
            worst = {max(range(num), key=lambda s: (padding[s], -s)), max(range(num), key=lambda s: (loads[s], -s))}
            changes = [
                (a, b, x, y)
                for a in sorted(worst)
                for b in range(num)
                if b != a
                for x, y in [(x, None) for x in out[a]] + [(x, y) for x in [*out[a], None] for y in out[b]]
            ][: SEARCH_BUDGET - tried]
            tried += len(changes)
            found = None
            for a, b, x, y in changes:
                moved = (self.patches[x] if x is not None else 0) - (self.patches[y] if y is not None else 0)
                sa = [i for i in out[a] if i != x] + ([y] if y is not None else [])
                sb = [i for i in out[b] if i != y] + ([x] if x is not None else [])
                trial_pad, trial_load = list(padding), list(loads)
                trial_pad[a], trial_pad[b] = self.padding(sa), self.padding(sb)
                trial_load[a], trial_load[b] = loads[a] - moved, loads[b] + moved
                w = self.waste(trial_pad, trial_load)
                if w < best - 1e-12 and (found is None or w < found[0]):
                    found = (w, a, b, sa, sb, trial_pad, trial_load)
            if found is None:
                break
            best, a, b, out[a], out[b], padding, loads = found
        return best, [sorted(s) for s in out]
