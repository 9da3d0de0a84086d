#!/usr/bin/env python
"""Score a text-to-image export's prompt adherence: prompts in phrasings no training caption used, classified.

    python scripts/eval_t2i.py EXPORT_DIR [--per-digit 50] [--steps 20] [--guidance 3.0]
                               [--data data/cache/captioned_digits] [--out eval.json] [--grid eval.png]

The export of a t2i_tiny run (or any StableDiffusion3Pipeline folder) draws --per-digit images per digit from the
held-out phrasings (common/data/digit_captions.py); the DiT's digit classifier, fitted on --data's real images (the
captioned digits the run trained on, built there if missing) as the export's VAE renders them, reads each one: the
score is the share showing the prompted digit (chance 0.1), per digit too -- what the run's eval.json holds
(recipes/t2i/evaluate.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_DATA = "data/cache/captioned_digits"  # configs/data/captions.yaml's root


def fail(msg: str) -> int:
    print(f"eval_t2i: error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", type=Path, help="run.dir/export of a t2i run")
    ap.add_argument("--per-digit", type=int, default=50)
    ap.add_argument("--steps", type=int, default=None, help="sampler steps (default: the run's)")
    ap.add_argument("--guidance", type=float, default=None, help="CFG scale (default: the run's)")
    ap.add_argument("--batch", type=int, default=64, help="prompts sampled at once")
    ap.add_argument("--data", type=Path, default=Path(DEFAULT_DATA), help="the captioned digits' shards")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grid", type=Path, default=None, help="also write a sample grid PNG here (a row per digit)")
    ap.add_argument("--out", type=Path, default=None, help="write the scores as JSON here")
    args = ap.parse_args(argv)
    if not (args.export / "kiln.json").exists():
        return fail(f"{args.export} is not a Kiln text-to-image export (no kiln.json)")
    if args.per_digit <= 0 or args.batch <= 0:
        return fail("--per-digit and --batch must be > 0")

    import torch

    from common.data.dataset import load_dataset_meta, read_meta
    from common.diffusion.sampling import save_grid
    from recipes.t2i.evaluate import (
        NUM_DIGITS,
        eval_prompts,
        read_captioned_digits,
        score_prompt_adherence,
        through_vae,
    )
    from recipes.t2i.sampling import PromptSampler

    info = json.loads((args.export / "kiln.json").read_text())
    size = info["image_size"]
    if read_meta(args.data) is None:
        if args.data != Path(DEFAULT_DATA):
            return fail(f"--data {args.data}: no caption shards there (python -m data.prepare_captions --digits)")
        from data.prepare_captions import main as prepare_captions

        prepare_captions(["--digits", "--out", str(args.data), "--image-size", str(size)])
    meta = load_dataset_meta(args.data)
    train, val = (read_captioned_digits(meta[f"{split}_urls"], size) for split in ("train", "val"))
    if train is None or val is None:
        return fail(f"--data {args.data} is not the captioned digits (python -m data.prepare_captions --digits)")

    prompts, digits = eval_prompts(args.per_digit)
    sampler = PromptSampler.from_export(args.export, image_size=size)
    steps = args.steps or info["sample_steps"]
    guidance = info["guidance_scale"] if args.guidance is None else args.guidance
    print(f"eval_t2i: sampling {len(prompts)} images ({args.per_digit} per digit) from {args.export}", flush=True)
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        images = torch.cat(
            [
                sampler(prompts[i : i + args.batch], generator, steps=steps, guidance_scale=guidance)
                for i in range(0, len(prompts), args.batch)
            ]
        )
    render = lambda x: through_vae(sampler.vae, sampler.geometry, x)  # noqa: E731
    result = score_prompt_adherence(images, digits, prompts, train, val, args.seed, render=render)
    result.update(sample_steps=steps, guidance_scale=guidance)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    if args.grid:
        cols = min(args.per_digit, 8)
        pick = [d * args.per_digit + j for d in range(NUM_DIGITS) for j in range(cols)]
        save_grid(images[pick], rows=NUM_DIGITS, path=args.grid)
    return 0


if __name__ == "__main__":
    from common.known_warnings import silence_known_warnings

    silence_known_warnings()
    sys.exit(main())
