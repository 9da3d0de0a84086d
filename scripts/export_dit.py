#!/usr/bin/env python
"""Export a DiT run's export/ folder to ONNX, check it against PyTorch, and build a TensorRT engine if trtexec is here.

    python scripts/export_dit.py EXPORT_DIR [--out EXPORT_DIR/onnx/model.onnx] [--max-batch 64] [--precision fp16|bf16]

Writes the fp32 ONNX graph (dynamic batch, fixed resolution), checks onnxruntime against eager
PyTorch on fresh random inputs at two batch sizes (exits 1 unless relative error <= --tol), writes
the trtexec command to trtexec.txt next to the ONNX file, and runs scripts/build_trt_engine.sh
when trtexec is on PATH. --max-batch is the model batch, i.e. twice the sampler's label batch
(classifier-free guidance runs the conditional and unconditional halves together).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
BUILD_SCRIPT = REPO / "scripts" / "build_trt_engine.sh"


def trtexec_command(onnx: Path, engine: Path, *, image_size: int, in_channels: int, max_batch: int, opt_batch: int,
                    precision: str) -> list[str]:
    """Arguments for scripts/build_trt_engine.sh (the one place the trtexec command is assembled)."""
    return [str(onnx), "--engine", str(engine), "--image-size", str(image_size), "--in-channels", str(in_channels),
            "--min-batch", "1", "--opt-batch", str(opt_batch), "--max-batch", str(max_batch), "--precision", precision]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", type=Path, help="run.dir/export of a DiT run")
    ap.add_argument("--out", type=Path, default=None, help="ONNX path (default: EXPORT_DIR/onnx/model.onnx)")
    ap.add_argument("--max-batch", type=int, default=64, help="largest model batch of the TensorRT profile")
    ap.add_argument("--opt-batch", type=int, default=None, help="batch TensorRT tunes for (default: --max-batch)")
    ap.add_argument("--precision", choices=("fp16", "bf16"), default="fp16", help="TensorRT build precision")
    ap.add_argument("--tol", type=float, default=1e-5, help="max relative error of onnxruntime vs PyTorch (fp32)")
    ap.add_argument("--parity-batches", type=int, nargs=2, default=(1, 4), metavar=("B1", "B2"))
    args = ap.parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # keep our lines in order with build_trt_engine.sh's

    def fail(msg: str, code: int = 1) -> int:
        print(f"export_dit: error: {msg}", file=sys.stderr)
        return code

    if not (args.export / "kiln.json").exists() or not (args.export / "transformer").is_dir():
        return fail(f"{args.export} is not a Kiln DiT export (needs kiln.json and transformer/)", 2)
    if args.max_batch < 1 or (args.opt_batch is not None and not 1 <= args.opt_batch <= args.max_batch):
        return fail("need 1 <= --opt-batch <= --max-batch", 2)
    if importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None:
        return fail("onnx/onnxruntime are not installed (pip install 'kiln[export]')", 2)

    from diffusers import DiTTransformer2DModel

    from recipes.dit.onnx import ParityError, check_parity, export_onnx

    info = json.loads((args.export / "kiln.json").read_text())
    model = DiTTransformer2DModel.from_pretrained(args.export / "transformer").float().eval()
    # The graph is the transformer: its own input size (the latent size of a latent model).
    image_size, in_channels = int(model.config.sample_size), int(model.config.in_channels)
    onnx_path = args.out or args.export / "onnx" / "model.onnx"

    export_onnx(model, onnx_path, image_size=image_size, in_channels=in_channels)
    print(f"export_dit: wrote {onnx_path} ({onnx_path.stat().st_size / 1e6:.2f} MB)")
    try:
        errors = check_parity(model, onnx_path, batch_sizes=tuple(args.parity_batches), tol=args.tol)
    except ParityError as exc:
        onnx_path.unlink(missing_ok=True)
        return fail(f"parity check failed: {exc}; removed {onnx_path}")
    print("export_dit: parity onnxruntime vs PyTorch (max rel err): "
          + ", ".join(f"batch {b}: {e:.2e}" for b, e in errors.items()) + f" (tol {args.tol:g})")

    engine = onnx_path.with_suffix(".plan")
    build_args = trtexec_command(onnx_path, engine, image_size=image_size, in_channels=in_channels,
                                 max_batch=args.max_batch, opt_batch=args.opt_batch or args.max_batch,
                                 precision=args.precision)
    printed = subprocess.run(["bash", str(BUILD_SCRIPT), *build_args, "--print"], capture_output=True, text=True)
    if printed.returncode != 0:
        return fail(f"build_trt_engine.sh --print failed: {printed.stderr.strip()}")
    command_file = onnx_path.parent / "trtexec.txt"
    command_file.write_text(printed.stdout)
    (onnx_path.parent / "onnx.json").write_text(json.dumps({
        "onnx": onnx_path.name, "engine": engine.name, "opset": 18, "inputs": ["sample", "timestep", "class_labels"],
        "objective": info.get("objective", "ddpm"),
        "output": "prediction", "image_size": image_size, "in_channels": in_channels, "max_batch": args.max_batch,
        "precision": args.precision, "parity_rel_err": {str(b): e for b, e in errors.items()},
    }, indent=2))
    print(f"export_dit: trtexec command in {command_file}")

    if shutil.which("trtexec") is None:
        print("export_dit: trtexec is not on PATH: SKIPPED building the TensorRT engine "
              f"(run scripts/build_trt_engine.sh or the command in {command_file} on a machine with TensorRT)")
        return 0
    built = subprocess.run(["bash", str(BUILD_SCRIPT), *build_args])
    if built.returncode != 0:
        return fail(f"TensorRT engine build failed (build_trt_engine.sh exited {built.returncode})")
    print(f"export_dit: wrote TensorRT engine {engine}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
