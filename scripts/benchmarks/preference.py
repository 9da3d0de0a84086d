"""Preference optimization against supervised fine-tuning over the same tokens (llm_tiny): the step time and the
model-state bytes of DPO with a live frozen reference (a second copy of the weights, one more forward a step) and with
the reference's log-probs precomputed (preference.reference=precomputed: neither), each against an SFT step on the
same packed rows.

The pairs: generated in TRL's standard layout (prompt, chosen, rejected strings), tokenized by python -m
data.prepare_preference with the pydoc data's tokenizer, so an SFT trainer on the pydoc data (same tokenizer, same
seeded weights) can take each pair batch's documents as its own rows: the same tokens, packed the same way, with the
next-token loss on the answers. The three trainers alternate steps on the same batches (harness.interleaved).

Targets (issue 45): a DPO step <= 1.1x an SFT step with precomputed log-probs, <= 1.45x with a live reference.
"""

from __future__ import annotations

import json
import random
import sys

from scripts.benchmarks.harness import build_trainer, fresh_dir, interleaved, take
from scripts.benchmarks.lora import state_bytes
from scripts.benchmarks.report import Section, Target, md_table, median, mib, ms, ratio, say

TARGET_PRECOMPUTED, TARGET_LIVE = 1.1, 1.45
WORDS = ("hot", "cold", "up", "down", "light", "dark", "early", "late", "open", "closed", "fast", "slow")


def write_pairs(path, n: int) -> None:
    """n pairs: the chosen answer names the opposite, the rejected one repeats the word (two sentences more each)."""
    rng, lines = random.Random(0), []
    for _ in range(n):
        i = rng.randrange(0, len(WORDS), 2)
        a, b = (WORDS[i], WORDS[i + 1]) if rng.random() < 0.5 else (WORDS[i + 1], WORDS[i])
        tail = " It is a common pair of words. People learn it early."
        lines.append(
            {
                "prompt": f"What is the opposite of {a}?",
                "chosen": f" The opposite of {a} is {b}.{tail}",
                "rejected": f" The opposite of {a} is {a}.{tail}",
            }
        )
    path.write_text("".join(json.dumps(row) + "\n" for row in lines))


def pair_shards(opts):
    from data import prepare_preference
    from data.prepare_text import main as prepare_text

    prepare_text(["--out", "data/cache/pydoc_text"])  # the SFT trainer's data and the tokenizer both use
    work = fresh_dir(opts.work / "preference_data")
    write_pairs(work / "pairs.jsonl", 512)
    out = work / "pairs"
    argv = ["--tokenizer", "data/cache/pydoc_text/tokenizer", "--input", str(work / "pairs.jsonl"), "--out", str(out)]
    if prepare_preference.main(argv) != 0:
        sys.exit("preference bench: data.prepare_preference failed")
    return out


def as_documents(rows: list[list[dict]]) -> list[list[dict]]:
    """A pair batch's rows as SFT rows: each pair's chosen and rejected documents, in order (a decoded pair holds
    both documents' ids and labels, and the chosen one's length, `first`)."""
    out = []
    for row in rows:
        docs = []
        for pair in row:
            n = int(pair["first"])
            for part in (slice(0, n), slice(n, None)):
                docs.append({"input_ids": pair["input_ids"][part], "labels": pair["labels"][part]})
        out.append(docs)
    return out


def run(opts) -> Section:
    warmup, steps = 1, opts.pick(10, 2)
    s = Section("preference", "Preference optimization (DPO) vs supervised fine-tuning over the same tokens (llm_tiny)")
    say("preference: building pair shards with the pydoc data's tokenizer")
    root = pair_shards(opts)
    dpo = ["data=preference_shards", f"data.root={root}", "preference.loss=sigmoid", "data.num_workers=0"]
    trainers = {
        "sft": build_trainer(opts, "llm_tiny", ["data.num_workers=0"], opts.work / "pref_sft"),
        "dpo_live": build_trainer(opts, "llm_tiny", dpo, opts.work / "pref_live"),
        "dpo_precomputed": build_trainer(
            opts, "llm_tiny", [*dpo, "preference.reference=precomputed"], opts.work / "pref_precomputed"
        ),
    }
    pairs = take(trainers["dpo_live"], warmup + steps)
    batches = {"sft": [as_documents(b) for b in pairs], "dpo_live": pairs, "dpo_precomputed": pairs}
    say(f"preference: sft, dpo (live reference), dpo (precomputed), {warmup + steps} steps each, interleaved")
    by_name = interleaved(trainers, batches, warmup)
    states = {n: state_bytes(t) for n, t in trainers.items()}
    reference = trainers["dpo_live"].preference.reference
    states["dpo_live"] += sum(p.numel() * p.element_size() for p in reference.parameters())
    ratios = {n: ratio(by_name[n]["times"], by_name["sft"]["times"]) for n in ("dpo_live", "dpo_precomputed")}
    rows = [
        [
            n,
            ms(median(by_name[n]["times"])),
            f"{ratios.get(n, 1.0):.2f}x",
            mib(states[n]),
            f"{states[n] / states['sft']:.2f}x",
        ]
        for n in trainers
    ]
    s.tables.append(md_table(["run", "step ms", "vs SFT", "model states (+ reference)", "vs SFT"], rows))
    s.targets += [
        Target(
            f"DPO step with precomputed reference log-probs <= {TARGET_PRECOMPUTED}x SFT's",
            f"{ratios['dpo_precomputed']:.2f}x",
            ratios["dpo_precomputed"] <= TARGET_PRECOMPUTED,
        ),
        Target(
            f"DPO step with a live reference <= {TARGET_LIVE}x SFT's",
            f"{ratios['dpo_live']:.2f}x",
            ratios["dpo_live"] <= TARGET_LIVE,
        ),
    ]
    s.notes.append(
        f"the three trainers alternate steps on the same batches (SFT: each pair batch's documents as its rows), "
        f"{steps} steps each after {warmup} warm-up; a ratio is the median of per-step ratios. Model states: weights, "
        "gradients and Adam state, each storage once, plus the live reference's weights. The precompute itself (one "
        "no-grad forward over every pair, before step 1) is not in the step times."
    )
    s.data = {"ratios": ratios, "state_bytes": states, "step_s": {n: r["times"] for n, r in by_name.items()}}
    return s
