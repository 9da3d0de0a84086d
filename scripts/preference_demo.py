"""The preference demo's evaluation (docs/preference.md#demo): the model before preference training (the supervised
export, DPO's reference) against the model after it (the DPO run's export), on held-out pairs no training pair uses.

    python scripts/preference_demo.py --before outputs/pref_sft/export --after outputs/pref_dpo/export
                                      --held-out data/my_pref_demo/held_out.jsonl --out outputs/pref_dpo/samples
                                      [--max-new-tokens 24]

Measured on each held-out pair (TRL's conversational layout, answers "...!" chosen and "..." rejected), with the
exports loaded by transformers in fp32 and each answer's log-prob summed over its tokens (text and end of turn) after
the prompt rendered by the chat template:

- ``rewards/accuracies``: the share of pairs whose chosen reward beats the rejected one, a reward being
  log pi(answer) - log pi_ref(answer) (times beta, which leaves the order alone), pi_ref the model before: TRL's
  figure (a tie is not a win, so the model before, its own reference, scores 0 with every reward 0);
- ``prefers_chosen``: the share of pairs whose chosen answer the model itself gives the higher log-prob;
- ``property_rate``: the share of greedy generations (transformers' generate, no sampling) of the held-out prompts
  that end in "!" (data/preference_demo.py's property);
- ``content_kept``: the share of those generations that say the pair's answer (its text without the closing mark),
  so that a model that learned the mark by losing the answer shows.

Writes ``--out``/generations.md (each prompt's greedy answer before and after, side by side), generations.jsonl and
eval.json (the figures before and after), and prints the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from common.errors import ConfigError
from data.preference_demo import keeps_content, shows_property

EOT = "<|eot_id|>"


def load(folder: Path):
    """(model, what renders its chats): a causal LM and its tokenizer, or an image-text model (LLaVA) and its
    processor, in fp32."""
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder}: not an exported model folder (no config.json)")
    if "vision_config" in json.loads((folder / "config.json").read_text()):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
        return model, AutoProcessor.from_pretrained(folder)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def encode(chat, messages: list[dict], images: list | None, generation_prompt: bool) -> dict:
    """The chat template's rendering of `messages` as model inputs: token ids (a tokenizer), or ids with each
    <image> expanded and the images' pixel values (a processor)."""
    if images is None:
        ids = chat.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
        )
        return {"input_ids": torch.tensor([ids])}
    text = chat.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    return dict(chat(text=text, images=images, return_tensors="pt"))


def answer_logp(model, chat, prompt: list[dict], answer: dict, images: list | None = None) -> float:
    """log pi(answer | prompt), summed over the answer's tokens as the chat template renders them."""
    head = encode(chat, prompt, images, True)["input_ids"][0]
    full = encode(chat, [*prompt, answer], images, False)
    ids = full["input_ids"]
    if ids[0, : len(head)].tolist() != head.tolist():
        raise ConfigError("the chat template does not render the prompt as the head of the conversation")
    with torch.no_grad():
        logps = torch.log_softmax(model(**full).logits[0, :-1].float(), dim=-1)
    targets = ids[0, 1:]
    picked = logps.gather(1, targets[:, None])[:, 0]
    return float(picked[len(head) - 1 :].sum())


def greedy(model, chat, prompt: list[dict], max_new_tokens: int, images: list | None = None) -> str:
    head = encode(chat, prompt, images, True)
    tokenizer = getattr(chat, "tokenizer", chat)
    stop = [tokenizer.eos_token_id] + ([tokenizer.convert_tokens_to_ids(EOT)] if EOT in tokenizer.get_vocab() else [])
    with torch.no_grad():
        out = model.generate(
            **head,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.decode(out[0, head["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def read_pairs(path: Path) -> list[dict]:
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (python -m data.preference_demo writes held_out.jsonl)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ConfigError(f"{path}: no pairs")
    return rows


def read_images(rows: list[dict], folder: Path) -> list[list | None]:
    """Each pair's images (TRL's vision layout: "images", paths under `folder`), None for a text pair."""
    from PIL import Image

    def open_image(name: str):
        try:
            with Image.open(folder / name) as image:
                return image.convert("RGB")
        except OSError:
            raise ConfigError(
                f"{folder / name}: no such image, or not one (--images: the pairs' image folder)"
            ) from None

    return [[open_image(n) for n in r["images"]] if "images" in r else None for r in rows]


def measure(
    before: Path, after: Path, rows: list[dict], max_new_tokens: int, images: list[list | None] | None = None
) -> tuple[dict, list[dict]]:
    """The figures before and after, and each prompt's generations."""
    images = images or [None] * len(rows)
    logps, texts = {}, {}
    for name, folder in (("before", before), ("after", after)):
        model, chat = load(folder)
        logps[name] = [
            [answer_logp(model, chat, r["prompt"], r[side][-1], im) for side in ("chosen", "rejected")]
            for r, im in zip(rows, images)
        ]
        texts[name] = [greedy(model, chat, r["prompt"], max_new_tokens, im) for r, im in zip(rows, images)]
    ref = logps["before"]
    figures = {}
    for name in ("before", "after"):
        wins = [(c - rc) > (r - rr) for (c, r), (rc, rr) in zip(logps[name], ref)]
        figures[name] = {
            "rewards/accuracies": sum(wins) / len(rows),
            "prefers_chosen": sum(c > r for c, r in logps[name]) / len(rows),
            "property_rate": sum(shows_property(r, t) for t, r in zip(texts[name], rows)) / len(rows),
            "content_kept": sum(keeps_content(r, t) for t, r in zip(texts[name], rows)) / len(rows),
        }
    samples = [
        {
            "prompt": r["prompt"][-1]["content"],
            **({"images": r["images"]} if "images" in r else {}),
            "before": b,
            "after": a,
        }
        for r, b, a in zip(rows, texts["before"], texts["after"])
    ]
    return {**figures, "num_pairs": len(rows), "before_model": str(before), "after_model": str(after)}, samples


def write(out: Path, result: dict, samples: list[dict], images: list[list | None] | None = None) -> None:
    """eval.json, generations.jsonl and generations.md; with images, each held-out image (enlarged 4x) in
    out/images/, shown in the table beside its generations."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "generations.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    shown = [""] * len(samples)
    if images and images[0] is not None:
        (out / "images").mkdir(exist_ok=True)
        for i, (s, pictures) in enumerate(zip(samples, images)):
            names = [f"images/{n.replace('/', '_')}" for n in s["images"]]
            for name, picture in zip(names, pictures):
                picture.resize((picture.width * 4, picture.height * 4), resample=0).save(out / name)
            shown[i] = " ".join(f"![]({n})" for n in names) + " "
    lines = ["| held-out prompt | before (supervised) | after (DPO) |", "|---|---|---|"]
    lines += [f"| {m}{s['prompt']} | {s['before']} | {s['after']} |".replace("\n", " ") for m, s in zip(shown, samples)]
    (out / "generations.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/preference_demo.py", description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, type=Path, help="the export preference training started from")
    parser.add_argument("--after", required=True, type=Path, help="the preference run's export")
    parser.add_argument("--held-out", required=True, type=Path, help="held_out.jsonl of data.preference_demo")
    parser.add_argument(
        "--images",
        type=Path,
        help="the folder pairs with images name theirs under (default: images/ beside --held-out)",
    )
    parser.add_argument("--out", required=True, type=Path, help="folder for generations.md, .jsonl and eval.json")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        rows = read_pairs(args.held_out)
        images = read_images(rows, args.images or args.held_out.parent / "images")
        result, samples = measure(args.before, args.after, rows, args.max_new_tokens, images)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write(args.out, result, samples, images)
    for name in ("before", "after"):
        f = result[name]
        print(
            f"kiln: {name}: held-out reward accuracy {f['rewards/accuracies']:.3f}, prefers chosen "
            f"{f['prefers_chosen']:.3f}, property rate in greedy generations {f['property_rate']:.3f}, answer kept "
            f"{f['content_kept']:.3f} "
            f"({result['num_pairs']} held-out prompts)"
        )
    print(f"kiln: wrote {args.out}/generations.md, generations.jsonl, eval.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
