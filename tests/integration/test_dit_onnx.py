"""DiT serving export: ONNX export + onnxruntime parity (fp32, and the fp16/bf16 graphs TensorRT 11
builds from), the full DDIM/CFG sampler on onnxruntime against PyTorch, the trtexec commands, and
(GPU only) a TensorRT engine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import onnx
import onnxruntime  # noqa: F401  (a declared dependency: imported, never skipped)
import pytest
import torch
from diffusers import DDPMScheduler, DiTTransformer2DModel

from common.diffusion.evaluate import class_labels
from common.diffusion.sampling import sample_images, to_uint8
from recipes.dit.model import build_model
from recipes.dit.onnx import PARITY_TOL, OnnxDiT, ParityError, check_parity, export_onnx
from scripts.kiln.launch import compose
from tests.conftest import REPO, gpus_visible, load_script
from tests.fixtures.trt import fake_trtexec

pytestmark = pytest.mark.integration

IMAGE_SIZE = 16
SAMPLE_STEPS = 12
MAX_PIXEL_DIFF = 2  # of 255, torch vs onnxruntime after the whole sampler


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    """A dit_tiny export folder written by hand (random weights), laid out like DiTTrainer.export()."""
    cfg = compose(["recipe=dit_tiny"])
    torch.manual_seed(0)
    model = build_model(cfg.model, IMAGE_SIZE).eval()
    d = cfg.diffusion
    out = tmp_path_factory.mktemp("dit_onnx") / "export"
    model.save_pretrained(out / "transformer", safe_serialization=True)
    DDPMScheduler(
        num_train_timesteps=d.num_train_timesteps,
        beta_schedule=d.beta_schedule,
        prediction_type=d.prediction_type,
        clip_sample=False,
    ).save_pretrained(out / "scheduler")
    info = {
        "recipe": "dit_tiny",
        "step": 0,
        "image_size": IMAGE_SIZE,
        "num_classes": cfg.model.num_classes,
        "null_class": cfg.model.num_classes,
        "sample_steps": SAMPLE_STEPS,
        "guidance_scale": d.guidance_scale,
    }
    (out / "kiln.json").write_text(json.dumps(info))
    return out


@pytest.fixture(scope="module")
def exported(export_dir):
    """Runs scripts/export_dit.py (in process) on the export folder; returns its ONNX path. Where
    trtexec is on PATH it also builds the engine, on the GPU."""
    with gpus_visible():
        rc = load_script("export_dit").main([str(export_dir), "--max-batch", "32", "--precision", "fp16"])
    assert rc == 0
    return export_dir / "onnx" / "model.onnx"


@pytest.fixture(scope="module")
def torch_model(export_dir):
    return DiTTransformer2DModel.from_pretrained(export_dir / "transformer").eval()


def test_onnx_matches_pytorch_on_fresh_inputs(exported, torch_model):
    errors = check_parity(torch_model, exported, batch_sizes=(1, 4), tol=1e-5, seed=99)
    print(f"parity max rel err: {errors}")
    assert set(errors) == {1, 4} and all(e <= 1e-5 for e in errors.values())
    recorded = json.loads((exported.parent / "onnx.json").read_text())["parity_rel_err"]
    assert set(recorded) == {"1", "4"} and all(e <= 1e-5 for e in recorded.values())


def test_parity_check_is_not_vacuous(exported, torch_model):
    """A model that differs from the exported one must fail the check."""
    other = DiTTransformer2DModel.from_config(torch_model.config).eval()
    other.load_state_dict(torch_model.state_dict())
    with torch.no_grad():
        other.proj_out_2.bias.add_(1e-2)
    with pytest.raises(ParityError) as info:
        check_parity(other, exported, batch_sizes=(2,), tol=1e-5)
    assert info.value.errors[2] > 1e-5


def test_full_sampler_torch_vs_onnxruntime(export_dir, exported, torch_model):
    info = json.loads((export_dir / "kiln.json").read_text())
    scheduler_config = dict(DDPMScheduler.from_pretrained(export_dir / "scheduler").config)
    labels = class_labels(info["num_classes"], 2)  # 20 images, model batch 40 with CFG

    def run(model):
        return sample_images(
            model,
            scheduler_config,
            labels,
            null_class=info["null_class"],
            image_size=IMAGE_SIZE,
            in_channels=1,
            steps=SAMPLE_STEPS,
            guidance_scale=info["guidance_scale"],
            generator=torch.Generator().manual_seed(3),
            device=torch.device("cpu"),
        )

    ref, got = run(torch_model), run(OnnxDiT(exported))
    assert got.shape == ref.shape == (20, 1, IMAGE_SIZE, IMAGE_SIZE)
    pix = np.abs(to_uint8(ref).astype(np.int16) - to_uint8(got).astype(np.int16)).max()
    print(f"sampler max abs diff: float {float((ref - got).abs().max()):.3g}, uint8 pixels {pix}")
    assert float(ref.std()) > 0.05  # the images are not a constant that would hide disagreement
    assert pix <= MAX_PIXEL_DIFF


def test_sample_script_compare(export_dir, exported, tmp_path, capsys):
    out = tmp_path / "grid.png"
    rc = load_script("sample_dit").main(
        [str(export_dir), "backend=onnxruntime", "compare=torch", "steps=5", "per_class=1", "seed=1", f"out={out}"]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out.exists() and (tmp_path / "grid_torch.png").exists()
    assert result["backend"] == "onnxruntime" and result["compare"] == "torch"
    assert result["max_abs_pixel_diff"] <= MAX_PIXEL_DIFF


def test_trtexec_commands_for_both_versions_without_tensorrt(exported):
    """Without trtexec here the folder is made for either TensorRT: one command per version, and the
    fp16 graph that 11 builds from sits next to the fp32 one (checked like it, at the fp16 bound)."""
    if shutil.which("trtexec") is not None:
        pytest.skip("trtexec is on PATH: the export wrote its version's command only")
    lines = (exported.parent / "trtexec.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in lines[::2]] == ["# TensorRT 10", "# TensorRT 11"]
    v10, v11 = lines[1].split(), lines[3].split()
    typed = exported.with_name("model.fp16.onnx")
    assert v10[0] == v11[0] == "trtexec" and f"--onnx={exported}" in v10 and f"--onnx={typed}" in v11
    assert "--fp16" in v10 and "--fp16" not in v11
    for cmd in (v10, v11):
        assert f"--saveEngine={exported.with_suffix('.plan')}" in cmd
        for flag, batch in (("--minShapes", 1), ("--optShapes", 32), ("--maxShapes", 32)):
            assert f"{flag}=sample:{batch}x1x{IMAGE_SIZE}x{IMAGE_SIZE},timestep:{batch},class_labels:{batch}" in cmd
    graphs = json.loads((exported.parent / "onnx.json").read_text())["graphs"]
    assert graphs["model.fp16.onnx"]["tol"] == PARITY_TOL["fp16"]
    assert all(e <= PARITY_TOL["fp16"] for e in graphs["model.fp16.onnx"]["rel_err"].values())
    proc = subprocess.run(
        [
            "bash",
            str(REPO / "scripts" / "build_trt_engine.sh"),
            str(exported),
            "--image-size",
            "16",
            "--in-channels",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "trtexec not found on PATH" in proc.stderr


def _tensor_types(path) -> tuple[set[int], dict[str, int]]:
    """(element types of the weights, element type of each graph input/output)."""
    model = onnx.load(str(path))
    weights = {i.data_type for i in model.graph.initializer if len(i.dims) >= 2}  # matrices and conv kernels
    io = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)}
    return weights, io


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_typed_graphs_compute_in_their_precision_and_match_fp32_pytorch(torch_model, tmp_path, precision):
    from onnx import TensorProto

    path = export_onnx(
        torch_model, tmp_path / f"model.{precision}.onnx", image_size=IMAGE_SIZE, in_channels=1, precision=precision
    )
    weights, io = _tensor_types(path)
    assert weights == {TensorProto.FLOAT16 if precision == "fp16" else TensorProto.BFLOAT16}
    # fp32 I/O (timestep too: the flow sampler's timesteps are floats): OnnxDiT/TensorRTDiT feed the same tensors
    assert io == {
        "sample": TensorProto.FLOAT,
        "timestep": TensorProto.FLOAT,
        "class_labels": TensorProto.INT64,
        "prediction": TensorProto.FLOAT,
    }
    errors = check_parity(torch_model, path, batch_sizes=(1, 4), tol=PARITY_TOL[precision], seed=7, precision=precision)
    print(f"{precision} graph vs fp32 PyTorch, max rel err: {errors}")
    # Rounding happened (the graph is not secretly fp32), within the bound.
    assert all(1e-5 < e <= PARITY_TOL[precision] for e in errors.values())

    other = DiTTransformer2DModel.from_config(torch_model.config).eval()  # and a different model fails it
    other.load_state_dict(torch_model.state_dict())
    with torch.no_grad():
        other.proj_out_2.bias.add_(0.5)
    with pytest.raises(ParityError):
        check_parity(other, path, batch_sizes=(2,), tol=PARITY_TOL[precision], precision=precision)


def test_export_with_tensorrt_11_builds_from_the_fp16_graph(export_dir, tmp_path, monkeypatch):
    """export_dit.py on a machine whose trtexec says TensorRT 11: the engine is built from the fp16 graph,
    with no precision flag."""
    bin_dir = tmp_path / "bin"
    fake_trtexec(bin_dir, 11)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    out = tmp_path / "onnx" / "model.onnx"
    assert load_script("export_dit").main([str(export_dir), "--out", str(out), "--max-batch", "8"]) == 0
    argv = json.loads((bin_dir / "argv.json").read_text())
    assert argv[0] == f"--onnx={out.with_name('model.fp16.onnx')}" and not {"--fp16", "--bf16"} & set(argv)
    assert out.with_suffix(".plan").exists() and out.with_name("model.fp16.onnx").exists()
    assert (out.parent / "trtexec.txt").read_text().split() == ["trtexec", *argv]


@pytest.mark.gpu
def test_tensorrt_engine_matches_pytorch(export_dir, exported, torch_model, tmp_path):
    pytest.importorskip("tensorrt", reason="the tensorrt package is not installed")
    if shutil.which("trtexec") is None:
        pytest.skip("trtexec is not on PATH")
    from recipes.dit.onnx import TensorRTDiT

    engine = tmp_path / "model.plan"
    subprocess.run(
        [
            "bash",
            str(REPO / "scripts" / "build_trt_engine.sh"),
            str(exported),
            "--engine",
            str(engine),
            "--image-size",
            "16",
            "--in-channels",
            "1",
            "--max-batch",
            "16",
            "--precision",
            "fp16",
        ],
        check=True,
        env=os.environ.copy(),
    )
    trt_model = TensorRTDiT(engine)
    g = torch.Generator().manual_seed(5)
    x, t = torch.randn(40, 1, 16, 16, generator=g), torch.randint(0, 1000, (40,), generator=g)
    y = torch.randint(0, 11, (40,), generator=g)  # 40 > max batch 16: exercises the chunking
    with torch.no_grad():
        ref = torch_model(x, timestep=t, class_labels=y).sample
    got = trt_model(x.cuda(), timestep=t.cuda(), class_labels=y.cuda()).sample.cpu()
    assert float((got - ref).abs().max() / ref.abs().max()) < 2e-2  # fp16 engine
