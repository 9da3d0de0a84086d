"""Recipe building blocks: DiT attention backends agree, label dropout is ours, dry runs size the big recipes."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_processor import Attention

from recipes.dit.config import DiTModelConfig
from recipes.dit.model import build_model, null_class
from recipes.dit.parallelize import KernelAttnProcessor, flash_kernel, sdpa_kernel, set_attention
from scripts.kiln.launch import compose
from tests.conftest import run_train


def _inputs(n=3, size=16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, size, size, generator=g), torch.tensor([5, 500, 999][:n]), torch.tensor([0, 3, 10][:n])


@pytest.mark.parametrize("backend", ["eager"])
def test_attention_backends_agree_with_sdpa(backend):
    torch.manual_seed(0)
    model = build_model(DiTModelConfig(num_layers=2), 16).eval()
    x, t, y = _inputs()
    with torch.no_grad():
        ref = model(x, timestep=t, class_labels=y).sample
        set_attention(model, backend)
        out = model(x, timestep=t, class_labels=y).sample
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_kernel_processor_matches_diffusers_sdpa_processor():
    """The flash path's projections, checked with the SDPA kernel on CPU."""
    torch.manual_seed(0)
    model = build_model(DiTModelConfig(num_layers=2), 16).eval()
    x, t, y = _inputs()
    with torch.no_grad():
        ref = model(x, timestep=t, class_labels=y).sample
        for m in model.modules():
            if isinstance(m, Attention):
                m.set_processor(KernelAttnProcessor(sdpa_kernel))
        out = model(x, timestep=t, class_labels=y).sample
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_flash_kernel_matches_sdpa_on_cuda():
    q, k, v = (torch.randn(2, 64, 4, 32, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.testing.assert_close(flash_kernel(q, k, v), sdpa_kernel(q, k, v), rtol=2e-2, atol=2e-2)


def test_label_dropout_is_left_to_the_trainer():
    model = build_model(DiTModelConfig(num_layers=1, num_classes=10), 16).train()
    assert null_class(model) == 10
    x, t, _ = _inputs()
    y = torch.tensor([1, 2, 3])
    torch.manual_seed(0)
    a = model(x, timestep=t, class_labels=y).sample
    torch.manual_seed(1)
    b = model(x, timestep=t, class_labels=y).sample
    torch.testing.assert_close(a, b)  # no random label drops inside the model


def test_dit_2b_parameter_count_on_meta():
    cfg = compose(["recipe=dit_2b"])
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.data.image_size)
    n = sum(p.numel() for p in model.parameters())
    assert 1.9e9 <= n <= 2.4e9


def test_dry_run_prints_size_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(["recipe=dit_2b", "run.dry_run=true", f"run.dir={run_dir}", "parallel.dp=8"], timeout=300)
    assert "(2.13B)" in proc.stdout and "ZeRO stage 2 over dp=8" in proc.stdout
    assert "GiB" in proc.stdout
    assert not run_dir.exists()


def test_vlm_7b_dry_run_reports_llava_15_size(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(["recipe=vlm_7b", "run.dry_run=true", f"run.dir={run_dir}", "parallel.dp=8"], timeout=300)
    assert "7,063,427,072 parameters (7.06B)" in proc.stdout and "ZeRO stage 3 over dp=8" in proc.stdout
    assert not run_dir.exists()


def test_llm_8b_dry_run_reports_llama3_size(tmp_path):
    proc = run_train(["recipe=llm_8b", "run.dry_run=true", f"run.dir={tmp_path / 'run'}", "parallel.dp=4"], timeout=300)
    assert "8,030,261,248 parameters (8.03B)" in proc.stdout and "dp=4 tp=8 pp=1" in proc.stdout
    assert not (tmp_path / "run").exists()
