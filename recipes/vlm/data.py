"""VLM inputs: image–conversation shards → tokenized samples (the model's chat template, labels on the
assistant turns) → packed (or padded) micro-batches.

Two datasets: the digits demo (the prepare_vlm_digits builder: a question and an answer per digit image, with
its own processor) and LLaVA-format conversations (the prepare_llava builder: multi-turn, zero or more images,
no processor: the text is tokenized here, in the loader workers, by the processor of the model being
trained). Both go through `encode_conversation`.
"""

from __future__ import annotations

import functools
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.config import TrainConfig
from common.data import prepare_dataset
from common.data.dataset import load_asset, load_dataset_meta
from common.data.packing import IGNORE_INDEX, PackedBatch, pack_samples, pad_samples
from common.data.webdataset import PackPlan, global_train_loader
from common.distributed import DistInfo
from common.errors import ConfigError, DataError

if TYPE_CHECKING:  # transformers is slow to import; load it only where it is used
    from PIL.Image import Image
    from transformers import LlavaProcessor

PROCESSOR_DIR = "processor"  # the dataset's side folder holding the processor (meta.json: "processor")
NUM_CLASSES = 10  # digits 0-9
CONVERSATIONS = "llava-conversations"  # meta.json "format" of a prepare_llava dataset
PAIRS = "llava-preference"  # meta.json "format" of prepare_preference's pairs with images (recipes/vlm/preference.py)
IMAGE_TOKEN = "<image>"


def prepare_data(cfg: TrainConfig, dist: DistInfo) -> dict:
    """Shards and meta on every rank (built by the dataset's builder, data.build, if missing)."""
    try:
        meta = prepare_dataset(cfg.data, dist)
    except DataError as exc:
        if cfg.data.build:
            raise
        raise DataError(
            f"{exc}; LLaVA-format data becomes a dataset with the prepare_llava builder: --json FILE "
            f"--images DIR --out {cfg.data.root}"
        ) from None
    if is_conversations(meta):
        return meta
    # The digits: their processor must be there too (recipes/vlm/weights.py: FreshWeights checks it fits `model.*`).
    return load_dataset_meta(cfg.data.root, asset=PROCESSOR_DIR)


def is_conversations(meta: dict) -> bool:
    """Whether the data is conversations the model's processor tokenizes (prepare_llava's, or preference pairs with
    images), not the digits demo's questions."""
    return meta.get("format") in (CONVERSATIONS, PAIRS)


def load_processor(root: str | Path) -> LlavaProcessor:
    """The dataset's processor, offline. ``root`` is the dataset dir or its ``processor`` dir."""
    from transformers import AutoProcessor, LlavaProcessor

    return load_asset(root, PROCESSOR_DIR, AutoProcessor, LlavaProcessor)


def decode_image(data: bytes, mode: str = "RGB") -> Image:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return im.convert(mode)  # a loaded copy, independent of the buffer


def decode_png(data: bytes) -> Image:
    return decode_image(data, "L")


def prompt_messages(question: str) -> list[dict]:
    """The user turn: the image, then the question (OpenAI-style content parts)."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


# --- conversations -> token ids and labels ---------------------------------------------------------------

_STRING_CONTENT: dict[str, bool] = {}


def _template_messages(messages: list[dict], processor: LlavaProcessor) -> list[dict]:
    """Messages as the chat template takes them. Content is a string with `<image>` where an image goes;
    a template that renders strings gets it as is (a language model's own template), one that only
    renders OpenAI-style parts (llava-hf's) gets [image, text, ...] parts."""
    template = processor.chat_template
    if template not in _STRING_CONTENT:
        probe = processor.apply_chat_template([{"role": "user", "content": "kiln-probe"}], tokenize=False)
        _STRING_CONTENT[template] = "kiln-probe" in probe
    if _STRING_CONTENT[template]:
        return messages
    out = []
    for m in messages:
        parts = []
        for i, text in enumerate(m["content"].split(IMAGE_TOKEN)):
            if i:
                parts.append({"type": "image"})
            if text.strip():
                parts.append({"type": "text", "text": text.strip()})
        out.append({"role": m["role"], "content": parts})
    return out


def chat_prompt(processor: LlavaProcessor, messages: list[dict]) -> str:
    """The rendered prompt that asks the model for the next assistant turn (generation)."""
    return processor.apply_chat_template(
        _template_messages(messages, processor), add_generation_prompt=True, tokenize=False
    )


def render_turns(messages: list[dict], processor) -> tuple[str, list[tuple[int, int]]]:
    """The conversation as the chat template renders it, and the character spans of its assistant turns: for turn
    i, what the template adds beyond the generation prompt of turns < i (the answer and its end of turn, e.g. eos).
    ``processor``: anything with the template's ``apply_chat_template`` and ``chat_template`` (a processor or a
    tokenizer). ValueError if the template does not render turn by turn (each prefix a prefix of the whole)."""
    msgs = _template_messages(messages, processor)
    render = functools.partial(processor.apply_chat_template, tokenize=False)
    text = render(msgs)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(msgs[:i], add_generation_prompt=True), render(msgs[: i + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(
                "the chat template does not render conversations turn by turn (a rendered prefix of the "
                "conversation is not a prefix of the whole), so the assistant turns cannot be located"
            )
        # Whitespace closing a turn is layout, not answer: left unlabeled, it cannot drag the next turn's
        # first token (" USER") into the labels.
        spans.append((len(before), len(through.rstrip())))
    return text, spans


def whole_images_cut(ids: np.ndarray, image_token_id: int, counts: list[int], max_seq_len: int) -> tuple[int, int]:
    """Where a sequence over ``max_seq_len`` tokens is cut, never inside an image: ``(cut, images kept)``. Image i
    is ``counts[i]`` consecutive image tokens; an image whose tokens do not all fit is dropped with the ones after
    it, and the cut moves before it when it would fall inside it."""
    image_pos = np.flatnonzero(ids == image_token_id)
    if image_pos.size != sum(counts) or not image_pos.size:
        raise ValueError(f"{image_pos.size} image tokens for images of {list(counts)} tokens")
    ends = np.cumsum(counts, dtype=np.int64)  # one past each image's last token, counted in image tokens
    whole = int((image_pos[ends - 1] < max_seq_len).sum())
    cut = max_seq_len
    if whole < len(counts) and image_pos[ends[whole] - counts[whole]] < cut:
        cut = int(image_pos[ends[whole] - counts[whole]])  # the cut fell inside an image: cut before it
    return cut, whole


def encode_conversation(
    messages: list[dict], images: list, processor: LlavaProcessor, *, max_seq_len: int | None = None
) -> dict:
    """A conversation -> one training sequence, token for token the chat template's rendering.

    ``messages``: [{"role": system|user|assistant, "content": str}], `<image>` in the text where each
    image goes, ``images`` in that order (PIL). Labels are the assistant turns: the tokens that overlap
    what the template adds for turn i beyond the generation prompt of turns < i (the answer and its end
    of turn, e.g. eos), so the model learns to answer and to stop; prompts, system text and image tokens
    are -100. The template must render turn by turn (each prefix a prefix of the whole): ValueError if not.

    Over ``max_seq_len`` tokens the sequence is cut there (as LLaVA truncates), but never inside an
    image's tokens: the cut moves before that image, which is dropped with the ones after it.
    Returns ``input_ids``, ``labels`` [T] long, ``pixel_values`` [images kept, 3, S, S] float32, ``truncated``.
    """
    text, spans = render_turns(messages, processor)
    enc = processor(
        text=text,
        images=images or None,
        add_special_tokens=False,
        return_offsets_mapping=True,
        return_text_replacement_offsets=bool(images),
    )
    ids = np.asarray(enc["input_ids"][0], dtype=np.int64)
    offsets = np.asarray(enc["offset_mapping"][0], dtype=np.int64).reshape(-1, 2)
    # Span ends in the text as tokenized, where each <image> became one token per image feature.
    grow = [
        (r["span"][1], (r["new_span"][1] - r["new_span"][0]) - (r["span"][1] - r["span"][0]))
        for r in (enc["text_replacement_offsets"][0] if images else [])
    ]

    def shifted(pos: int) -> int:
        return pos + sum(d for end, d in grow if end <= pos)

    is_label = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        is_label |= (offsets[:, 0] < shifted(b)) & (offsets[:, 1] > shifted(a))
    is_label &= ids != processor.image_token_id
    labels = np.where(is_label, ids, IGNORE_INDEX)
    pixel_values = torch.from_numpy(np.stack(enc["pixel_values"])) if images else torch.zeros(0)
    truncated = max_seq_len is not None and len(ids) > max_seq_len
    if truncated:
        cut, whole = max_seq_len, 0
        if images:
            per_image = int((ids == processor.image_token_id).sum()) // len(images)
            cut, whole = whole_images_cut(ids, processor.image_token_id, [per_image] * len(images), max_seq_len)
        ids, labels, pixel_values = ids[:cut], labels[:cut], pixel_values[:whole]
    return {
        "input_ids": torch.from_numpy(ids.copy()),
        "labels": torch.from_numpy(labels.copy()),
        "pixel_values": pixel_values.float(),
        "truncated": truncated,
    }


def check_chat_template(processor: LlavaProcessor, encode=encode_conversation) -> bool:
    """One line at start-up for a chat template training cannot use (rather than every sample failing).
    Returns whether its assistant turns end in eos (llava-hf's template, for one, drops it: a model
    trained on it does not learn to stop). ``encode(messages, images, processor)``: the architecture's
    conversation encoder (LLaVA's `encode_conversation`, Qwen2.5-VL's encode_qwen)."""
    probe = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye."},
    ]
    try:
        enc = encode(probe, [], processor)
    except Exception as exc:
        raise ConfigError(f"the processor's chat template cannot train conversations: {exc}") from None
    if not bool((enc["labels"] != IGNORE_INDEX).any()):
        raise ConfigError("the processor's chat template renders no assistant text (no token would be trained)")
    return bool((enc["labels"] == processor.tokenizer.eos_token_id).any())


def digit_messages(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": IMAGE_TOKEN + question}, {"role": "assistant", "content": answer}]


def encode_sample(sample: dict, processor: LlavaProcessor) -> dict:
    """Raw digits WebDataset sample -> one training sequence.

    ``input_ids`` [T]: the chat-templated prompt (image tokens expanded) + answer + the turn's end.
    ``labels`` [T]: -100 on the prompt (image tokens included), the answer and end-of-turn ids after it.
    ``pixel_values`` [3, S, S] float32; ``label`` int; ``question``, ``answer``, ``key`` str.

    Module-level and deterministic, so ``functools.partial(encode_sample, processor=p)`` is the
    ``decode`` of ``common.data.webdataset.build_webdataset_loader`` (pickled into workers).
    """
    key = sample.get("__key__")
    text = json.loads(sample["json"])
    label = int(sample["cls"])
    if text["label"] != label or not 0 <= label < NUM_CLASSES:
        raise ValueError(
            f"{key}: json label {text['label']} and cls {label} disagree or are outside 0..{NUM_CLASSES - 1}"
        )
    enc = encode_conversation(digit_messages(text["question"], text["answer"]), [decode_png(sample["png"])], processor)
    return {
        "input_ids": enc["input_ids"],
        "labels": enc["labels"],
        "pixel_values": enc["pixel_values"][0],
        "label": label,
        "question": text["question"],
        "answer": text["answer"],
        "key": key,
    }


def encode_llava(sample: dict, processor: LlavaProcessor, max_seq_len: int | None = None) -> dict:
    """Raw prepare_llava sample -> one training sequence (see `encode_conversation`): ``input_ids``,
    ``labels``, ``pixel_values`` [n, 3, S, S] (n = 0 for a text-only conversation), ``truncated``, ``key``."""
    record, images = read_llava_sample(sample)
    return {**encode_conversation(record["messages"], images, processor, max_seq_len=max_seq_len), "key": record["id"]}


def read_llava_sample(sample: dict) -> tuple[dict, list[Image]]:
    """A raw prepare_llava sample's record ({"id", "messages", "num_images"}) and its images, decoded (RGB)."""
    record = json.loads(sample["json"])
    return record, [decode_image(sample[f"image{i}"]) for i in range(record["num_images"])]


def _images(sample: dict) -> list[torch.Tensor]:
    pv = sample["pixel_values"]
    return [pv] if pv.dim() == 3 else list(pv)


def blank_sample(image_token_id: int, tokens: int, pixel_values: torch.Tensor) -> dict:
    """One image's `tokens` and nothing else, no label: the stand-in `collate` adds to a micro-batch
    without images. ``pixel_values`` [1, 3, S, S]: a blank image as the processor makes it."""
    ids = torch.full((tokens,), image_token_id, dtype=torch.long)
    return {"input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX), "pixel_values": pixel_values}


def collate(samples: list[dict], *, packing: bool, max_seq_len: int, pad_id: int, blank: dict | None = None) -> dict:
    """This rank's packed micro-batch (run on its share of the global batch), its images, and token accounting.

    Packing only regroups the same samples into fewer rows, so the loss (a token mean over
    the micro-batch) is the same with packing on or off. The trainer turns the PackedBatch into
    model inputs: a 4D mask is rows x L x L, too big to pass between processes every step.

    A micro-batch of text-only conversations gets ``blank`` as one more sample: an image's tokens in a
    segment of their own, with no labels, so the loss and the other samples' logits are unchanged. The
    vision tower and projector then run in every step on every rank, in the same order: ZeRO-3 gathers
    weights collectively, in module order, and every rank reduces the projector's gradient.
    """
    real = samples
    if blank is not None and not any(_images(s) for s in samples):
        samples = [*samples, blank]
    # Rows as short as the samples allow (fit_rows): a rank's share of the global batch is few samples.
    packed: PackedBatch = (
        pack_samples(samples, max_seq_len, pad_id, fit_rows=True) if packing else pad_samples(samples, pad_id)
    )
    # Images in the order their <image> tokens appear in the row-major flattened batch.
    images = [image for i in packed.order for image in _images(samples[i])]
    return {
        "packed": packed,
        "pixel_values": torch.stack(images) if images else None,
        **batch_counts(real, packed, lambda s: len(_images(s))),
    }


def batch_counts(real: list[dict], packed: PackedBatch, num_images) -> dict:
    """A micro-batch's token accounting (metrics.jsonl): its real samples' tokens against the slots of its rows,
    and how many samples were text-only (``num_images(sample) == 0``) or truncated."""
    return {
        "real_tokens": sum(len(s["input_ids"]) for s in real),
        "slots": packed.input_ids.numel(),
        "samples": len(real),
        "text_only": sum(not num_images(s) for s in real),
        "truncated": sum(bool(s.get("truncated")) for s in real),
    }


def pack_plan(cfg: TrainConfig, measure) -> PackPlan | None:
    """data.pack_buffer's layout of the global stream: windows of that many steps whose micro-batches are planned by
    the samples' sizes (``measure`` of a raw sample: its language-model tokens and tower patches); None when 0."""
    d = cfg.data
    return PackPlan(measure, d.pack_buffer, d.max_seq_len, d.packing) if d.pack_buffer else None


def build_train_loader(cfg: TrainConfig, meta: dict, processor, blank: dict, *, rank: int, dp: int):
    """This data-parallel rank's loader (`rank` of `dp`: the world size, or world / parallel.cp whose cp ranks read
    the same samples)."""
    decode = (
        functools.partial(encode_llava, processor=processor, max_seq_len=cfg.data.max_seq_len)
        if is_conversations(meta)
        else functools.partial(encode_sample, processor=processor)
    )
    batches = functools.partial(
        collate,
        packing=cfg.data.packing,
        max_seq_len=cfg.data.max_seq_len,
        pad_id=processor.tokenizer.pad_token_id,
        blank=blank,
    )
    measure = functools.partial(
        measure_llava, processor=processor, image_tokens=len(blank["input_ids"]), conversations=is_conversations(meta)
    )
    # One global sample stream, this rank's share of each step: the same samples whatever the layout, so a
    # checkpoint resumes under another one (common/data/webdataset/: GlobalBatches); its micro-batches laid out by
    # the samples' sizes (data.pack_buffer).
    return global_train_loader(
        cfg, meta["train_urls"], decode=decode, collate=batches, rank=rank, dp=dp, plan=pack_plan(cfg, measure)
    )


def measure_llava(sample: dict, processor, image_tokens: int, conversations: bool) -> tuple[int, int]:
    """A raw sample's (language-model tokens, tower patches) for the loader's plan, without decoding its images: the
    chat template's text tokenized, each `<image>` one token there and ``image_tokens`` in the sequence (every image
    is the tower's size, so its patches are those tokens)."""
    if conversations:
        record = json.loads(sample["json"])
        messages, images = record["messages"], record["num_images"]
    else:
        text = json.loads(sample["json"])
        messages, images = digit_messages(text["question"], text["answer"]), 1
    rendered = processor.apply_chat_template(_template_messages(messages, processor), tokenize=False)
    tokens = len(processor.tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return tokens + images * (image_tokens - 1), images * image_tokens
