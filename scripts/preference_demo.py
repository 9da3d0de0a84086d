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
from data.preference_demo import has_property

EOT = "<|eot_id|>"


def load(folder: Path):
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder}: not an exported model folder (no config.json)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def answer_logp(model, tokenizer, prompt: list[dict], answer: dict) -> float:
    """log pi(answer | prompt), summed over the answer's tokens as the chat template renders them."""
    head = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template([*prompt, answer], tokenize=True, return_dict=False)
    if full[: len(head)] != head:
        raise ConfigError("the chat template does not render the prompt as the head of the conversation")
    ids = torch.tensor([full])
    with torch.no_grad():
        logps = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    targets = ids[0, 1:]
    picked = logps.gather(1, targets[:, None])[:, 0]
    return float(picked[len(head) - 1 :].sum())


def greedy(model, tokenizer, prompt: list[dict], max_new_tokens: int) -> str:
    head = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    stop = [tokenizer.convert_tokens_to_ids(EOT), tokenizer.eos_token_id]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([head]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.decode(out[0, len(head) :], skip_special_tokens=True).strip()


def read_pairs(path: Path) -> list[dict]:
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (python -m data.preference_demo writes held_out.jsonl)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ConfigError(f"{path}: no pairs")
    return rows


def _content(row: dict) -> str:
    """The pair's answer without its closing mark: what a generation must still say."""
    return row["rejected"][-1]["content"].rstrip("!.")


def measure(before: Path, after: Path, rows: list[dict], max_new_tokens: int) -> tuple[dict, list[dict]]:
    """The figures before and after, and each prompt's generations."""
    logps, texts = {}, {}
    for name, folder in (("before", before), ("after", after)):
        model, tokenizer = load(folder)
        logps[name] = [
            [answer_logp(model, tokenizer, r["prompt"], r[side][-1]) for side in ("chosen", "rejected")] for r in rows
        ]
        texts[name] = [greedy(model, tokenizer, r["prompt"], max_new_tokens) for r in rows]
    ref = logps["before"]
    figures = {}
    for name in ("before", "after"):
        wins = [(c - rc) > (r - rr) for (c, r), (rc, rr) in zip(logps[name], ref)]
        figures[name] = {
            "rewards/accuracies": sum(wins) / len(rows),
            "prefers_chosen": sum(c > r for c, r in logps[name]) / len(rows),
            "property_rate": sum(has_property(t) for t in texts[name]) / len(rows),
            "content_kept": sum(t.rstrip("!.") == _content(r) for t, r in zip(texts[name], rows)) / len(rows),
        }
    samples = [
        {"prompt": r["prompt"][-1]["content"], "before": b, "after": a}
        for r, b, a in zip(rows, texts["before"], texts["after"])
    ]
    return {**figures, "num_pairs": len(rows), "before_model": str(before), "after_model": str(after)}, samples


def write(out: Path, result: dict, samples: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "generations.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    lines = ["| held-out prompt | before (supervised) | after (DPO) |", "|---|---|---|"]
    lines += [f"| {s['prompt']} | {s['before']} | {s['after']} |".replace("\n", " ") for s in samples]
    (out / "generations.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/preference_demo.py", description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, type=Path, help="the export preference training started from")
    parser.add_argument("--after", required=True, type=Path, help="the preference run's export")
    parser.add_argument("--held-out", required=True, type=Path, help="held_out.jsonl of data.preference_demo")
    parser.add_argument("--out", required=True, type=Path, help="folder for generations.md, .jsonl and eval.json")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        result, samples = measure(args.before, args.after, read_pairs(args.held_out), args.max_new_tokens)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write(args.out, result, samples)
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
