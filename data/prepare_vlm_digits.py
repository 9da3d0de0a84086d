"""Image-text WebDataset shards of scikit-learn's digits for a LLaVA-style VLM, plus its offline processor.

    python -m data.prepare_vlm_digits --out data/vlm_digits [--image-size 16] [--patch-size 4]
                                      [--train-shards 8] [--val-shards 2] [--val-fraction 0.15]
                                      [--seed 0] [--force]

Shards. The train/val split is ``data.prepare_digits.split_indices`` (same rows for the same
seed and val fraction) and images are stored exactly as prepare_digits stores them. Each
sample is ``{__key__: "train_000123", png: 8x8 grayscale PNG, cls: b"3", json: {"question",
"answer", "label"}}``. The question phrasing and the answer style are drawn from a hash of
(seed, key), so they are fixed per sample, independent of shard count or read order, and
answers range from "7" to "This image shows the number seven." (varied target lengths).

Processor (``DIR/processor``, loads offline with ``AutoProcessor.from_pretrained``): a
byte-level BPE trained here with ``tokenizers`` on the task's own text, wrapped in
``PreTrainedTokenizerFast`` with a chat template, and a SigLIP image processor, combined in
a ``LlavaProcessor`` that expands one ``<image>`` into (image_size / patch_size)^2 tokens.

Chat format (Llama-2-like turn ends)::

    <s><|user|>\\n<image>What digit is this?<|end|>\\n<|assistant|>\\nIt is a seven.</s>

User/system turns end with ``<|end|>``; an assistant turn ends with eos ``</s>``. So eos is
exactly the token the model must emit after its answer (HF ``generate`` and vLLM stop on it
with no extra stop-token config) and never occurs inside a prompt (a packer may treat it as
a document end). A training sequence is token-for-token this rendering of the whole
conversation; its prompt part is what ``apply_chat_template(..., add_generation_prompt=True)``
gives at inference. Training turns samples into sequences in ``recipes/vlm/data.py``
(``encode_sample``) and scores answers in ``recipes/vlm/evaluate.py`` (``parse_answer``, which
reads every answer style written here: tests/unit/test_prepare_vlm_digits.py checks both).

Like prepare_digits, the directory appears at once (built next to DIR, then renamed) and
``DIR/meta.json`` is written last, so a directory with a valid meta.json is complete.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.data import dataset as common_dataset
from data import cli, shards
from data import prepare_digits as digits
from data.shards import META_NAME, SPLITS  # noqa: F401  (re-exported: part of this module's API)

if TYPE_CHECKING:  # transformers is slow to import; load it only where it is used
    from transformers import LlavaProcessor, PreTrainedTokenizerFast

SOURCE = digits.SOURCE
SOURCE_IMAGE_SIZE = digits.IMAGE_SIZE
NUM_CLASSES = digits.NUM_CLASSES
PROCESSOR_DIR = "processor"

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

QUESTIONS = (
    "What digit is this?",
    "Which number is shown in the image?",
    "Read the digit.",
    "What number do you see?",
    "Which digit is written here?",
    "Identify the handwritten digit.",
    "What is the digit in this picture?",
    "Tell me which digit this is.",
)

# {d}: "7"; {w}: "seven"; {W}: "Seven"; {a}: the article for {w} ("a", or "an" for eight).
ANSWER_TEMPLATES = (
    "{d}",
    "{w}",
    "{W}.",
    "It is {a} {w}.",
    "The digit shown is {d}.",
    "This image shows the number {w}.",
    "I can see the handwritten digit {d} in this image.",
)

IMAGE_TOKEN = "<image>"
BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SYSTEM, USER, ASSISTANT, END_OF_TURN = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
# Fixed order = fixed ids: <pad> is 0, so zero-filled buffers read as padding.
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS, IMAGE_TOKEN, SYSTEM, USER, ASSISTANT, END_OF_TURN)
# Upper bound for the BPE trainer; the task's text runs out of merges a little below it.
BPE_VOCAB_SIZE = 512

# Jinja, rendered by transformers (and by vLLM through the same tokenizer files). Content is a
# string or a list of OpenAI-style parts: {"type": "image"} -> <image>, {"type": "text", "text": ...}.
CHAT_TEMPLATE = r"""{{- bos_token -}}
{%- for message in messages -%}
{%- if message['role'] not in ['system', 'user', 'assistant'] -%}
{{- raise_exception('unsupported role ' + message['role'] + ': use system, user or assistant') -}}
{%- endif -%}
{{- '<|' + message['role'] + '|>\n' -}}
{%- if message['content'] is string -%}
{{- message['content'] -}}
{%- else -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'image' -%}
{{- '<image>' -}}
{%- elif part['type'] == 'text' -%}
{{- part['text'] -}}
{%- else -%}
{{- raise_exception('unsupported content part type ' + part['type'] + ': use image or text') -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- if message['role'] == 'assistant' -%}
{{- eos_token -}}
{%- else -%}
{{- '<|end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|assistant|>\n' -}}
{%- endif -%}"""

# --- text ------------------------------------------------------------------------------------------


def render_answer(template: str, label: int) -> str:
    word = NUMBER_WORDS[label]
    article = "an" if word[0] in "aeiou" else "a"
    return template.format(d=str(label), w=word, W=word.capitalize(), a=article)


def choose_text(key: str, label: int, seed: int) -> dict[str, Any]:
    """The sample's {"question", "answer", "label"}: phrasing and answer style hashed from (seed, key)."""
    # sha256, not hash(): stable across processes and PYTHONHASHSEED.
    h = hashlib.sha256(f"kiln.vlm_digits/{seed}/{key}".encode()).digest()
    question = QUESTIONS[int.from_bytes(h[:8], "little") % len(QUESTIONS)]
    template = ANSWER_TEMPLATES[int.from_bytes(h[8:16], "little") % len(ANSWER_TEMPLATES)]
    return {"question": question, "answer": render_answer(template, label), "label": int(label)}


def tokenizer_corpus() -> list[str]:
    """Everything the tokenizer will ever see outside special tokens: questions, all answers, number words."""
    corpus = list(QUESTIONS)
    corpus += [render_answer(t, d) for t in ANSWER_TEMPLATES for d in range(NUM_CLASSES)]
    corpus += [w for word in NUMBER_WORDS for w in (word, word.capitalize())]
    corpus += [str(d) for d in range(NUM_CLASSES)]
    corpus += ["\n"]  # the chat template's only text outside special tokens
    return corpus


# --- tokenizer and processor -------------------------------------------------------------------------


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on :func:`tokenizer_corpus` (deterministic), as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Byte-level: any text encodes (no unknown characters), so <unk> is set for the API only.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    # No post-processor adding <s>: the chat template writes bos itself, so `tokenizer(text)` and
    # `add_special_tokens=True/False` give the same ids for rendered prompts (no double bos).
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        image_token=IMAGE_TOKEN,  # a named token: LlavaProcessor reads tokenizer.image_token
        extra_special_tokens=[SYSTEM, USER, ASSISTANT, END_OF_TURN],
        chat_template=CHAT_TEMPLATE,
    )


def build_processor(*, image_size: int = 16, patch_size: int = 4) -> LlavaProcessor:
    """SigLIP image processor (resize to image_size, RGB, [-1, 1]) + the tokenizer, as a LlavaProcessor."""
    from PIL import Image
    from transformers import LlavaProcessor
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    _check_sizes(image_size, patch_size)
    # The PIL backend of SiglipImageProcessor (saved as "SiglipImageProcessor"; from_pretrained
    # picks torchvision where installed, PIL otherwise), so the build does not depend on torchvision.
    # NEAREST: 8x8 digits upscaled by an integer factor become exact pixel blocks, and PIL and
    # torchvision agree on it bit for bit (they differ for bicubic), so a model trained on
    # one backend is served unchanged by the other.
    image_processor = SiglipImageProcessorPil(
        do_resize=True,
        size={"height": image_size, "width": image_size},
        resample=Image.Resampling.NEAREST,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        do_convert_rgb=True,
    )
    # SigLIP has no CLS token: every patch is an image token ("full", no additional tokens).
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=build_tokenizer(),
        patch_size=patch_size,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=0,
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )


def num_image_tokens(processor: LlavaProcessor) -> int:
    """How many tokens one ``<image>`` expands to (LlavaProcessor.replace_image_token's formula)."""
    size = processor.image_processor.size
    count = (size["height"] // processor.patch_size) * (size["width"] // processor.patch_size)
    count += processor.num_additional_image_tokens
    if processor.vision_feature_select_strategy == "default":
        count -= 1  # "default" drops the CLS feature
    return count


# --- shards, meta, atomic build ----------------------------------------------------------------------------


def _check_sizes(image_size: int, patch_size: int) -> None:
    if image_size < 1 or patch_size < 1 or image_size % patch_size:
        raise ValueError(f"image_size ({image_size}) must be a positive multiple of patch_size ({patch_size})")


def _text_fingerprint() -> str:
    """Changes whenever the phrasings, answer styles, template or tokenizer recipe change: old builds are then stale."""
    spec = [QUESTIONS, ANSWER_TEMPLATES, NUMBER_WORDS, SPECIAL_TOKENS, CHAT_TEMPLATE, BPE_VOCAB_SIZE]
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]


def _text_fields(key: str, label: int, *, seed: int) -> dict:
    """What a VLM sample adds to a prepare_digits sample: its question/answer json."""
    return {"json": json.dumps(choose_text(key, label, seed), sort_keys=True).encode()}


def read_meta(root: str | Path) -> dict[str, Any] | None:
    """Parsed meta.json of a complete VLM digits dataset in ``root`` (shards and processor), else None."""
    return common_dataset.read_meta(root, also_complete=common_dataset.asset_complete("processor"))


def _settings(meta: dict) -> dict:
    return {
        "image_size": meta.get("image_size"),
        "patch_size": meta.get("patch_size"),
        **shards.split_settings(meta),
        "text_fingerprint": meta.get("text_fingerprint"),
    }


def build_vlm_digits(
    out: str | Path,
    *,
    image_size: int = 16,
    patch_size: int = 4,
    train_shards: int = 8,
    val_shards: int = 2,
    val_fraction: float = 0.15,
    seed: int = 0,
    force: bool = False,
) -> tuple[dict, bool]:
    """Build the dataset in ``out`` unless a complete one is there. Returns (meta, built_now).

    A complete dataset with other settings is left alone (``built_now`` False); callers compare.
    """
    out = Path(out).absolute()
    _check_sizes(image_size, patch_size)

    def start_meta(tmp: Path) -> dict[str, Any]:
        processor = build_processor(image_size=image_size, patch_size=patch_size)
        processor.save_pretrained(str(tmp / PROCESSOR_DIR))
        os.chmod(tmp / PROCESSOR_DIR, 0o755)  # readable by others, like the dataset dir
        return {
            "source": SOURCE,
            "source_image_size": SOURCE_IMAGE_SIZE,
            "image_size": image_size,
            "patch_size": patch_size,
            "num_image_tokens": num_image_tokens(processor),
            "num_classes": NUM_CLASSES,
            "pixel_scale": "round(value * 255 / 16) as uint8 grayscale PNG (as data.prepare_digits)",
            "splits": {},
            "seed": seed,
            "val_fraction": val_fraction,
            "processor": PROCESSOR_DIR,
            "processor_files": shards.file_sizes(tmp / PROCESSOR_DIR),
            "vocab_size": len(processor.tokenizer),
            "special_tokens": list(SPECIAL_TOKENS),
            "questions": list(QUESTIONS),
            "answer_templates": list(ANSWER_TEMPLATES),
            "text_fingerprint": _text_fingerprint(),
        }

    # The digits split, chunking, keys and PNG bytes, unchanged; each sample gets its json added.
    return shards.build_atomically(
        out,
        train_shards=train_shards,
        val_shards=val_shards,
        val_fraction=val_fraction,
        force=force,
        dataset="VLM digits",
        read_meta=read_meta,
        load=lambda: digits.load_split(val_fraction=val_fraction, seed=seed),
        start_meta=start_meta,
        write_shards=functools.partial(digits._write_shards, extra_fields=functools.partial(_text_fields, seed=seed)),
    )


def ensure_vlm_digits(
    root: str | Path,
    *,
    image_size: int = 16,
    patch_size: int = 4,
    train_shards: int = 8,
    val_shards: int = 2,
    seed: int = 0,
    val_fraction: float = 0.15,
) -> dict:
    """Parsed meta.json of the VLM digits dataset under ``root``, building it first if missing.

    Adds absolute ``train_urls`` / ``val_urls`` and ``processor_dir``. For scripts and
    tests (training runs the CLI instead: ``data.build``). A complete dataset built with other settings
    (or by an older version of this file's text) raises ValueError rather than being reused.
    """
    root = Path(root).absolute()
    meta, _ = build_vlm_digits(
        root,
        image_size=image_size,
        patch_size=patch_size,
        train_shards=train_shards,
        val_shards=val_shards,
        val_fraction=val_fraction,
        seed=seed,
    )
    wanted = {
        "image_size": image_size,
        "patch_size": patch_size,
        "train_shards": train_shards,
        "val_shards": val_shards,
        "val_fraction": val_fraction,
        "seed": seed,
        "text_fingerprint": _text_fingerprint(),
    }
    shards.require_settings(
        root,
        _settings(meta),
        wanted,
        holds="VLM digits data",
        rebuild=f"`python -m data.prepare_vlm_digits --out {root} --force` (plus your settings)",
    )
    return common_dataset.with_urls(root, meta, asset="processor")


# --- CLI ---------------------------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    def sizes(parser: argparse.ArgumentParser, positive_int) -> None:
        parser.add_argument(
            "--image-size", type=positive_int, default=16, help="side the processor resizes the 8x8 digits to"
        )
        parser.add_argument(
            "--patch-size", type=positive_int, default=4, help="vision tower patch size (image tokens = (size/patch)^2)"
        )

    parser = cli.arg_parser(
        "python -m data.prepare_vlm_digits",
        __doc__.splitlines()[0],
        "output directory (created; must be empty or a previous build)",
        extra=sizes,
        seed_help="split seed; also picks each sample's question and answer style",
    )
    args = parser.parse_args(argv)
    if args.image_size % args.patch_size:
        parser.error(f"--image-size {args.image_size} must be a multiple of --patch-size {args.patch_size}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    return cli.run(
        build_vlm_digits,
        args,
        wanted=cli.split_wanted(args, image_size=args.image_size, patch_size=args.patch_size),
        describe=lambda out, meta: (
            f"{cli.summary(out, meta)}; "
            f"processor in {out / PROCESSOR_DIR}: vocab {meta['vocab_size']}, {meta['image_size']}px images -> "
            f"{meta['num_image_tokens']} image tokens"
        ),
        settings=_settings,
        holds="VLM digits data",
        also_wanted={"text_fingerprint": _text_fingerprint()},
    )


if __name__ == "__main__":
    sys.exit(main())
