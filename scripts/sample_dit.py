#!/usr/bin/env python
"""Sample a class grid from an exported DiT on PyTorch, onnxruntime or TensorRT (the same sampler + CFG loop).

    python scripts/sample_dit.py EXPORT_DIR [backend=torch|onnxruntime|tensorrt] [steps=N] [seed=S]
        [out=grid.png] [per_class=4] [guidance=G] [compare=torch|onnxruntime|tensorrt]
        [onnx=EXPORT_DIR/onnx/model.onnx] [engine=EXPORT_DIR/onnx/model.plan] [threads=N] [device=cpu|cuda]

Every backend runs recipes.dit.sampling.sample_images with the same seed, so grids are comparable:
`compare=B` also samples on backend B (e.g. backend=onnxruntime compare=torch) and prints the max
abs pixel difference (uint8, 0..255) between the two grids.
onnxruntime/tensorrt need scripts/export_dit.py to have written the ONNX file / engine first.

Any export: DDPM models sample with DDIM, flow models with FlowMatchEulerDiscreteScheduler (the
export's scheduler/ says which), and a latent model's samples are decoded by its vae/ in PyTorch
whatever the backend. Guidance uses the model's own null class (kiln.json), so unlike diffusers'
DiTPipeline (ImageNet's 1000) it is right for any class count. One row per class, the first 32.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BACKENDS = ("torch", "onnxruntime", "tensorrt")
DEFAULTS = {"backend": "torch", "steps": None, "seed": "0", "out": None, "per_class": "4", "guidance": None,
            "compare": None, "onnx": None, "engine": None, "threads": None, "device": None}


def parse_kv(argv: list[str]) -> tuple[Path, dict]:
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


def load_backend(name: str, export: Path, opts: dict):
    """(model, device) for a backend; the model has the diffusers call signature sample_images uses."""
    import torch

    if name == "torch":
        from diffusers import DiTTransformer2DModel

        device = torch.device(opts["device"] or "cpu")
        return DiTTransformer2DModel.from_pretrained(export / "transformer").eval().to(device), device
    if name == "onnxruntime":
        from recipes.dit.onnx import OnnxDiT

        path = Path(opts["onnx"] or export / "onnx" / "model.onnx")
        if not path.exists():
            raise FileNotFoundError(f"no ONNX file at {path}: run scripts/export_dit.py {export} first")
        return OnnxDiT(path, threads=int(opts["threads"]) if opts["threads"] else None), torch.device("cpu")
    from recipes.dit.onnx import TensorRTDiT

    path = Path(opts["engine"] or export / "onnx" / "model.plan")
    device = torch.device(opts["device"] or "cuda")
    return TensorRTDiT(path, device=device), device


def sample(name: str, export: Path, info: dict, opts: dict):
    """Images in [-1, 1] from one backend, and the seconds the denoising loop took."""
    import torch

    from recipes.dit.evaluate import class_labels
    from recipes.dit.sampling import GRID_MAX_CLASSES, sample_images
    from recipes.dit.vae import folder_decoder

    model, device = load_backend(name, export, opts)
    scheduler_config = json.loads((export / "scheduler" / "scheduler_config.json").read_text())
    transformer = json.loads((export / "transformer" / "config.json").read_text())
    decode = folder_decoder(export / "vae", info["image_size"], device) if (export / "vae").is_dir() else None
    labels = class_labels(min(info["num_classes"], GRID_MAX_CLASSES), int(opts["per_class"]))
    kwargs = {}
    if name == "tensorrt":  # keep CFG's doubled batch inside the engine's profile (TensorRTDiT also splits)
        kwargs["batch_size"] = max(1, model.max_batch // 2)
    start = time.perf_counter()
    images = sample_images(
        model, scheduler_config, labels, null_class=info["null_class"], image_size=transformer["sample_size"],
        in_channels=transformer["in_channels"], steps=int(opts["steps"] or info["sample_steps"]),
        guidance_scale=float(info["guidance_scale"] if opts["guidance"] is None else opts["guidance"]),
        generator=torch.Generator().manual_seed(int(opts["seed"])), device=device, decode=decode, **kwargs,
    )
    return images, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    try:
        export, opts = parse_kv(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        print(f"sample_dit: error: {exc}", file=sys.stderr)
        return 2
    if not (export / "kiln.json").exists():
        print(f"sample_dit: error: {export} is not a Kiln DiT export (no kiln.json)", file=sys.stderr)
        return 2
    import numpy as np

    from recipes.dit.sampling import GRID_MAX_CLASSES, save_grid, to_uint8

    info = json.loads((export / "kiln.json").read_text())
    rows = min(info["num_classes"], GRID_MAX_CLASSES)
    steps = int(opts["steps"] or info["sample_steps"])
    out = Path(opts["out"] or f"samples_{opts['backend']}.png")
    result = {"backend": opts["backend"], "steps": steps, "seed": int(opts["seed"])}
    try:
        images, secs = sample(opts["backend"], export, info, opts)
        save_grid(images, rows=rows, path=out)
        result.update(grid=str(out), seconds=round(secs, 3), steps_per_s=round(steps / secs, 2))
        print(f"sample_dit: {opts['backend']}: {images.shape[0]} images, {steps} steps in {secs:.2f}s "
              f"({steps / secs:.2f} denoising steps/s) -> {out}")
        if opts["compare"]:
            other, osecs = sample(opts["compare"], export, info, opts)
            other_out = out.with_name(f"{out.stem}_{opts['compare']}{out.suffix}")
            save_grid(other, rows=rows, path=other_out)
            diff = int(np.abs(to_uint8(images).astype(np.int16) - to_uint8(other).astype(np.int16)).max())
            result.update(compare=opts["compare"], compare_grid=str(other_out), compare_seconds=round(osecs, 3),
                          max_abs_pixel_diff=diff, max_abs_diff_float=float((images - other).abs().max()))
            print(f"sample_dit: {opts['compare']}: {steps} steps in {osecs:.2f}s ({steps / osecs:.2f} steps/s) -> {other_out}")
            print(f"sample_dit: max abs pixel difference {opts['backend']} vs {opts['compare']}: {diff} / 255")
    except (FileNotFoundError, ImportError, RuntimeError) as exc:
        print(f"sample_dit: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    from common.known_warnings import silence_known_warnings

    silence_known_warnings()
    sys.exit(main())
