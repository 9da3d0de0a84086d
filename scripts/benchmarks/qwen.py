"""Qwen2.5-VL at native resolution: how well the loader's micro-batches fill the language rows and the vision
tower's sequence (data.pack_buffer off vs on, the same samples), the data wait of training steps, and the tower's
share of a step.

The stream (`write_stream`): LLaVA-format conversations of 0-8 images each, every image of a random size in
224..1344 px on each side (a pool of JPEGs), the question and answer 10 to ~2k tokens of text together (log-uniform,
so most are short and some fill a row), built into shards by data.prepare_llava. A tiny random Qwen2.5-VL
(data/tiny_bases.py) with a small max_pixels, so that a CPU runs it: every image is 4..16 tokens (16..64
patches of 14 px). The recipe is vlm_tiny with model.init_from that folder, data=llava, rows of 2048 tokens.

Utilization, per step over its micro-batches (accum x dp of them: the bench takes one rank's loader with
grad_accum micro-batches, which is what dp ranks share alike): language rows = real tokens / the token slots of the
rows the collate laid out (`fit_rows`, as training packs); tower = patches / (micro-batches x the step's largest
micro-batch's patches): memory is sized for the largest tower sequence and the other ranks wait for it. Both come
from the trainer's own loader (decoded and packed in its workers), pack_buffer 0 (micro-batches by stream position,
today's layout) against 1 (each step's samples laid out by their sizes; the same samples per step) and 4.

Data wait: scripts/train.py as a subprocess per setting, data_wait_s / step_time_s from metrics.jsonl after warm-up.
Tower share: hooks on the tower inside the trainer's own steps (vlm.train_vision=true, so it runs forward and
backward): forward from its pre-hook to its hook, backward from the gradient reaching its output to the gradient
of its first layer's weight, over the step's whole time (forward, backward, optimizer).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np

from scripts.benchmarks.harness import build_trainer, fresh_dir, take, train_run
from scripts.benchmarks.report import Section, Target, md_table, median, say

TARGET_UTILIZATION = 0.95
TARGET_DATA_WAIT = 0.02
TOWER_THRESHOLD = 0.40  # the notes: a vision encoder can take more than 40% of the step
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 16
MAX_SEQ_LEN = 2048
WARMUP = 3
WORDS = (
    "the a picture shows red blue green small large cat dog house tree road car sky water person left right "
    "above below near far bright dark image photo scene object corner center background foreground detail"
).split()


def write_stream(folder: Path, samples: int, seed: int = 0) -> Path:
    """`folder`/images (a pool of 48 JPEGs, 224..1344 px per side) and `folder`/stream.json: `samples`
    conversations of 0-8 images, text of 10..~2k tokens (about 3 characters per token of the fixture's BPE)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = folder / "images"
    images.mkdir(parents=True, exist_ok=True)
    names = []
    for k in range(48):
        h, w = (int(x) for x in rng.integers(224, 1345, 2))
        # Smooth colour ramps: JPEG keeps them small, and decoding them costs what a photo of that size does.
        y, x = np.mgrid[0:h, 0:w]
        rgb = np.stack([(x * 255 // w), (y * 255 // h), np.full((h, w), (k * 37) % 256)], -1).astype(np.uint8)
        names.append(f"img_{k:03d}.jpg")
        Image.fromarray(rgb).save(images / names[-1], quality=85)
    records = []
    for i in range(samples):
        n = int(rng.integers(0, 9))
        tokens = int(math.exp(rng.uniform(math.log(10), math.log(2000))))
        words = [WORDS[j] for j in rng.integers(0, len(WORDS), max(2, tokens * 3 // 5))]
        cut = max(1, len(words) // 4)
        question = " ".join(["<image>"] * n + words[:cut])
        conv = [{"from": "human", "value": question}, {"from": "gpt", "value": " ".join(words[cut:])}]
        record = {"id": f"s{i}", "conversations": conv}
        if n:
            record["image"] = [names[j] for j in rng.integers(0, len(names), n)]
        records.append(record)
    (folder / "stream.json").write_text(json.dumps(records))
    return folder


def world(opts, samples: int) -> tuple[Path, Path]:
    """(the dataset, the Qwen2.5-VL folder) under the bench's work folder; built once per bench run."""
    from data import prepare_llava
    from data.tiny_bases import make_qwen2_5_vl

    root = opts.work / "qwen"
    if not (root / "data" / "meta.json").exists():
        fresh_dir(root)
        raw = write_stream(root / "raw", samples)
        prepare_llava.build_llava(
            root / "data",
            json_path=raw / "stream.json",
            images=raw / "images",
            train_shards=8,
            val_shards=1,
            val_fraction=0.01,
        )
        make_qwen2_5_vl(root / "model", min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return root / "data", root / "model"


def overrides(data: Path, model: Path, micro: int, accum: int, workers: int) -> list[str]:
    return [
        "data=llava",
        f"data.root={data}",
        f"model.init_from={model}",
        f"data.min_pixels={MIN_PIXELS}",
        f"data.max_pixels={MAX_PIXELS}",
        f"data.max_seq_len={MAX_SEQ_LEN}",
        f"data.num_workers={workers}",
        f"trainer.micro_batch_size={micro}",
        f"trainer.grad_accum={accum}",
        "vlm.train_vision=true",
        "vlm.eval_samples=0",
    ]


def step_utilization(micro_batches: list[dict]) -> tuple[int, int, int, int]:
    """(real tokens, token slots, patches, micro-batches x the largest one's patches) of one step."""
    patches = [
        0 if b["batch"].image_grid_thw is None else int(b["batch"].image_grid_thw.prod(-1).sum()) for b in micro_batches
    ]
    return (
        sum(b["real_tokens"] for b in micro_batches),
        sum(b["slots"] for b in micro_batches),
        sum(patches),
        len(patches) * max(patches),
    )


def utilization(opts, args: list[str], pack_buffer: int, steps: int, accum: int) -> dict:
    trainer = build_trainer(
        opts, "vlm_tiny", [*args, f"data.pack_buffer={pack_buffer}"], opts.work / f"qwen_util_{pack_buffer}"
    )
    batches = take(trainer, steps * accum)
    per_step = [step_utilization(batches[s * accum : (s + 1) * accum]) for s in range(steps)]
    tokens, slots, patches, tower = (sum(x[i] for x in per_step) for i in range(4))
    rows = [tuple(b["batch"].packed.input_ids.shape) for b in batches]
    return {
        "lm": tokens / slots,
        "tower": patches / tower,
        "samples": sum(b["samples"] for b in batches),
        "rows": median(r for r, _ in rows),
        "row_len": median(n for _, n in rows),
        "per_step_lm": [x[0] / x[1] for x in per_step],
        "per_step_tower": [x[2] / x[3] for x in per_step],
    }


class TowerClock:
    """Seconds the vision tower spends in forward and in backward during the steps it is attached for."""

    def __init__(self, model):
        visual = model.model.visual if hasattr(model.model, "visual") else model.visual
        first = next(p for p in visual.parameters() if p.requires_grad)
        self.forward = self.backward = 0.0
        self._t = {}
        self.handles = [
            visual.register_forward_pre_hook(lambda *_: self._t.__setitem__("f", time.perf_counter())),
            visual.register_forward_hook(lambda *_: self._add("forward", "f")),
            visual.register_full_backward_pre_hook(lambda *_: self._t.__setitem__("b", time.perf_counter())),
            # The patch embedding is the tower's first layer: its weight's gradient is the tower's backward's last.
            first.register_post_accumulate_grad_hook(lambda *_: self._add("backward", "b")),
        ]

    def _add(self, name: str, start: str) -> None:
        if start in self._t:
            setattr(self, name, getattr(self, name) + time.perf_counter() - self._t.pop(start))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def tower_share(opts, args: list[str], steps: int, accum: int) -> dict:
    """The tower's forward + backward over whole steps of the trainer (pack_buffer at its default)."""
    from scripts.benchmarks.harness import step_timer

    trainer = build_trainer(opts, "vlm_tiny", args, opts.work / "qwen_tower")
    batches = take(trainer, (steps + 1) * accum)
    timer = step_timer()
    clock = TowerClock(trainer.model)
    shares, totals = [], []
    for s in range(steps + 1):
        f0, b0 = clock.forward, clock.backward
        start = time.perf_counter()
        trainer.train_step(iter(batches[s * accum : (s + 1) * accum]), timer)  # takes grad_accum micro-batches
        elapsed = time.perf_counter() - start
        trainer.state.step += 1
        if s:  # the first step warms up
            tower = clock.forward - f0 + clock.backward - b0
            shares.append(tower / elapsed)
            totals.append((tower, elapsed))
    clock.close()
    return {"share": sum(t for t, _ in totals) / sum(e for _, e in totals), "per_step": shares}


def data_wait(opts, args: list[str], pack_buffer: int, steps: int) -> dict:
    records = train_run(
        opts,
        "vlm_tiny",
        [*args, f"data.pack_buffer={pack_buffer}", f"trainer.max_steps={steps}", "trainer.log_every=1"],
        opts.work / f"qwen_wait_{pack_buffer}",
    )
    steady = [r for r in records if r["step"] > WARMUP]
    return {
        "fraction": sum(r["data_wait_s"] for r in steady) / sum(r["step_time_s"] for r in steady),
        "step_s": median(r["step_time_s"] for r in steady),
        "worst_s": max(r["data_wait_s"] for r in steady),
    }


def run(opts) -> Section:
    s = Section("qwen", "Qwen2.5-VL at native resolution: packed rows and tower, data wait, the tower's share")
    micro, accum, workers = 4, 4, 2
    util_steps, wait_steps = opts.pick(12, 4), opts.pick(30, 8)
    samples = micro * accum * (max(util_steps, wait_steps) + 4) + 64
    say(f"qwen: building a {samples}-sample native-resolution stream and a tiny Qwen2.5-VL")
    data, model = world(opts, samples)
    args = overrides(data, model, micro, accum, workers)
    rows, util = [], {}
    for pack_buffer in (0, 1, 4):
        say(f"qwen: utilization, data.pack_buffer={pack_buffer}, {util_steps} steps of {micro * accum} samples")
        util[pack_buffer] = u = utilization(opts, args, pack_buffer, util_steps, accum)
        rows.append([pack_buffer, f"{u['lm']:.1%}", f"{u['tower']:.1%}", f"{u['rows']:g} x {u['row_len']:g}"])
    wait = {}
    for pack_buffer in (0, 1):
        say(f"qwen: data wait, data.pack_buffer={pack_buffer}, {wait_steps} steps")
        wait[pack_buffer] = w = data_wait(opts, args, pack_buffer, wait_steps)
        rows[pack_buffer] += [f"{w['fraction']:.2%}", f"{w['step_s'] * 1e3:.0f} ms"]
    rows[2] += ["", ""]
    say("qwen: the tower's share of a step")
    tower = tower_share(opts, args, opts.pick(6, 2), accum)
    s.tables.append(
        md_table(
            [
                "data.pack_buffer",
                "language rows filled",
                "tower sequence filled",
                "rows x len per micro-batch (median)",
                "data wait / step time",
                "step (median)",
            ],
            rows,
        )
    )
    after = util[1]
    s.targets += [
        Target(
            f"language rows filled >= {TARGET_UTILIZATION:.0%}", f"{after['lm']:.1%}", after["lm"] >= TARGET_UTILIZATION
        ),
        Target(
            f"tower sequence filled >= {TARGET_UTILIZATION:.0%}",
            f"{after['tower']:.1%}",
            after["tower"] >= TARGET_UTILIZATION,
        ),
        Target(
            f"data wait <= {TARGET_DATA_WAIT:.0%} of step time",
            f"{wait[1]['fraction']:.2%}",
            wait[1]["fraction"] <= TARGET_DATA_WAIT,
        ),
    ]
    s.notes += [
        f"the vision tower's share of a step (forward + backward, vlm.train_vision=true): {tower['share']:.1%} "
        f"(the notes' threshold {TOWER_THRESHOLD:.0%}; per step {', '.join(f'{x:.0%}' for x in tower['per_step'])}): "
        "the tiny fixture's proportions (a 2-block, 32-wide tower beside a 2-layer, 64-wide language model), "
        "not a 7B's",
        f"stream: conversations of 0-8 images of 224..1344 px per side, text 10..~2k tokens, rows of {MAX_SEQ_LEN}; "
        f"max_pixels {MAX_PIXELS} ({MAX_PIXELS // 784} tokens per image at most); micro-batch {micro} x grad_accum "
        f"{accum} ({micro * accum} samples per step), data.num_workers={workers}; utilization over {util_steps} steps, "
        f"data wait over steps {WARMUP + 1}-{wait_steps}; {opts.threads} thread(s), load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
        "pack_buffer 0: micro-batches by stream position (before); 1: each step's samples laid out by their tokens and "
        "patches (the same samples per step); 4: windows of 4 steps (which samples share a step changes too)",
    ]
    s.data = {"utilization": util, "data_wait": wait, "tower": tower}
    return s
