"""LLM inputs: tokenized documents → chunks of at most max_seq_len → packed rows with document masking.

Every rank reads the same global document stream and data-parallel rank r takes documents
r, r+dp, ... of each global micro-batch, so the global batch — and the loss — does not
depend on the parallel layout (tp/dp), and neither does the loader's saved position.
"""

from __future__ import annotations

from common.config import TrainConfig
from common.data import prepare_dataset
from common.data.packing import PackedBatch, pack_samples
from common.data.webdataset import build_webdataset_loader
from common.distributed import DistInfo


def prepare_data(cfg: TrainConfig, dist: DistInfo) -> dict:
    from data.prepare_text import ensure_text_shards

    return prepare_dataset(cfg.data, dist, lambda: ensure_text_shards(cfg.data.root), "data.prepare_text")


def build_train_loader(cfg: TrainConfig, urls: list[str], dp: int):
    from data.prepare_text import decode_document

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
    from data.prepare_text import chunk_document

    samples = [
        {"input_ids": piece, "labels": piece}
        for doc in documents[dp_rank::dp]
        for piece in chunk_document(doc["input_ids"], max_seq_len)
    ]
    return pack_samples(samples, max_seq_len, pad_id)
