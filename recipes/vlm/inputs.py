"""What the VLM trainer needs to know about an architecture's inputs, one small adapter each: LLaVA's (one image
size, `<image>` expanded by its LlavaProcessor: recipes/vlm/data.py) and Qwen-VL's (native resolution, mRoPE,
all images of a batch as one tower sequence: recipes/vlm/qwen.py). The trainer, its loop, engine, checkpoints and
export are one code path; it asks the adapter for the start-up checks, the loader, the forward's keyword arguments,
the step's counts and the held-out evaluation's batches.
"""

from __future__ import annotations

import functools
import io
import json

import torch

from common.config import TrainConfig
from common.data.packing import IGNORE_INDEX, pad_samples
from common.data.webdataset import global_train_loader
from common.errors import ConfigError
from recipes.vlm import llava, qwen
from recipes.vlm.archs import VIDEO_NAMES
from recipes.vlm.data import (
    blank_sample,
    build_train_loader,
    check_chat_template,
    collate,
    encode_conversation,
    encode_llava,
    is_conversations,
    measure_llava,
    pack_plan,
)
from recipes.vlm.model import tower_image_tokens
from recipes.vlm.video import VideoConfig, measure_llava_video
from recipes.vlm.weights import QwenWeights, WeightSource


class LlavaInputs:
    """A LLaVA's inputs: every image at the tower's size, `<image>` expanded to its features (LlavaProcessor)."""

    def __init__(self, processor, model, source: WeightSource, meta: dict):
        if meta.get("videos"):
            raise ConfigError(
                f"the dataset has {meta['videos']} sample(s) with a video; a LLaVA takes images only "
                f"(videos train with model.init_from=<a {VIDEO_NAMES} folder>)"
            )
        self.processor, self.conversations = processor, is_conversations(meta)
        # Processor and tower agree on image tokens (one line if not).
        pixels = llava.check_image_tokens(processor, model.config, source.label)
        self.blank = blank_sample(processor.image_token_id, tower_image_tokens(model.config), pixels)

    def check_chat_template(self) -> bool:
        """One line if the chat template cannot train; whether its assistant turns end in eos."""
        return check_chat_template(self.processor)

    def train_loader(self, cfg: TrainConfig, meta: dict, *, rank: int, dp: int):
        """Data-parallel rank `rank` of `dp`'s loader (the cp ranks of a group read the same samples)."""
        return build_train_loader(cfg, meta, self.processor, self.blank, rank=rank, dp=dp)

    # ---- preference pairs (recipes/vlm/preference.py): each side a conversation, a pair's documents one batch ----
    def conversation_encoder(self, max_seq_len: int):
        """``encode(messages, images)``: a conversation's training sequence, cut at ``max_seq_len`` (picklable)."""
        return functools.partial(encode_conversation, processor=self.processor, max_seq_len=max_seq_len)

    def collate_documents(self, cfg: TrainConfig):
        """The micro-batch of encoded documents, packed or padded as data.packing says (picklable)."""
        return functools.partial(
            collate,
            packing=cfg.data.packing,
            max_seq_len=cfg.data.max_seq_len,
            pad_id=self.processor.tokenizer.pad_token_id,
            blank=self.blank,
        )

    def labels(self, batch: dict) -> torch.Tensor:
        return batch["packed"].labels

    def measure(self):
        """A raw conversation sample's (language-model tokens, tower patches), for data.pack_buffer's plan."""
        return functools.partial(
            measure_llava, processor=self.processor, image_tokens=len(self.blank["input_ids"]), conversations=True
        )

    def model_inputs(self, batch: dict, attention: str, device, dtype) -> dict:
        inputs = batch["packed"].model_inputs(attention, device=device)
        inputs["pixel_values"] = None if batch["pixel_values"] is None else batch["pixel_values"].to(device, dtype)
        return inputs

    def count(self, batch: dict) -> int:
        return batch["packed"].num_labels

    def tally(self, batch: dict) -> dict[str, int]:
        counts = {"samples": batch["samples"], "tokens": batch["real_tokens"], "slots": batch["slots"]}
        if self.conversations:  # the conversations that are text-only / were cut
            counts |= {"text_only_samples": batch["text_only"], "truncated_samples": batch["truncated"]}
        return counts

    # ---- held-out conversations (recipes/vlm/evaluate.py: conversation_eval) ----
    def encode_eval(self, sample: dict, max_seq_len: int) -> dict:
        return encode_llava(sample, self.processor, max_seq_len)

    def eval_loss(self, model, chunk: list[dict], device, dtype) -> tuple[float, int]:
        """(the chunk's summed loss over its labelled tokens, how many), on padded rows."""
        batch = pad_samples(chunk, self.processor.tokenizer.pad_token_id)
        images = [im for j in batch.order for im in chunk[j]["pixel_values"]]
        inputs = batch.model_inputs("sdpa", device=device)
        loss = model(**inputs, pixel_values=torch.stack(images).to(device, dtype) if images else None).loss
        n = int((batch.labels[:, 1:] != IGNORE_INDEX).sum())  # the loss is a mean over these (labels shift by one)
        return float(loss) * n, n

    def prompt_images(self, sample: dict, prompt: torch.Tensor, device, dtype) -> dict:
        """generate()'s image arguments for the prompt `prompt` (a prefix of `sample`): the images it holds."""
        image_id, images = self.processor.image_token_id, sample["pixel_values"]
        per_image = (
            int((sample["input_ids"] == image_id).sum()) // len(images) if images.dim() == 4 and len(images) else 0
        )
        n_images = int((prompt == image_id).sum()) // per_image if per_image else 0
        return {"pixel_values": images[:n_images].to(device, dtype)} if n_images else {}


class QwenInputs:
    """A Qwen2.5-VL's or Qwen3-VL's inputs at native resolution (recipes/vlm/qwen.py): LLaVA-format conversations
    only, with images and videos (each generation's video rule: QWEN_ARCHS; the folder's video processor's values)."""

    def __init__(self, processor: qwen.QwenProcessing, model, source: WeightSource, meta: dict):
        if not is_conversations(meta):
            raise ConfigError(
                f"{source.label} trains on LLaVA-format conversations (data=llava), not on the digits demo's questions"
            )
        self.video = processor.video  # the folder's video processor's values, the run's rate and frame cap
        self.processor, self.conversations = processor, True
        tokenizer = processor.tokenizer
        self.image_pad, self.video_pad = tokenizer.convert_tokens_to_ids([qwen.IMAGE_PAD, qwen.VIDEO_PAD])
        self.blank = qwen.blank_qwen_sample(processor.image_processor, self.image_pad)
        # Data with videos: every micro-batch holds one (the tower's video call on every rank, every step).
        self.blank_video = (
            qwen.blank_qwen_sample(processor.image_processor, self.image_pad, self.video_pad, self.video)
            if meta.get("videos")
            else None
        )
        self.rope_index = qwen.rope_index_for(model.config)  # meta-device: pickled into the loader workers

    def encode(self, messages: list[dict], images: list, *, max_seq_len: int | None = None) -> dict:
        p = self.processor
        return qwen.encode_qwen(
            messages, images, p.tokenizer, p.image_processor, max_seq_len=max_seq_len, video_config=self.video
        )

    def _decode(self, max_seq_len: int | None):
        """The loader workers' and the held-out evaluation's decode of a raw sample (videos sampled as configured)."""
        p = self.processor
        return functools.partial(
            qwen.encode_llava_qwen,
            tokenizer=p.tokenizer,
            image_processor=p.image_processor,
            max_seq_len=max_seq_len,
            video_config=self.video,
        )

    def check_chat_template(self) -> bool:
        return check_chat_template(self.processor, encode=lambda messages, images, _: self.encode(messages, images))

    def collate(self, *, packing: bool, max_seq_len: int, blank: bool):
        return functools.partial(
            qwen.collate_qwen,
            rope_index=self.rope_index,
            packing=packing,
            max_seq_len=max_seq_len,
            pad_id=self.processor.tokenizer.pad_token_id,
            image_pad_id=self.image_pad,
            video_pad_id=self.video_pad,
            blank=self.blank if blank else None,
            blank_video=self.blank_video if blank else None,
        )

    def train_loader(self, cfg: TrainConfig, meta: dict, *, rank: int, dp: int):
        decode = self._decode(cfg.data.max_seq_len)
        collate = self.collate(packing=cfg.data.packing, max_seq_len=cfg.data.max_seq_len, blank=True)
        measure = self.measure()
        # One global sample stream, this rank's share of each step (as LLaVA's: recipes/vlm/data.py), its micro-batches
        # laid out by the samples' tokens and patches (data.pack_buffer).
        return global_train_loader(
            cfg, meta["train_urls"], decode=decode, collate=collate, rank=rank, dp=dp, plan=pack_plan(cfg, measure)
        )

    # ---- preference pairs (recipes/vlm/preference.py) ----
    def conversation_encoder(self, max_seq_len: int):
        p = self.processor
        return functools.partial(
            qwen.encode_qwen,
            tokenizer=p.tokenizer,
            image_processor=p.image_processor,
            max_seq_len=max_seq_len,
            video_config=self.video,
        )

    def collate_documents(self, cfg: TrainConfig):
        return self.collate(packing=cfg.data.packing, max_seq_len=cfg.data.max_seq_len, blank=True)

    def labels(self, batch: dict) -> torch.Tensor:
        return batch["batch"].packed.labels

    def measure(self):
        p = self.processor
        return functools.partial(
            measure_llava_qwen, tokenizer=p.tokenizer, image_processor=p.image_processor, video_config=self.video
        )

    def model_inputs(self, batch: dict, attention: str, device, dtype) -> dict:
        inputs = batch["batch"].model_inputs(attention, device=device)
        for key in ("pixel_values", "pixel_values_videos"):
            if key in inputs:
                inputs[key] = inputs[key].to(dtype)
        return inputs

    def count(self, batch: dict) -> int:
        return batch["batch"].packed.num_labels

    def tally(self, batch: dict) -> dict[str, int]:
        counts = {
            "samples": batch["samples"],
            "tokens": batch["real_tokens"],
            "slots": batch["slots"],
            "text_only_samples": batch["text_only"],
            "truncated_samples": batch["truncated"],
            "skipped_samples": batch["skipped"],  # image and video tokens alone over data.max_seq_len
        }
        if self.blank_video is not None:  # the data has videos: the samples that carried one
            counts["video_samples"] = batch["videos"]
        return counts

    # ---- held-out conversations ----
    def encode_eval(self, sample: dict, max_seq_len: int) -> dict:
        return self._decode(max_seq_len)(sample)

    def eval_loss(self, model, chunk: list[dict], device, dtype) -> tuple[float, int]:
        batch = self.collate(packing=False, max_seq_len=0, blank=False)(chunk)
        if not batch["samples"]:
            return 0.0, 0
        inputs = self.model_inputs(batch, "sdpa", device, dtype)
        loss = model(**inputs, num_items_in_batch=1).loss  # summed over the labelled tokens
        return float(loss), batch["batch"].packed.num_labels

    def prompt_images(self, sample: dict, prompt: torch.Tensor, device, dtype) -> dict:
        """generate()'s image and video arguments for `prompt`: its whole images' (videos') patches and grids (and
        the videos' second_per_grid_ts), and the token types from which generate() computes the mRoPE positions
        (transformers' get_rope_index)."""
        merge = self.processor.image_processor.merge_size
        args = {}
        for pad, values, grid_key in (
            (self.image_pad, "pixel_values", "image_grid_thw"),
            (self.video_pad, "pixel_values_videos", "video_grid_thw"),
        ):
            grid = sample.get(grid_key)
            counts = qwen.image_tokens(grid, merge) if grid is not None else []
            pads, n = int((prompt == pad).sum()), 0
            while n < len(counts) and sum(counts[: n + 1]) <= pads:
                n += 1
            if n:
                args[values] = sample[values][: int(grid[:n].prod(-1).sum())].to(device, dtype)
                args[grid_key] = grid[:n].to(device)
                if pad == self.video_pad and not self.video.rule.timestamps:  # Qwen3-VL's positions: its texts
                    args["second_per_grid_ts"] = sample["second_per_grid_ts"][:n].to(device)
        if args:
            args["mm_token_type_ids"] = qwen.modality_types(prompt[None], self.image_pad, self.video_pad).to(device)
        return args


def measure_llava_qwen(
    sample: dict,
    tokenizer,
    image_processor,
    *,
    video_config: VideoConfig,
) -> tuple[int, int]:
    """A raw prepare_llava sample's (language-model tokens, tower patches) as `qwen.encode_llava_qwen` will make
    them, cheaply, for the loader's plan (common/data/webdataset/: PackPlan): the chat template's text tokenized,
    each image's size read from its header (no pixel decoded) and resized by the processor's own smart_resize, whose
    (h/p) x (w/p) patches merge 2x2 into its tokens, and its video's frame count, rate and size from the container's
    stream metadata or the record and the first frame file's header (recipes/vlm/video.py: measure_llava_video; no
    frame decoded), sampled and sized by the same rules, its slot text (Qwen3-VL's timestamps) written as the
    encoder writes it. The conversation is not cut at data.max_seq_len here: the plan caps a sample's tokens there
    itself."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    record = json.loads(sample["json"])
    patch, merge = image_processor.patch_size, image_processor.merge_size
    video = measure_llava_video(sample, video_config)
    slots = [qwen.video_slot(video[1], video_config)] if video else []
    text = tokenizer.apply_chat_template(qwen.qwen_messages(record["messages"], slots), tokenize=False)
    tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    if video:
        t, h, w = video[0]
        pads = t if video_config.rule.timestamps else 1  # each pad becomes its share of the video's tokens
        tokens += t * h * w // merge**2 - pads
    patches = t * h * w if video else 0
    size = image_processor.size
    for i in range(record["num_images"]):
        with Image.open(io.BytesIO(sample[f"image{i}"])) as im:
            width, height = im.size
        h, w = smart_resize(
            height, width, factor=patch * merge, min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"]
        )
        patches += (h // patch) * (w // patch)
        tokens += (h // patch) * (w // patch) // merge**2 - 1  # the pad becomes the image's tokens
    return tokens, patches


Inputs = LlavaInputs | QwenInputs


def inputs_for(source: WeightSource, processor, model, meta: dict) -> Inputs:
    """The adapter of the architecture `source` loads."""
    return (QwenInputs if isinstance(source, QwenWeights) else LlavaInputs)(processor, model, source, meta)
