"""scripts/build_trt_engine.sh against TensorRT 10 and 11 without TensorRT: stand-in `trtexec`
scripts on PATH print each version's banner and record the arguments of the build they are asked for."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.fixtures.trt import fake_trtexec

BUILD = str(REPO / "scripts" / "build_trt_engine.sh")
SHAPES = "sample:{b}x1x16x16,timestep:{b},class_labels:{b}"
PRECISION_FLAGS = {"--fp16", "--bf16", "--int8", "--fp8", "--int4", "--best", "--noTF32"}


def run_build(args: list[str], bin_dir: Path | None) -> subprocess.CompletedProcess:
    path = f"{bin_dir}:/usr/bin:/bin" if bin_dir else "/usr/bin:/bin"
    return subprocess.run(
        ["bash", BUILD, *args], capture_output=True, text=True, timeout=60, env={**os.environ, "PATH": path}
    )


@pytest.fixture
def onnx_files(tmp_path):
    """model.onnx (fp32) and its fp16/bf16 siblings, as scripts/export_dit.py names them (contents unread)."""
    folder = tmp_path / "onnx"
    folder.mkdir()
    for name in ("model.onnx", "model.fp16.onnx", "model.bf16.onnx"):
        (folder / name).write_bytes(b"onnx")
    return folder


def expected_argv(onnx: Path, engine: Path, *flags: str, opt: int = 8, top: int = 8) -> list[str]:
    return [
        f"--onnx={onnx}",
        f"--saveEngine={engine}",
        f"--minShapes={SHAPES.format(b=1)}",
        f"--optShapes={SHAPES.format(b=opt)}",
        f"--maxShapes={SHAPES.format(b=top)}",
        *flags,
    ]


@pytest.mark.parametrize(
    "major, precision, graph, flags",
    [
        (10, "fp16", "model.onnx", ["--fp16"]),  # weakly typed: fp32 graph + flag
        (10, "bf16", "model.onnx", ["--bf16"]),
        (10, "fp32", "model.onnx", []),
        (11, "fp16", "model.fp16.onnx", []),  # strongly typed: the graph's precision, no flag
        (11, "bf16", "model.bf16.onnx", []),
        (11, "fp32", "model.onnx", []),
    ],
)
def test_build_command_per_tensorrt_version(tmp_path, onnx_files, major, precision, graph, flags):
    bin_dir = tmp_path / "bin"
    fake_trtexec(bin_dir, major)
    engine = tmp_path / "dit.plan"
    proc = run_build(
        [
            str(onnx_files / "model.onnx"),
            "--engine",
            str(engine),
            "--image-size",
            "16",
            "--in-channels",
            "1",
            "--max-batch",
            "8",
            "--precision",
            precision,
        ],
        bin_dir,
    )
    assert proc.returncode == 0, proc.stderr
    argv = json.loads((bin_dir / "argv.json").read_text())
    assert argv == expected_argv(onnx_files / graph, engine, *flags)
    if major >= 11:
        assert not PRECISION_FLAGS & set(argv)
    assert engine.read_bytes() == b"engine" and f"TensorRT {major}:" in proc.stdout


def test_tensorrt_11_needs_the_typed_graph(tmp_path, onnx_files):
    (onnx_files / "model.fp16.onnx").unlink()
    bin_dir = tmp_path / "bin"
    fake_trtexec(bin_dir, 11)
    proc = run_build([str(onnx_files / "model.onnx"), "--image-size", "16", "--in-channels", "1"], bin_dir)
    assert proc.returncode == 2 and not (bin_dir / "argv.json").exists()
    assert proc.stderr.strip() == (
        f"build_trt_engine: error: no fp16 graph at {onnx_files / 'model.fp16.onnx'}: "
        "TensorRT 11 takes the precision from the ONNX; write it with "
        "scripts/export_dit.py EXPORT_DIR --precision fp16"
    )


@pytest.mark.parametrize(
    "major, message",
    [
        (8, "TensorRT 8 is not supported: Kiln builds with TensorRT 10 or 11"),
        (0, "could not read the TensorRT version from 'trtexec --version'"),
    ],
)
def test_unknown_tensorrt_versions_stop_with_one_line(tmp_path, onnx_files, major, message):
    bin_dir = tmp_path / "bin"
    fake_trtexec(bin_dir, major)
    proc = run_build([str(onnx_files / "model.onnx"), "--image-size", "16", "--in-channels", "1"], bin_dir)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr


def test_print_without_tensorrt(onnx_files):
    onnx = onnx_files / "model.onnx"
    args = [str(onnx), "--image-size", "16", "--in-channels", "1", "--max-batch", "8", "--print"]
    proc = run_build(args, None)
    assert proc.returncode == 2 and "--print without trtexec on PATH needs --trt-version 10|11" in proc.stderr
    for major, graph, flags in ((10, "model.onnx", ["--fp16"]), (11, "model.fp16.onnx", [])):
        proc = run_build([*args, "--trt-version", str(major)], None)
        assert proc.returncode == 0, proc.stderr
        engine = onnx_files / "model.plan"
        assert proc.stdout.split() == ["trtexec", *expected_argv(onnx_files / graph, engine, *flags)]
    proc = run_build([str(onnx), "--image-size", "16", "--in-channels", "1"], None)  # a real build needs trtexec
    assert proc.returncode == 2 and "trtexec not found on PATH" in proc.stderr


def test_version_flag_overrides_the_banner(tmp_path, onnx_files):
    bin_dir = tmp_path / "bin"
    fake_trtexec(bin_dir, 11)
    proc = run_build(
        [
            str(onnx_files / "model.onnx"),
            "--image-size",
            "16",
            "--in-channels",
            "1",
            "--max-batch",
            "8",
            "--trt-version",
            "10",
        ],
        bin_dir,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads((bin_dir / "argv.json").read_text())[-1] == "--fp16"
