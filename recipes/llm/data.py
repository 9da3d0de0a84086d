"""LLM inputs: tokenized documents → chunks of at most max_seq_len → packed rows with document masking.

Every rank reads the same global document stream and data-parallel rank r takes documents
r, r+dp, ... of each global micro-batch, so the global batch — and the loss — does not
depend on the parallel layout (tp/dp), and neither does the loader's saved position.

A text sample trains on every token; a chat sample (``mask.npy`` beside ``ids.npy``, written by
the prepare_chat builder) only on the tokens its mask marks, the assistant's: the others get label
-100, so the loss and its normalization (a sum over labelled tokens / their global count) see
only them. Packed rows keep conversations apart as they keep documents apart.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.config import TrainConfig
from common.data import prepare_dataset
from common.data.dataset import load_asset
from common.data.packing import IGNORE_INDEX, PackedBatch, pack_samples
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


def chunk_document(ids: torch.Tensor, max_len: int) -> list[torch.Tensor]:
    """Consecutive pieces of a 1-D ``ids`` of at most ``max_len`` tokens each (all full but the last).

    ``torch.cat(pieces)`` equals ``ids``: nothing overlaps or is dropped. Each piece is packed as
    its own sample, so the first token of a piece gets no next-token target across the cut
    (one lost target per cut). Pieces are views into ``ids``.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    return list(ids.split(max_len)) if ids.numel() else []


def build_train_loader(cfg: TrainConfig, urls: list[str], dp: int):
    micro = cfg.trainer.micro_batch_size
    loader = train_loader(
        cfg,
        urls,
        decode=decode_document,
        collate=list,
        batch_size=micro * dp,  # the global micro-batch, in documents
        rank=0,
        world_size=1,
    )  # one stream, sliced per dp rank in `local_batch`
    loader.resume_hints["batch_size"] = (
        f"documents per micro-batch: trainer.micro_batch_size={micro} x dp={dp} "
        "data-parallel ranks; set them so that their product is {saved}"
    )
    return loader


def local_batch(documents: list[dict], *, dp_rank: int, dp: int, max_seq_len: int, pad_id: int) -> PackedBatch:
    """This dp rank's documents, cut to max_seq_len, packed into rows (labels unshifted: the shift
    happens in the loss, and each piece's first label is masked by the packer)."""
    samples = [
        {"input_ids": ids, "labels": labels}
        for doc in documents[dp_rank::dp]
        for ids, labels in zip(
            chunk_document(doc["input_ids"], max_seq_len), chunk_document(doc["labels"], max_seq_len)
        )
    ]
    return pack_samples(samples, max_seq_len, pad_id)


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
