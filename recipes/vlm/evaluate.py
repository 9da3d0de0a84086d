"""Held-out evaluation. Digits: the VLM answers questions about unseen digit images; accuracy and a picture.
Conversations: the loss on held-out conversations and a few generated answers next to the references."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import torch

from common.data.packing import IGNORE_INDEX
from common.data.webdataset import iter_samples
from recipes.vlm.data import chat_prompt, decode_png

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# A digit or a number word as a whole word: "7" and "seven" count, "17" and "someone" do not.
_ANSWER_RE = re.compile(r"(?<![0-9a-z])(" + "|".join(NUMBER_WORDS) + r"|[0-9])(?![0-9a-z])")


def load_eval_samples(urls: list[str], limit: int) -> list[dict]:
    """The first `limit` held-out samples in shard order, the same on every rank: image, question, label."""
    out = []
    for sample in iter_samples(urls):
        conv = json.loads(sample["json"])
        out.append({"image": decode_png(sample["png"]), "question": conv["question"], "label": int(conv["label"])})
        if len(out) == limit:
            break
    return out


def parse_answer(text: str) -> int | None:
    """The digit a generated answer names ("7", "seven", "It is a seven." -> 7).

    Digits and number words are matched as whole words, case-insensitively. None when the text
    names no digit, or names different digits ("seven or one"): listing digits earns no credit.
    """
    found = {int(m) if m.isdigit() else NUMBER_WORDS.index(m) for m in _ANSWER_RE.findall(text.lower())}
    return found.pop() if len(found) == 1 else None


@torch.no_grad()
def generate_answers(
    model, processor, samples: list[dict], *, max_new_tokens: int, device: torch.device, batch_size: int = 32
) -> list[str]:
    """Greedy answers, batched with left padding (every rank runs the same batches under ZeRO-3)."""
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "left"
    dtype = next(model.parameters()).dtype
    answers: list[str] = []
    for i in range(0, len(samples), batch_size):
        chunk = samples[i : i + batch_size]
        prompts = [
            chat_prompt(processor, [{"role": "user", "content": processor.image_token + s["question"]}]) for s in chunk
        ]
        batch = processor(text=prompts, images=[s["image"] for s in chunk], return_tensors="pt", padding=True).to(
            device
        )
        batch["pixel_values"] = batch["pixel_values"].to(dtype)
        out = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        answers += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    tokenizer.padding_side = "right"
    return [a.strip() for a in answers]


def score(samples: list[dict], answers: list[str]) -> dict:
    predicted = [parse_answer(a) for a in answers]
    labels = [s["label"] for s in samples]
    per_class = {}
    for c in sorted(set(labels)):
        idx = [i for i, y in enumerate(labels) if y == c]
        per_class[str(c)] = sum(predicted[i] == c for i in idx) / len(idx)
    return {
        "accuracy": sum(p == y for p, y in zip(predicted, labels)) / len(labels),
        "per_class_accuracy": per_class,
        "unparsable": sum(p is None for p in predicted),
        "num_samples": len(labels),
        "chance": 0.1,
        "examples": [
            {"question": s["question"], "answer": a, "label": s["label"]} for s, a in zip(samples[:10], answers[:10])
        ],
    }


def save_answer_grid(samples: list[dict], answers: list[str], path: Path, n: int = 20) -> None:
    """Images with their generated answers (green when right, red when wrong)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = min(n, len(samples))
    cols = 5
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 2.4, rows * 2.9), dpi=100)
    for ax in axes.flat:
        ax.axis("off")
    for ax, s, a in zip(axes.flat, samples[:n], answers[:n]):
        ax.imshow(s["image"].convert("L"), cmap="gray", interpolation="nearest")
        ok = parse_answer(a) == s["label"]
        ax.set_title(textwrap.fill(repr(a), 24), fontsize=8, color="green" if ok else "red")
    fig.suptitle("held-out digits and the model's answers")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


@torch.no_grad()
def conversation_eval(
    model,
    inputs,
    urls: list[str],
    *,
    limit: int,
    max_seq_len: int,
    max_new_tokens: int,
    device: torch.device,
    batch_size: int = 8,
    examples: int = 4,
) -> dict:
    """Token-mean loss over the first `limit` held-out conversations (every rank the same batches: ZeRO-3
    gathers collectively), and the first `examples` answers generated for each one's first prompt. ``inputs``:
    the architecture's adapter (recipes/vlm/inputs.py: its encoding, padded batches and generate() arguments)."""
    encoded = [inputs.encode_eval(s, max_seq_len) for s, _ in zip(iter_samples(urls), range(limit))]
    samples = [s for s in encoded if "skipped" not in s]  # image tokens alone over max_seq_len (Qwen2.5-VL)
    dtype = next(model.parameters()).dtype
    total, tokens = 0.0, 0
    for i in range(0, len(samples), batch_size):
        loss, n = inputs.eval_loss(model, samples[i : i + batch_size], device, dtype)
        total, tokens = total + loss, tokens + n
    shown = []
    tok = inputs.processor.tokenizer
    for s in samples[:examples]:
        labeled = (s["labels"] != IGNORE_INDEX).nonzero().flatten()
        if not len(labeled):
            continue
        first = int(labeled[0])
        end = first + int(((s["labels"][first:] == IGNORE_INDEX).cumsum(0) == 0).sum())  # the first answer's tokens
        prompt = s["input_ids"][:first]
        out = model.generate(
            input_ids=prompt[None].to(device),
            attention_mask=torch.ones_like(prompt)[None].to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            **inputs.prompt_images(s, prompt, device, dtype),
        )
        shown.append(
            {
                "key": s["key"],
                "prompt": tok.decode(prompt, skip_special_tokens=True).strip(),
                "reference": tok.decode(s["labels"][first:end], skip_special_tokens=True).strip(),
                "answer": tok.decode(out[0, len(prompt) :], skip_special_tokens=True).strip(),
            }
        )
    return {
        "val_loss": total / max(tokens, 1),
        "val_tokens": tokens,
        "num_samples": len(samples),
        "skipped_samples": len(encoded) - len(samples),
        "examples": shown,
    }
