#!/usr/bin/env python
"""Export a DiT run's export/ folder to ONNX, check it against PyTorch, and build a TensorRT engine if trtexec is here.

    python scripts/export_dit.py EXPORT_DIR [--out EXPORT_DIR/onnx/model.onnx] [--max-batch 64]
                                 [--precision fp16|bf16|fp32] [--trt-version 10|11]

Writes the fp32 ONNX graph (dynamic batch, fixed resolution; onnxruntime serves it on CPU) and checks
onnxruntime against eager PyTorch on fresh random inputs at two batch sizes (exits 1 unless the
relative error is <= --tol). TensorRT 10 builds its engine from that graph with a precision flag;
TensorRT 11 has none (networks are strongly typed), so for it --precision fp16/bf16 also writes the
graph in that precision, model.fp16.onnx / model.bf16.onnx, checked against fp32 PyTorch to
recipes/dit/onnx.py's PARITY_TOL (fp16 1e-2, bf16 5e-2; --typed-tol overrides). The TensorRT version
is trtexec's when it is on PATH, else --trt-version, else the folder is made for both: trtexec.txt
then holds one command per version. Runs scripts/build_trt_engine.sh when trtexec is on PATH.
--max-batch is the model batch, i.e. twice the sampler's label batch (classifier-free guidance runs
the conditional and unconditional halves together).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
BUILD_SCRIPT = REPO / "scripts" / "build_trt_engine.sh"
TRT_VERSIONS = (10, 11)


def trtexec_command(
    onnx: Path,
    engine: Path,
    *,
    image_size: int,
    in_channels: int,
    max_batch: int,
    opt_batch: int,
    precision: str,
    trt_version: int | None = None,
) -> list[str]:
    """Arguments for scripts/build_trt_engine.sh (the one place the trtexec command is assembled)."""
    args = [
        str(onnx),
        "--engine",
        str(engine),
        "--image-size",
        str(image_size),
        "--in-channels",
        str(in_channels),
        "--min-batch",
        "1",
        "--opt-batch",
        str(opt_batch),
        "--max-batch",
        str(max_batch),
        "--precision",
        precision,
    ]
    return args + (["--trt-version", str(trt_version)] if trt_version else [])


def onnx_of(command: str) -> Path:
    """The graph a printed trtexec command builds from (its --onnx=)."""
    return Path(next(a.split("=", 1)[1] for a in shlex.split(command) if a.startswith("--onnx=")))


class _Fail(Exception):
    """An error that ends the export: its message, printed as ``export_dit: error: ...``, and exit code."""

    def __init__(self, msg: str, code: int = 1):
        super().__init__(msg)
        self.msg, self.code = msg, code


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", type=Path, help="run.dir/export of a DiT run")
    ap.add_argument("--out", type=Path, default=None, help="ONNX path (default: EXPORT_DIR/onnx/model.onnx)")
    ap.add_argument("--max-batch", type=int, default=64, help="largest model batch of the TensorRT profile")
    ap.add_argument("--opt-batch", type=int, default=None, help="batch TensorRT tunes for (default: --max-batch)")
    ap.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16", help="TensorRT engine precision")
    ap.add_argument(
        "--trt-version",
        type=int,
        choices=TRT_VERSIONS,
        default=None,
        help="TensorRT major version to write the command for (default: trtexec's, else both)",
    )
    ap.add_argument("--tol", type=float, default=1e-5, help="max relative error of onnxruntime vs PyTorch (fp32 graph)")
    ap.add_argument(
        "--typed-tol",
        type=float,
        default=None,
        help="max relative error of the fp16/bf16 graph vs fp32 PyTorch (default: PARITY_TOL)",
    )
    ap.add_argument("--parity-batches", type=int, nargs=2, default=(1, 4), metavar=("B1", "B2"))
    return ap


def _check_args(args: argparse.Namespace) -> None:
    if not (args.export / "kiln.json").exists() or not (args.export / "transformer").is_dir():
        raise _Fail(f"{args.export} is not a Kiln DiT export (needs kiln.json and transformer/)", 2)
    if args.max_batch < 1 or (args.opt_batch is not None and not 1 <= args.opt_batch <= args.max_batch):
        raise _Fail("need 1 <= --opt-batch <= --max-batch", 2)
    if importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None:
        raise _Fail("onnx/onnxruntime are not installed (pip install 'kiln[export]')", 2)


def _trtexec_commands(
    args: argparse.Namespace, onnx_path: Path, engine: Path, *, image_size: int, in_channels: int, have_trtexec: bool
) -> tuple[dict[int | None, list[str]], dict[int | None, str]]:
    """The trtexec command per TensorRT version, from build_trt_engine.sh (it reads trtexec's banner
    when trtexec is here): the script's arguments and the printed command of each."""
    versions = [args.trt_version] if args.trt_version else [None] if have_trtexec else list(TRT_VERSIONS)
    build_args = {
        v: trtexec_command(
            onnx_path,
            engine,
            image_size=image_size,
            in_channels=in_channels,
            max_batch=args.max_batch,
            opt_batch=args.opt_batch or args.max_batch,
            precision=args.precision,
            trt_version=v,
        )
        for v in versions
    }
    commands: dict[int | None, str] = {}
    for v, build in build_args.items():
        printed = subprocess.run(["bash", str(BUILD_SCRIPT), *build, "--print"], capture_output=True, text=True)
        if printed.returncode != 0:
            raise _Fail(f"build_trt_engine.sh --print failed: {printed.stderr.strip()}")
        commands[v] = printed.stdout.strip()
    return build_args, commands


def _export_graphs(args: argparse.Namespace, model, graphs: dict[Path, str], *, image_size: int, in_channels: int):
    """Each graph exported and checked against PyTorch: per graph file, its precision, tolerance and errors."""
    from recipes.dit.onnx import PARITY_TOL, ParityError, check_parity, export_onnx

    parity: dict[str, dict] = {}
    for path, precision in graphs.items():
        tol = args.tol if precision == "fp32" else (args.typed_tol or PARITY_TOL[precision])
        export_onnx(model, path, image_size=image_size, in_channels=in_channels, precision=precision)
        print(f"export_dit: wrote {path} ({precision}, {path.stat().st_size / 1e6:.2f} MB)")
        try:
            errors = check_parity(model, path, batch_sizes=tuple(args.parity_batches), tol=tol, precision=precision)
        except ParityError as exc:
            path.unlink(missing_ok=True)
            raise _Fail(f"parity check of the {precision} graph failed: {exc}; removed {path}") from None
        how = " (run widened to fp32: onnxruntime's CPU provider has no bf16 kernels)" if precision == "bf16" else ""
        print(
            f"export_dit: parity onnxruntime ({precision} graph{how}) vs PyTorch fp32 (max rel err): "
            + ", ".join(f"batch {b}: {e:.2e}" for b, e in errors.items())
            + f" (tol {tol:g})"
        )
        parity[path.name] = {"precision": precision, "tol": tol, "rel_err": {str(b): e for b, e in errors.items()}}
    return parity


def _write_manifest(args, info: dict, onnx_path: Path, engine: Path, commands: dict, parity: dict, **sizes) -> Path:
    """trtexec.txt (the command, or one per version) and onnx.json beside the graph; the command file's path."""
    command_file = onnx_path.parent / "trtexec.txt"
    if len(commands) == 1:
        command_file.write_text(next(iter(commands.values())) + "\n")
    else:  # no trtexec here: one command per version, the build machine's decides
        command_file.write_text(
            "".join(
                f"# TensorRT {v}: "
                f"{'fp32 graph + precision flag' if v == 10 else 'strongly typed, precision from the graph'}\n"
                f"{c}\n"
                for v, c in commands.items()
            )
        )
    (onnx_path.parent / "onnx.json").write_text(
        json.dumps(
            {
                "onnx": onnx_path.name,
                "engine": engine.name,
                "opset": 18,
                "inputs": ["sample", "timestep", "class_labels"],
                "objective": info.get("objective", "ddpm"),
                "output": "prediction",
                "image_size": sizes["image_size"],
                "in_channels": sizes["in_channels"],
                "max_batch": args.max_batch,
                "precision": args.precision,
                "parity_rel_err": parity[onnx_path.name]["rel_err"],
                "graphs": parity,
                "trtexec": {str(v or "detected"): c for v, c in commands.items()},
            },
            indent=2,
        )
    )
    return command_file


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # keep our lines in order with build_trt_engine.sh's
    try:
        return _export(args)
    except _Fail as exc:
        print(f"export_dit: error: {exc.msg}", file=sys.stderr)
        return exc.code


def _export(args: argparse.Namespace) -> int:
    _check_args(args)

    from diffusers import DiTTransformer2DModel

    info = json.loads((args.export / "kiln.json").read_text())
    model = DiTTransformer2DModel.from_pretrained(args.export / "transformer").float().eval()
    # The graph is the transformer: its own input size (the latent size of a latent model).
    sizes = {"image_size": int(model.config.sample_size), "in_channels": int(model.config.in_channels)}
    onnx_path = args.out or args.export / "onnx" / "model.onnx"
    engine = onnx_path.with_suffix(".plan")

    # The graphs the trtexec commands read are the ones to export.
    have_trtexec = shutil.which("trtexec") is not None
    build_args, commands = _trtexec_commands(args, onnx_path, engine, **sizes, have_trtexec=have_trtexec)
    graphs = {onnx_path: "fp32"} | {onnx_of(c): args.precision for c in commands.values() if onnx_of(c) != onnx_path}
    parity = _export_graphs(args, model, graphs, **sizes)
    command_file = _write_manifest(args, info, onnx_path, engine, commands, parity, **sizes)
    print(f"export_dit: trtexec command in {command_file}")

    if not have_trtexec:
        print(
            "export_dit: trtexec is not on PATH: SKIPPED building the TensorRT engine "
            f"(run scripts/build_trt_engine.sh or the command in {command_file} on a machine with TensorRT)"
        )
        return 0
    built = subprocess.run(["bash", str(BUILD_SCRIPT), *next(iter(build_args.values()))])
    if built.returncode != 0:
        raise _Fail(f"TensorRT engine build failed (build_trt_engine.sh exited {built.returncode})")
    print(f"export_dit: wrote TensorRT engine {engine}")
    return 0


if __name__ == "__main__":
    from common.known_warnings import silence_known_warnings

    silence_known_warnings()
    sys.exit(main())
