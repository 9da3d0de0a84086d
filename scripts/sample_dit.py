#!/usr/bin/env python
"""Sample a class grid from an exported DiT on PyTorch, onnxruntime or TensorRT (the same sampler + CFG loop).

    python scripts/sample_dit.py EXPORT_DIR [backend=torch|onnxruntime|tensorrt] [steps=N] [seed=S]
        [out=grid.png] [per_class=4] [guidance=G] [compare=torch|onnxruntime|tensorrt]
        [onnx=EXPORT_DIR/onnx/model.onnx] [engine=EXPORT_DIR/onnx/model.plan] [threads=N] [device=cpu|cuda]
        [classes=NAME,ID,...] [images=DIR]

Every backend runs common.diffusion.sampling.sample_images with the same seed, so grids are comparable:
`compare=B` also samples on backend B (e.g. backend=onnxruntime compare=torch) and prints the max
abs pixel difference (uint8, 0..255) between the two grids.
onnxruntime/tensorrt need scripts/export_dit.py to have written the ONNX file / engine first.

Any export: DDPM models sample with DDIM, flow models with FlowMatchEulerDiscreteScheduler (the
export's scheduler/ says which), and a latent model's samples are decoded by its vae/ in PyTorch
whatever the backend. Guidance uses the model's own null class (kiln.json), so unlike diffusers'
DiTPipeline (ImageNet's 1000) it is right for any class count. One row per class: the first 32, or
`classes=` (names or ids). `images=DIR` also writes each sample as its own PNG. The images server
(scripts/serve.py) draws a request's noise as this script does: a request for `per_class` images of
one class with `seed` gets the images `classes=that per_class=n seed=S` gives here.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULTS = {
    "backend": "torch",
    "steps": None,
    "seed": "0",
    "out": None,
    "per_class": "4",
    "guidance": None,
    "compare": None,
    "onnx": None,
    "engine": None,
    "threads": None,
    "device": None,
    "classes": None,
    "images": None,
}


def parse_kv(argv: list[str]) -> tuple[Path, dict]:
    from recipes.dit.onnx import BACKENDS

    positional = [a for a in argv if "=" not in a]
    if len(positional) != 1 or positional[0] in ("-h", "--help"):
        raise SystemExit(__doc__)
    opts = dict(DEFAULTS)
    for arg in argv:
        if "=" in arg:
            key, value = arg.lstrip("-").split("=", 1)
            key = key.replace("-", "_")
            if key not in DEFAULTS:
                raise ValueError(f"unknown option {key!r} (known: {', '.join(DEFAULTS)})")
            opts[key] = value
    for key in ("backend", "compare"):
        if opts[key] is not None and opts[key] not in BACKENDS:
            raise ValueError(f"{key} must be one of {', '.join(BACKENDS)} (got {opts[key]!r})")
    return Path(positional[0]), opts


def class_ids(spec: str | None, classes: list[str]) -> list[int]:
    """Rows of the grid: `classes=cat,3` (names or ids) or, by default, the first GRID_MAX_CLASSES classes."""
    from common.diffusion.sampling import GRID_MAX_CLASSES

    if spec is None:
        return list(range(min(len(classes), GRID_MAX_CLASSES)))
    ids = []
    for item in spec.split(","):
        if item in classes:
            ids.append(classes.index(item))
        elif item.isdigit() and int(item) < len(classes):
            ids.append(int(item))
        else:
            raise ValueError(
                f"classes: no class {item!r} in this export (it has: {', '.join(classes[:10])}"
                f"{', ...' if len(classes) > 10 else ''})"
            )
    return ids


def sample(name: str, export: Path, opts: dict):
    """Images in [-1, 1] from one backend, their labels, and the seconds the denoising loop took."""
    import torch

    from recipes.dit.onnx import ExportSampler

    sampler = ExportSampler(
        export,
        name,
        onnx_path=opts["onnx"],
        engine_path=opts["engine"],
        threads=int(opts["threads"]) if opts["threads"] else None,
        device=opts["device"],
    )
    rows = class_ids(opts["classes"], sampler.classes)
    labels = torch.tensor(rows).repeat_interleave(int(opts["per_class"]))
    start = time.perf_counter()
    images = sampler(
        labels,
        generator=torch.Generator().manual_seed(int(opts["seed"])),
        steps=int(opts["steps"]) if opts["steps"] else None,
        guidance_scale=None if opts["guidance"] is None else float(opts["guidance"]),
    )
    return images, [sampler.classes[i] for i in labels.tolist()], time.perf_counter() - start


def save_images(images, names: list[str], folder: Path) -> None:
    """One PNG per sample: <index>_<class>.png."""
    from PIL import Image

    from common.diffusion.sampling import to_uint8

    folder.mkdir(parents=True, exist_ok=True)
    for i, (pixels, name) in enumerate(zip(to_uint8(images), names)):
        Image.fromarray(pixels).save(folder / f"{i:04d}_{name}.png")


def main(argv: list[str] | None = None) -> int:
    try:
        export, opts = parse_kv(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        print(f"sample_dit: error: {exc}", file=sys.stderr)
        return 2
    from scripts.kiln.serving import adapter_advice, is_adapter

    if is_adapter(export):  # a finetune=lora run's export
        print(f"sample_dit: error: {export} {adapter_advice(export, key='')}", file=sys.stderr)
        return 2
    if not (export / "kiln.json").exists():
        print(f"sample_dit: error: {export} is not a Kiln DiT export (no kiln.json)", file=sys.stderr)
        return 2
    import numpy as np

    from common.diffusion.sampling import save_grid, to_uint8

    steps = int(opts["steps"] or json.loads((export / "kiln.json").read_text())["sample_steps"])
    out = Path(opts["out"] or f"samples_{opts['backend']}.png")
    result = {"backend": opts["backend"], "steps": steps, "seed": int(opts["seed"])}
    try:
        images, names, secs = sample(opts["backend"], export, opts)
        rows = len(names) // int(opts["per_class"])
        save_grid(images, rows=rows, path=out)
        if opts["images"]:
            save_images(images, names, Path(opts["images"]))
            result["images"] = opts["images"]
        result.update(grid=str(out), seconds=round(secs, 3), steps_per_s=round(steps / secs, 2))
        print(
            f"sample_dit: {opts['backend']}: {images.shape[0]} images, {steps} steps in {secs:.2f}s "
            f"({steps / secs:.2f} denoising steps/s) -> {out}"
        )
        if opts["compare"]:
            other, _, osecs = sample(opts["compare"], export, opts)
            other_out = out.with_name(f"{out.stem}_{opts['compare']}{out.suffix}")
            save_grid(other, rows=rows, path=other_out)
            diff = int(np.abs(to_uint8(images).astype(np.int16) - to_uint8(other).astype(np.int16)).max())
            result.update(
                compare=opts["compare"],
                compare_grid=str(other_out),
                compare_seconds=round(osecs, 3),
                max_abs_pixel_diff=diff,
                max_abs_diff_float=float((images - other).abs().max()),
            )
            print(
                f"sample_dit: {opts['compare']}: {steps} steps in {osecs:.2f}s ({steps / osecs:.2f} steps/s) "
                f"-> {other_out}"
            )
            print(f"sample_dit: max abs pixel difference {opts['backend']} vs {opts['compare']}: {diff} / 255")
    except (FileNotFoundError, ImportError, RuntimeError, ValueError) as exc:
        print(f"sample_dit: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    from common.known_warnings import silence_known_warnings

    silence_known_warnings()
    sys.exit(main())
