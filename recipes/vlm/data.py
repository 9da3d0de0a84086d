"""VLM inputs: image–conversation shards → tokenized samples → packed (or padded) micro-batches."""

from __future__ import annotations

import functools

import torch

from common.config import TrainConfig
from common.data import prepare_dataset
from common.data.packing import PackedBatch, pack_samples, pad_samples
from common.data.webdataset import build_webdataset_loader
from common.distributed import DistInfo


def prepare_data(cfg: TrainConfig, dist: DistInfo) -> dict:
    """Shards, tokenizer and processor meta on every rank (rank 0 builds them if missing)."""
    from data.prepare_vlm_digits import ensure_vlm_digits

    def ensure() -> dict:
        return ensure_vlm_digits(cfg.data.root, image_size=cfg.model.image_size, patch_size=cfg.model.patch_size)

    return prepare_dataset(cfg.data, dist, ensure, "data.prepare_vlm_digits")


def collate(samples: list[dict], *, packing: bool, max_seq_len: int, pad_id: int) -> dict:
    """Runs in the loader workers: the packed micro-batch, its images, and token accounting.

    Packing only regroups the same samples into fewer rows, so the loss (a token mean over
    the micro-batch) is the same with packing on or off. The trainer turns the PackedBatch into
    model inputs: a 4D mask is rows x L x L, too big to pass between processes every step.
    """
    packed: PackedBatch = pack_samples(samples, max_seq_len, pad_id) if packing else pad_samples(samples, pad_id)
    # Images in the order their <image> tokens appear in the row-major flattened batch.
    pixel_values = torch.stack([samples[i]["pixel_values"] for i in packed.order])
    slots = packed.input_ids.numel()
    return {"packed": packed, "pixel_values": pixel_values, "real_tokens": packed.num_real_tokens, "slots": slots,
            "samples": len(samples)}


def build_train_loader(cfg: TrainConfig, dist: DistInfo, urls: list[str], processor):
    from data.prepare_vlm_digits import encode_sample

    return build_webdataset_loader(
        urls,
        decode=functools.partial(encode_sample, processor=processor),
        collate=functools.partial(
            collate, packing=cfg.data.packing, max_seq_len=cfg.data.max_seq_len,
            pad_id=processor.tokenizer.pad_token_id,
        ),
        batch_size=cfg.trainer.micro_batch_size,
        rank=dist.rank,
        world_size=dist.world_size,
        num_workers=cfg.data.num_workers,
        seed=cfg.trainer.seed,
        shuffle_buffer=cfg.data.shuffle_buffer,
        max_corrupt_shards=cfg.data.max_corrupt_shards,
    )
