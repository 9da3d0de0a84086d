#!/usr/bin/env python
"""Score an exported DiT: sample N images per class and classify them with an SVM fitted on the real images.

    python scripts/eval_dit.py EXPORT_DIR [--per-class 50] [--steps 50] [--guidance 2.0]
                               [--data data/cache/digits] [--out eval.json]

--data is the image dataset the model was trained on (the digits by default, built there if missing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", type=Path, help="run.dir/export of a DiT run")
    ap.add_argument("--per-class", type=int, default=50)
    ap.add_argument("--steps", type=int, default=None, help="sampler steps (default: the run's)")
    ap.add_argument("--guidance", type=float, default=None, help="CFG scale (default: the run's)")
    ap.add_argument("--data", default="data/cache/digits", help="image shards the classifier is fitted on")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grid", type=Path, default=None, help="also write a sample grid PNG here")
    ap.add_argument("--out", type=Path, default=None, help="write the scores as JSON here")
    args = ap.parse_args(argv)
    if not (args.export / "kiln.json").exists():
        print(f"eval_dit: error: {args.export} is not a Kiln DiT export (no kiln.json)", file=sys.stderr)
        return 2

    import torch
    from diffusers import DiTTransformer2DModel

    from common.data.dataset import read_meta
    from common.diffusion.evaluate import class_labels, score_samples
    from common.diffusion.sampling import GRID_MAX_CLASSES, sample_images, save_grid
    from common.diffusion.vae import folder_decoder
    from data.prepare_digits import ensure_digits_shards
    from recipes.dit.evaluate import fit_classifier

    info = json.loads((args.export / "kiln.json").read_text())
    model = DiTTransformer2DModel.from_pretrained(args.export / "transformer").eval()
    scheduler_config = json.loads((args.export / "scheduler" / "scheduler_config.json").read_text())
    vae = args.export / "vae"
    decode = folder_decoder(vae, info["image_size"], torch.device("cpu")) if vae.is_dir() else None
    labels = class_labels(info["num_classes"], args.per_class)
    print(f"eval_dit: sampling {len(labels)} images ({args.per_class} per class) from {args.export}", flush=True)
    images = sample_images(
        model,
        scheduler_config,
        labels,
        null_class=info["null_class"],
        image_size=model.config.sample_size,
        in_channels=model.config.in_channels,
        steps=args.steps or info["sample_steps"],
        guidance_scale=info["guidance_scale"] if args.guidance is None else args.guidance,
        generator=torch.Generator().manual_seed(args.seed),
        device=torch.device("cpu"),
        progress="sampling",
        decode=decode,
    )
    if read_meta(args.data) is None:
        ensure_digits_shards(args.data)  # the default dataset is built on first use; others must exist
    print("eval_dit: fitting a classifier on the real images and scoring the samples", flush=True)
    clf, real_acc = fit_classifier(args.data, info["image_size"], args.seed)
    result = {**score_samples(clf, images, labels, info["num_classes"]), "classifier_accuracy_on_real_val": real_acc}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    if args.grid:
        rows = min(info["num_classes"], GRID_MAX_CLASSES)
        save_grid(images[: rows * args.per_class : max(1, args.per_class // 8)], rows=rows, path=args.grid)
    return 0


if __name__ == "__main__":
    from common.known_warnings import silence_known_warnings

    silence_known_warnings()
    sys.exit(main())
