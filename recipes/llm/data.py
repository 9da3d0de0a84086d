"""LLM inputs: tokenized documents -> rows of data.max_seq_len tokens, packed with document masking.

A micro-batch is ``trainer.micro_batch_size`` rows of ``data.max_seq_len`` tokens per data-parallel rank, whatever
its documents' lengths (torchtitan, Megatron and nanoGPT bound it the same way; the memory planner prices it so).
Every rank reads the same global document stream and lays it into global micro-batches of ``micro_batch_size x
dp`` rows (:class:`RowStream`): documents follow each other in a row, never attending across each other; one that
does not fit is cut, and its rest opens the next row or micro-batch. Data-parallel rank r takes rows r, r+dp, ...,
so the global batch -- and the loss -- does not depend on the parallel layout, and neither does the saved position.

A text sample trains on every token; a chat sample (``mask.npy`` beside ``ids.npy``, written by
the prepare_chat builder) only on the tokens its mask marks, the assistant's: the others get label
-100, so the loss and its normalization (a sum over labelled tokens / their global count) see
only them. Conversations are never cut: one that does not fit the rows left opens the next micro-batch.
"""

from __future__ import annotations

import collections
import io
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.config import TrainConfig
from common.data import prepare_dataset
from common.data.dataset import load_asset
from common.data.packing import IGNORE_INDEX, PackedBatch, lay_rows, pack_rows
from common.data.webdataset import train_loader
from common.distributed import DistInfo
from common.errors import DataError
from recipes.llm.model import Segments

if TYPE_CHECKING:  # transformers is slow to import; load it only where it is used
    from transformers import PreTrainedTokenizerFast

TOKENIZER_DIR = "tokenizer"  # the dataset's side folder holding the tokenizer (meta.json: "tokenizer")


def prepare_data(cfg: TrainConfig, dist: DistInfo) -> dict:
    """Shards and tokenizer meta on every rank (built by the dataset's builder, data.build, if missing).

    Conversations are never cut (a cut reply teaches stopping mid-sentence), so a chat dataset whose
    longest conversation exceeds ``data.max_seq_len`` is refused here, in one line.
    """
    meta = prepare_dataset(cfg.data, dist, asset=TOKENIZER_DIR)
    if meta.get("format") == "chat" and meta["longest_sample"] > cfg.data.max_seq_len:
        raise DataError(
            f"data.root={cfg.data.root} holds conversations of up to {meta['longest_sample']} tokens, more than "
            f"data.max_seq_len={cfg.data.max_seq_len}: raise data.max_seq_len or rebuild it with "
            f"the prepare_chat builder: --max-seq-len {cfg.data.max_seq_len} ... --force"
        )
    return meta


def pad_id(tokenizer: PreTrainedTokenizerFast) -> int:
    """The id that fills packed rows: the pad token, else eos (Llama 3 defines no pad token). Padding is
    never attended to by real tokens and never labelled, so any id does."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def load_tokenizer(root: str | Path) -> PreTrainedTokenizerFast:
    """The dataset's tokenizer, offline. ``root`` is the dataset dir or its ``tokenizer`` dir."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    return load_asset(root, TOKENIZER_DIR, AutoTokenizer, PreTrainedTokenizerFast)


def decode_document(sample: dict) -> dict:
    """Raw WebDataset sample -> ``{"input_ids": LongTensor[T], "labels": LongTensor[T]}``: a document's
    (``<s>`` + tokens + ``</s>``) labels are its ids; a conversation's are -100 where ``mask.npy`` is 0.

    Module-level (hence picklable) so that it can be handed to DataLoader workers as the
    ``decode`` of ``common.data.webdataset.build_webdataset_loader``.
    """
    ids = np.load(io.BytesIO(sample["ids.npy"]), allow_pickle=False)
    if ids.ndim != 1 or ids.size < 2 or ids.dtype.kind not in "iu":
        raise ValueError(
            f"{sample.get('__key__')}: expected a 1-D integer array of >= 2 ids, got {ids.dtype} {ids.shape}"
        )
    input_ids = torch.from_numpy(ids.astype(np.int64))
    if "mask.npy" not in sample:
        return {"input_ids": input_ids, "labels": input_ids}
    mask = np.load(io.BytesIO(sample["mask.npy"]), allow_pickle=False)
    if mask.shape != ids.shape:
        raise ValueError(f"{sample.get('__key__')}: mask.npy has shape {mask.shape}, ids.npy {ids.shape}")
    return {"input_ids": input_ids, "labels": input_ids.masked_fill(torch.from_numpy(mask == 0), IGNORE_INDEX)}


class RowStream:
    """The global document stream laid into global micro-batches of ``rows`` rows of ``row_len`` tokens
    (`common.data.packing.lay_rows`): a micro-batch is ``trainer.micro_batch_size x dp`` rows of
    ``data.max_seq_len`` tokens whatever its documents' lengths, and dp rank r trains on rows r, r+dp, ...

    A document that does not fit the rows left continues in the next micro-batch, so nothing is dropped, the
    stream of rows depends on the global micro-batch only (not on the layout), and the saved position (the
    loader's, plus the pieces read but not yet laid) resumes exactly, mid-document. Conversations (``cut=False``)
    are never cut. The loader reads ``rows`` documents at a time (its own batches, in its workers).
    """

    def __init__(self, loader, *, rows: int, row_len: int, cut: bool):
        self.loader, self.rows, self.row_len, self.cut = loader, rows, row_len, cut
        self.pending: collections.deque[dict] = collections.deque()  # read, not yet laid, in stream order

    def __iter__(self) -> Iterator[list[list[dict]]]:
        documents = iter(self.loader)
        while True:
            yield lay_rows(self.pending, lambda: next(documents), self.rows, self.row_len, cut=self.cut)

    def state_dict(self) -> dict:
        # clone: a piece is a view, and saving it would save its whole document (a pair's key is a str)
        pending = [{k: v.clone() if torch.is_tensor(v) else v for k, v in piece.items()} for piece in self.pending]
        return {"loader": self.loader.state_dict(), "pending": pending}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])
        self.pending = collections.deque(state["pending"])

    @property
    def epoch(self) -> int:
        return self.loader.epoch

    @property
    def corrupt_shards(self) -> int:
        return self.loader.corrupt_shards

    def close(self) -> None:
        self.loader.close()


def build_train_loader(cfg: TrainConfig, urls: list[str], dp: int, *, chat: bool, decode=decode_document) -> RowStream:
    """``decode``: a sample's decoder (preference pairs: recipes/llm/preference.py:decode_pair, laid whole)."""
    rows = cfg.trainer.micro_batch_size * dp  # the global micro-batch
    loader = train_loader(cfg, urls, decode=decode, collate=list, batch_size=rows, rank=0, world_size=1)
    loader.resume_hints["batch_size"] = (
        f"rows per global micro-batch: trainer.micro_batch_size={cfg.trainer.micro_batch_size} x dp={dp} "
        "data-parallel ranks; set them so that their product is {saved}"
    )
    return RowStream(loader, rows=rows, row_len=cfg.data.max_seq_len, cut=not chat)


def local_batch(rows: list[list[dict]], *, dp_rank: int, dp: int, max_seq_len: int, pad_id: int) -> PackedBatch:
    """This dp rank's rows of a global micro-batch (rows r, r+dp, ...) packed (labels unshifted: the shift
    happens in the loss, and each piece's first label is masked by the packer)."""
    return pack_rows(rows[dp_rank::dp], max_seq_len, pad_id)


def eval_batches(documents: list[dict], rows: int, row_len: int, *, chat: bool) -> list[list[list[dict]]]:
    """Held-out documents laid into global micro-batches as training lays them; the last one's missing rows empty."""
    pending = collections.deque(documents)
    batches = []
    while pending:
        batches.append(lay_rows(pending, list, rows, row_len, cut=not chat))
    return batches


def model_inputs(packed: PackedBatch, attention: str, device: torch.device) -> dict:
    """The Transformer's keyword inputs for a packed batch: per-document ``position_ids`` and the document
    boundaries as the attention kernel takes them, both from the same ``cu_seqlens``. ``flash``: the
    boundaries themselves (``Segments``, for the varlen kernel on CUDA; nothing quadratic is built);
    otherwise the ``[rows, 1, L, L]`` block-diagonal causal mask for SDPA."""
    if attention == "flash":
        attn_mask = Segments(packed.cu_seqlens.to(device, non_blocking=True), packed.max_seqlen)
    else:
        attn_mask = packed.attention_mask_4d().to(device)
    return {"position_ids": packed.position_ids.to(device), "attn_mask": attn_mask}


def real_token_mask(packed: PackedBatch) -> torch.Tensor:
    """``[rows, L]`` bool: True on the documents' tokens, False on the padding that fills each row's end."""
    lengths = torch.tensor([sum(lens) for lens in packed.seq_lens])
    return torch.arange(packed.row_len) < lengths[:, None]
