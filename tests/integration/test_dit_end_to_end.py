"""dit_tiny end to end on CPU: trains (loss falls), writes every artifact, and its export loads in
diffusers and reproduces the trained EMA model's output."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import DDIMScheduler, DiTTransformer2DModel
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from recipes.dit.model import build_model
from scripts.kiln.launch import compose
from tests.conftest import FAST_DIT, losses, metrics, run_train

pytestmark = pytest.mark.integration
STEPS = 80


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dit_e2e")
    run_train(
        [
            *FAST_DIT,
            f"run.dir={d}",
            f"trainer.max_steps={STEPS}",
            "trainer.log_every=10",
            "diffusion.sample_every=40",
            "profile.enabled=true",
            "profile.wait=1",
            "profile.warmup=1",
            "profile.active=2",
        ]
    )
    return d


def test_loss_falls_and_metrics_are_complete(run_dir):
    records = list(metrics(run_dir).values())
    assert [r["step"] for r in records] == list(range(10, STEPS + 1, 10))
    for key in (
        "loss",
        "lr",
        "grad_norm",
        "step_time_s",
        "data_wait_s",
        "samples_per_s",
        "forward_s",
        "backward_s",
        "optimizer_s",
    ):
        assert key in records[-1], key
    ls = losses(run_dir)
    assert ls[STEPS] < 0.6 * ls[10]
    events = EventAccumulator(str(run_dir / "tb")).Reload()
    assert len(events.Scalars("loss")) == len(records)
    assert Image.open(run_dir / "loss.png").size[0] > 100


def test_run_dir_artifacts(run_dir):
    assert compose(["recipe=dit_tiny"]).recipe.name in (run_dir / "config.yaml").read_text()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:07d}"
    grid = Image.open(run_dir / "samples" / "step_0000040.png")
    assert grid.size[1] > grid.size[0] / 2  # 10 class rows
    result = json.loads((run_dir / "eval.json").read_text())
    assert set(result["per_class_accuracy"]) == {str(c) for c in range(10)}
    assert result["classifier_accuracy_on_real_val"] > 0.9
    traces = sorted((run_dir / "profile").glob("rank0_step*.json"))
    assert traces and "traceEvents" in json.loads(traces[0].read_text())


def test_export_loads_in_diffusers_and_matches_ema_weights(run_dir):
    export = run_dir / "export"
    loaded = DiTTransformer2DModel.from_pretrained(export / "transformer").eval()
    assert DDIMScheduler.from_pretrained(export / "scheduler").config.prediction_type == "v_prediction"
    info = json.loads((export / "kiln.json").read_text())
    assert info["num_classes"] == 10 and info["null_class"] == 10

    # Rebuild the trained model from the final checkpoint's EMA shadow weights.
    cfg = compose([*FAST_DIT])
    reference = build_model(cfg.model, cfg.data.image_size).eval()
    state = torch.load(run_dir / "checkpoints" / f"step_{STEPS:07d}" / "trainer.pt", weights_only=False)
    params = dict(reference.named_parameters())
    assert sorted(state["ema"]["shadow"]) == sorted(name for name, p in params.items() if p.requires_grad)
    with torch.no_grad():
        for name, s in state["ema"]["shadow"].items():
            params[name].copy_(s)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 1, 16, 16, generator=g)
    t, y = torch.tensor([10, 200, 600, 999]), torch.tensor([0, 4, 9, 10])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(x, timestep=t, class_labels=y).sample,
            reference(x, timestep=t, class_labels=y).sample,
            rtol=0,
            atol=0,
        )
