"""VLM inputs: image–conversation shards → tokenized samples (the chat format) → packed (or padded) micro-batches."""

from __future__ import annotations

import functools
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.config import TrainConfig
from common.data import prepare_dataset
from common.data.dataset import load_asset
from common.data.packing import IGNORE_INDEX, PackedBatch, pack_samples, pad_samples
from common.data.webdataset import build_webdataset_loader
from common.distributed import DistInfo
from common.errors import DataError

if TYPE_CHECKING:  # transformers is slow to import; load it only where it is used
    from PIL.Image import Image
    from transformers import LlavaProcessor

PROCESSOR_DIR = "processor"  # the dataset's side folder holding the processor (meta.json: "processor")
NUM_CLASSES = 10  # digits 0-9


def prepare_data(cfg: TrainConfig, dist: DistInfo) -> dict:
    """Shards and processor meta on every rank (built by the dataset's builder, data.build, if missing)."""
    meta = prepare_dataset(cfg.data, dist, asset=PROCESSOR_DIR)
    # The processor decides how many image tokens a prompt holds; the vision tower must agree.
    built = {"image_size": meta["image_size"], "patch_size": meta["patch_size"]}
    wanted = {"image_size": cfg.model.image_size, "patch_size": cfg.model.patch_size}
    if built != wanted:
        raise DataError(f"data.root={cfg.data.root} was built for {built}, the model has {wanted}: "
                        "rebuild it with those sizes (see data.build) or point data.root elsewhere")
    return meta


def load_processor(root: str | Path) -> LlavaProcessor:
    """The dataset's processor, offline. ``root`` is the dataset dir or its ``processor`` dir."""
    from transformers import AutoProcessor, LlavaProcessor

    return load_asset(root, PROCESSOR_DIR, AutoProcessor, LlavaProcessor)


def decode_png(data: bytes) -> Image:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return im.convert("L")  # a loaded copy, independent of the buffer


def prompt_messages(question: str) -> list[dict]:
    """The user turn: the image, then the question (OpenAI-style content parts)."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def encode_sample(sample: dict, processor: LlavaProcessor) -> dict:
    """Raw WebDataset sample -> one training sequence.

    ``input_ids`` [T]: the chat-templated prompt (image tokens expanded) + answer + eos.
    ``labels`` [T]: -100 on the prompt (image tokens included), the answer and eos ids after it.
    ``pixel_values`` [3, S, S] float32; ``label`` int; ``question``, ``answer``, ``key`` str.

    Module-level and deterministic, so ``functools.partial(encode_sample, processor=p)`` is the
    ``decode`` of ``common.data.webdataset.build_webdataset_loader`` (pickled into workers).
    """
    key = sample.get("__key__")
    text = json.loads(sample["json"])
    label = int(sample["cls"])
    if text["label"] != label or not 0 <= label < NUM_CLASSES:
        raise ValueError(f"{key}: json label {text['label']} and cls {label} disagree or are outside 0..{NUM_CLASSES - 1}")
    image = decode_png(sample["png"])
    # Exactly the inference path: template with a generation prompt, then the processor.
    prompt = processor.apply_chat_template(prompt_messages(text["question"]), add_generation_prompt=True)
    enc = processor(text=prompt, images=image, return_tensors="pt")
    prompt_ids = enc["input_ids"][0]
    tok = processor.tokenizer
    # The answer tokenizes the same alone as after the prompt: the prompt ends in "\n", which
    # the byte-level pre-tokenizer always splits from the following word.
    answer_ids = torch.tensor([*tok(text["answer"], add_special_tokens=False)["input_ids"], tok.eos_token_id], dtype=torch.long)
    input_ids = torch.cat([prompt_ids.long(), answer_ids])
    labels = torch.cat([torch.full_like(prompt_ids, IGNORE_INDEX, dtype=torch.long), answer_ids])
    return {
        "input_ids": input_ids,
        "labels": labels,
        "pixel_values": enc["pixel_values"][0].float(),
        "label": label,
        "question": text["question"],
        "answer": text["answer"],
        "key": key,
    }


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
