"""VLM inputs: image–conversation shards → tokenized samples → packed (or padded) micro-batches."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from common.config import TrainConfig
from common.data.packing import PackedBatch, pack_samples, pad_samples
from common.data.webdataset import build_webdataset_loader
from common.distributed import DistInfo, barrier


def prepare_data(cfg: TrainConfig, dist: DistInfo) -> dict:
    """Build the image–text shards, tokenizer and processor on rank 0 if missing; meta on every rank."""
    from data.prepare_vlm_digits import ensure_vlm_digits

    kwargs = dict(image_size=cfg.model.image_size, patch_size=cfg.model.patch_size)
    if dist.is_main:
        if not cfg.data.prepare and not (Path(cfg.data.root) / "meta.json").exists():
            raise FileNotFoundError(f"data.root={cfg.data.root}: no meta.json (run python -m data.prepare_vlm_digits --out {cfg.data.root})")
        meta = ensure_vlm_digits(cfg.data.root, **kwargs)
    barrier()
    if not dist.is_main:
        meta = ensure_vlm_digits(cfg.data.root, **kwargs)  # already built: reads meta.json
    return meta


def collate(samples: list[dict], *, packing: bool, max_seq_len: int, pad_id: int, attention: str) -> dict:
    """Runs in the loader workers: the micro-batch as model inputs, plus token accounting.

    Packing only regroups the same samples into fewer rows, so the loss (a token mean over
    the micro-batch) is the same with packing on or off.
    """
    packed: PackedBatch = pack_samples(samples, max_seq_len, pad_id) if packing else pad_samples(samples, pad_id)
    inputs = packed.model_inputs(attention)
    # Images in the order their <image> tokens appear in the row-major flattened batch.
    inputs["pixel_values"] = torch.stack([samples[i]["pixel_values"] for i in packed.order])
    slots = packed.input_ids.numel()
    return {"inputs": inputs, "real_tokens": packed.num_real_tokens, "slots": slots, "samples": len(samples)}


def build_train_loader(cfg: TrainConfig, dist: DistInfo, urls: list[str], processor):
    from data.prepare_vlm_digits import encode_sample

    return build_webdataset_loader(
        urls,
        decode=functools.partial(encode_sample, processor=processor),
        collate=functools.partial(
            collate, packing=cfg.data.packing, max_seq_len=cfg.data.max_seq_len,
            pad_id=processor.tokenizer.pad_token_id, attention=cfg.toggles.attention,
        ),
        batch_size=cfg.trainer.micro_batch_size,
        rank=dist.rank,
        world_size=dist.world_size,
        num_workers=cfg.data.num_workers,
        seed=cfg.trainer.seed,
        shuffle_buffer=cfg.data.shuffle_buffer,
        max_corrupt_shards=cfg.data.max_corrupt_shards,
    )
