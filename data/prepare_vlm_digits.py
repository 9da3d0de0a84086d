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
gives at inference.

Like prepare_digits, the directory appears at once (built next to DIR, then renamed) and
``DIR/meta.json`` is written last, so a directory with a valid meta.json is complete.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from data import prepare_digits as digits

if TYPE_CHECKING:  # transformers is slow to import; load it only where it is used
    from transformers import LlavaProcessor, PreTrainedTokenizerFast

SOURCE = digits.SOURCE
SOURCE_IMAGE_SIZE = digits.IMAGE_SIZE
NUM_CLASSES = digits.NUM_CLASSES
SPLITS = digits.SPLITS
META_NAME = "meta.json"
PROCESSOR_DIR = "processor"
IGNORE_INDEX = -100  # label of tokens that are not trained on (torch cross_entropy's ignore_index)

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

_ANSWER_RE = re.compile(r"(?<![0-9a-z])(" + "|".join(NUMBER_WORDS) + r"|[0-9])(?![0-9a-z])")


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


def parse_answer(text: str) -> int | None:
    """The digit a generated answer names ("7", "seven", "It is a seven." -> 7).

    Digits and number words are matched as whole words, case-insensitively. None when the text
    names no digit, or names different digits ("seven or one"): listing digits earns no credit.
    """
    found = {int(m) if m.isdigit() else NUMBER_WORDS.index(m) for m in _ANSWER_RE.findall(text.lower())}
    return found.pop() if len(found) == 1 else None


def prompt_messages(question: str) -> list[dict]:
    """The user turn: the image, then the question (OpenAI-style content parts)."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


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


def load_processor(root: str | Path) -> LlavaProcessor:
    """The dataset's processor, offline. ``root`` is the dataset dir or its ``processor`` dir."""
    from transformers import AutoProcessor, LlavaProcessor

    root = Path(root)
    path = root / PROCESSOR_DIR if (root / PROCESSOR_DIR).is_dir() else root
    processor = AutoProcessor.from_pretrained(str(path), local_files_only=True)
    if not isinstance(processor, LlavaProcessor):
        raise TypeError(f"{path} holds a {type(processor).__name__}, expected a LlavaProcessor")
    return processor


def num_image_tokens(processor: LlavaProcessor) -> int:
    """How many tokens one ``<image>`` expands to (LlavaProcessor.replace_image_token's formula)."""
    size = processor.image_processor.size
    count = (size["height"] // processor.patch_size) * (size["width"] // processor.patch_size)
    count += processor.num_additional_image_tokens
    if processor.vision_feature_select_strategy == "default":
        count -= 1  # "default" drops the CLS feature
    return count


# --- samples -------------------------------------------------------------------------------------------


def decode_png(data: bytes):
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return im.convert("L")  # a loaded copy, independent of the buffer


def encode_sample(sample: dict, processor: LlavaProcessor) -> dict:
    """Raw WebDataset sample -> one training sequence.

    ``input_ids`` [T]: the chat-templated prompt (image tokens expanded) + answer + eos.
    ``labels`` [T]: -100 on the prompt (image tokens included), the answer and eos ids after it.
    ``pixel_values`` [3, S, S] float32; ``label`` int; ``question``, ``answer``, ``key`` str.

    Module-level and deterministic, so ``functools.partial(encode_sample, processor=p)`` is the
    ``decode`` of ``common.data.webdataset.build_webdataset_loader`` (pickled into workers).
    """
    import torch

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


# --- shards, meta, atomic build ----------------------------------------------------------------------------


def _check_sizes(image_size: int, patch_size: int) -> None:
    if image_size < 1 or patch_size < 1 or image_size % patch_size:
        raise ValueError(f"image_size ({image_size}) must be a positive multiple of patch_size ({patch_size})")


def _text_fingerprint() -> str:
    """Changes whenever the phrasings, answer styles, template or tokenizer recipe change: old builds are then stale."""
    spec = [QUESTIONS, ANSWER_TEMPLATES, NUMBER_WORDS, SPECIAL_TOKENS, CHAT_TEMPLATE, BPE_VOCAB_SIZE]
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]


def _write_shards(out: Path, split: str, rows: np.ndarray, images: np.ndarray, labels: np.ndarray, num_shards: int,
                  seed: int) -> list[dict]:
    import webdataset as wds

    shards = []
    # Same chunking, keys and PNG bytes as prepare_digits; json added.
    for shard_id, chunk in enumerate(np.array_split(rows, num_shards)):
        name = f"{split}-{shard_id:06d}.tar"
        with wds.TarWriter(str(out / name), mtime=0) as sink:  # int mtime: byte-identical rebuilds
            for row in chunk:
                key = f"{split}_{row:06d}"
                text = choose_text(key, int(labels[row]), seed)
                sink.write({
                    "__key__": key,
                    "png": digits.encode_png(images[row]),
                    "cls": int(labels[row]),
                    "json": json.dumps(text, sort_keys=True).encode(),
                })
        shards.append({"name": name, "samples": len(chunk), "bytes": (out / name).stat().st_size})
    return shards


def _file_sizes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}


def read_meta(root: str | Path) -> dict[str, Any] | None:
    """Parsed meta.json of a complete VLM digits dataset in ``root`` (shards and processor), else None."""
    root = Path(root)
    meta = digits.read_meta(root)  # validates meta.json and every shard's size
    if meta is None:
        return None
    try:
        files = meta["processor_files"]
        proc = root / meta["processor"]
        if not files or any((proc / name).stat().st_size != size for name, size in files.items()):
            return None
    except (OSError, KeyError, TypeError, AttributeError):
        return None
    return meta


def _settings(meta: dict) -> dict:
    return {
        "image_size": meta.get("image_size"),
        "patch_size": meta.get("patch_size"),
        "train_shards": len(meta["splits"]["train"]["shards"]),
        "val_shards": len(meta["splits"]["val"]["shards"]),
        "val_fraction": meta.get("val_fraction"),
        "seed": meta.get("seed"),
        "text_fingerprint": meta.get("text_fingerprint"),
    }


def _with_paths(root: Path, meta: dict) -> dict:
    meta = dict(meta)
    for split in SPLITS:
        meta[f"{split}_urls"] = [str((root / name).resolve()) for name in meta["splits"][split]["shards"]]
    meta["processor_dir"] = str((root / meta["processor"]).resolve())
    return meta


def build_vlm_digits(
    out: str | Path, *, image_size: int = 16, patch_size: int = 4, train_shards: int = 8, val_shards: int = 2,
    val_fraction: float = 0.15, seed: int = 0, force: bool = False,
) -> tuple[dict, bool]:
    """Build the dataset in ``out`` unless a complete one is there. Returns (meta, built_now).

    A complete dataset with other settings is left alone (``built_now`` False); callers compare.
    """
    out = Path(out).absolute()
    _check_sizes(image_size, patch_size)
    if train_shards < 1 or val_shards < 1:
        raise ValueError(f"train_shards and val_shards must be >= 1 (got {train_shards}, {val_shards})")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1) (got {val_fraction})")
    existing = read_meta(out)
    if existing is not None and not force:
        return existing, False
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    if existing is None and out.is_dir() and any(out.iterdir()) and not force:
        # Never delete files we did not write: a non-empty dir without our meta.json is the user's.
        raise ValueError(f"{out} is not empty and holds no complete VLM digits dataset; choose an empty directory or pass --force")

    images, labels = digits.load_source_digits()
    rows = digits.split_indices(labels, val_fraction=val_fraction, seed=seed)  # the digits split, unchanged
    counts = {"train": train_shards, "val": val_shards}
    for split in SPLITS:
        if len(rows[split]) < counts[split]:
            raise ValueError(f"{len(rows[split])} {split} samples cannot fill {counts[split]} shards")

    out.parent.mkdir(parents=True, exist_ok=True)
    # Build next to `out` (same filesystem) so the final rename is atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        processor = build_processor(image_size=image_size, patch_size=patch_size)
        processor.save_pretrained(str(tmp / PROCESSOR_DIR))
        meta: dict[str, Any] = {
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
            "processor_files": _file_sizes(tmp / PROCESSOR_DIR),
            "vocab_size": len(processor.tokenizer),
            "special_tokens": list(SPECIAL_TOKENS),
            "questions": list(QUESTIONS),
            "answer_templates": list(ANSWER_TEMPLATES),
            "text_fingerprint": _text_fingerprint(),
        }
        for split in SPLITS:
            shards = _write_shards(tmp, split, rows[split], images, labels, counts[split], seed)
            meta["splits"][split] = {
                "shards": [s["name"] for s in shards],
                "samples": sum(s["samples"] for s in shards),
                "shard_samples": [s["samples"] for s in shards],
                "shard_bytes": [s["bytes"] for s in shards],
            }
        (tmp / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
        for path in (tmp, tmp / PROCESSOR_DIR):
            os.chmod(path, 0o755)  # mkdtemp makes it 0700; a shared data dir should be readable by others
        _move_into_place(tmp, out, force=force)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    final = read_meta(out)
    if final is None:
        raise RuntimeError(f"{out}: dataset written but {META_NAME} does not validate")
    return final, True


def _move_into_place(tmp: Path, out: Path, *, force: bool) -> None:
    try:
        os.rename(tmp, out)  # atomic; also replaces an empty directory
        return
    except OSError:
        if not out.exists():
            raise
    # `out` is non-empty: either another process finished the same build first, or --force.
    if not force:
        if read_meta(out) is not None:
            return  # another process won the race with a complete dataset; ours is discarded
        raise ValueError(f"{out} appeared while building and holds no complete VLM digits dataset; not replacing it")
    trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rename(out, trash / "old")
    os.rename(tmp, out)
    shutil.rmtree(trash, ignore_errors=True)


def _mismatch(have: dict, wanted: dict) -> str:
    return ", ".join(f"{k}={have[k]} (wanted {wanted[k]})" for k in wanted if have[k] != wanted[k])


def ensure_vlm_digits(root: str | Path, *, image_size: int = 16, patch_size: int = 4, train_shards: int = 8, val_shards: int = 2,
                      seed: int = 0, val_fraction: float = 0.15) -> dict:
    """Parsed meta.json of the VLM digits dataset under ``root``, building it first if missing.

    Adds absolute ``train_urls`` / ``val_urls`` and ``processor_dir``. Not rank-aware: call it
    on rank 0 and barrier before other ranks read. A complete dataset built with other settings
    (or by an older version of this file's text) raises ValueError rather than being reused.
    """
    root = Path(root).absolute()
    meta, _ = build_vlm_digits(root, image_size=image_size, patch_size=patch_size, train_shards=train_shards,
                               val_shards=val_shards, val_fraction=val_fraction, seed=seed)
    wanted = {"image_size": image_size, "patch_size": patch_size, "train_shards": train_shards, "val_shards": val_shards,
              "val_fraction": val_fraction, "seed": seed, "text_fingerprint": _text_fingerprint()}
    have = _settings(meta)
    if have != wanted:
        raise ValueError(f"{root} holds VLM digits data built with {_mismatch(have, wanted)}; delete it or rebuild with "
                         f"`python -m data.prepare_vlm_digits --out {root} --force` (plus your settings)")
    return _with_paths(root, meta)


# --- CLI ---------------------------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    def positive_int(text: str) -> int:
        value = int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
        return value

    def fraction(text: str) -> float:
        value = float(text)
        if not 0.0 < value < 1.0:
            raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
        return value

    parser = argparse.ArgumentParser(prog="python -m data.prepare_vlm_digits", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="output directory (created; must be empty or a previous build)")
    parser.add_argument("--image-size", type=positive_int, default=16, help="side the processor resizes the 8x8 digits to")
    parser.add_argument("--patch-size", type=positive_int, default=4, help="vision tower patch size (image tokens = (size/patch)^2)")
    parser.add_argument("--train-shards", type=positive_int, default=8)
    parser.add_argument("--val-shards", type=positive_int, default=2)
    parser.add_argument("--val-fraction", type=fraction, default=0.15, help="share of samples held out for val (stratified)")
    parser.add_argument("--seed", type=int, default=0, help="split seed; also picks each sample's question and answer style")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete dataset is there (replaces DIR)")
    args = parser.parse_args(argv)
    if args.image_size % args.patch_size:
        parser.error(f"--image-size {args.image_size} must be a multiple of --patch-size {args.patch_size}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    out = args.out.absolute()
    wanted = {"image_size": args.image_size, "patch_size": args.patch_size, "train_shards": args.train_shards,
              "val_shards": args.val_shards, "val_fraction": args.val_fraction, "seed": args.seed}
    try:
        meta, built = build_vlm_digits(out, **wanted, force=args.force)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not built:
        wanted["text_fingerprint"] = _text_fingerprint()
        have = _settings(meta)
        if have != wanted:
            print(f"error: {out} already holds VLM digits data built with {_mismatch(have, wanted)}; pass --force to rebuild",
                  file=sys.stderr)
            return 1
        print(f"{out}/{META_NAME} exists; nothing to do (pass --force to rebuild)")
        return 0
    splits = meta["splits"]
    print(
        f"wrote {out}: train {splits['train']['samples']} samples in {len(splits['train']['shards'])} shards, "
        f"val {splits['val']['samples']} samples in {len(splits['val']['shards'])} shards (seed {meta['seed']}); "
        f"processor in {out / PROCESSOR_DIR}: vocab {meta['vocab_size']}, {meta['image_size']}px images -> "
        f"{meta['num_image_tokens']} image tokens"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
