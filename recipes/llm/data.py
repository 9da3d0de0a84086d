"""LLM inputs: tokenized documents → chunks of at most max_seq_len → packed rows with document masking.

Every rank reads the same global document stream and data-parallel rank r takes documents
r, r+dp, ... of each global micro-batch, so the global batch — and the loss — does not
depend on the parallel layout (tp/dp), and neither does the loader's saved position.
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
from common.data.packing import PackedBatch, pack_samples
from common.data.webdataset import build_webdataset_loader
from common.distributed import DistInfo

if TYPE_CHECKING:  # transformers is slow to import; load it only where it is used
    from transformers import PreTrainedTokenizerFast

TOKENIZER_DIR = "tokenizer"  # the dataset's side folder holding the tokenizer (meta.json: "tokenizer")


def prepare_data(cfg: TrainConfig, dist: DistInfo) -> dict:
    """Shards and tokenizer meta on every rank (built by the dataset's builder, data.build, if missing)."""
    return prepare_dataset(cfg.data, dist, asset=TOKENIZER_DIR)


def load_tokenizer(root: str | Path) -> PreTrainedTokenizerFast:
    """The dataset's tokenizer, offline. ``root`` is the dataset dir or its ``tokenizer`` dir."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    return load_asset(root, TOKENIZER_DIR, AutoTokenizer, PreTrainedTokenizerFast)


def decode_document(sample: dict) -> dict:
    """Raw WebDataset sample -> ``{"input_ids": LongTensor[T]}`` (``<s>`` + tokens + ``</s>``).

    Module-level (hence picklable) so that it can be handed to DataLoader workers as the
    ``decode`` of ``common.data.webdataset.build_webdataset_loader``.
    """
    ids = np.load(io.BytesIO(sample["ids.npy"]), allow_pickle=False)
    if ids.ndim != 1 or ids.size < 2 or ids.dtype.kind not in "iu":
        raise ValueError(f"{sample.get('__key__')}: expected a 1-D integer array of >= 2 ids, got {ids.dtype} {ids.shape}")
    return {"input_ids": torch.from_numpy(ids.astype(np.int64))}


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
    return build_webdataset_loader(
        urls, decode=decode_document, collate=list,
        batch_size=cfg.trainer.micro_batch_size * dp,  # the global micro-batch, in documents
        rank=0, world_size=1,  # one stream, sliced per dp rank in `local_batch`
        num_workers=cfg.data.num_workers, seed=cfg.trainer.seed,
        shuffle_buffer=cfg.data.shuffle_buffer, max_corrupt_shards=cfg.data.max_corrupt_shards,
    )


def local_batch(documents: list[dict], *, dp_rank: int, dp: int, max_seq_len: int, pad_id: int) -> PackedBatch:
    """This dp rank's documents, cut to max_seq_len, packed into rows (labels = inputs; the
    shift happens in the loss, and each piece's first label is masked by the packer)."""
    samples = [
        {"input_ids": piece, "labels": piece}
        for doc in documents[dp_rank::dp]
        for piece in chunk_document(doc["input_ids"], max_seq_len)
    ]
    return pack_samples(samples, max_seq_len, pad_id)
