"""Small common pieces: LR schedule, EMA, metrics files, ZeRO memory arithmetic, toggles."""

from __future__ import annotations

import json

import pytest
import torch

from common.config import OptimConfig, TogglesConfig
from common.ema import EMA
from common.errors import ConfigError
from common.metrics import add_to_step, plot_loss_curve, plot_reward_curve, rewind_jsonl
from common.optim import lr_factor
from common.toggles import check_toggles


def test_lr_schedule_warmup_then_cosine_to_floor():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    factors = [lr_factor(s, cfg, 110) for s in range(111)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))
    assert factors[110] == pytest.approx(0.1)
    assert lr_factor(50, OptimConfig(schedule="constant"), 100) == 1.0


def test_ema_tracks_and_swaps_back():
    model = torch.nn.Linear(3, 2)
    ema = EMA(model, decay=0.5)
    start = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(2.0)
    ema.update()  # first update: warm-up decay (1 + 0) / (10 + 0) = 0.1
    assert torch.allclose(ema.shadow[0], start + 1.8)
    ema.updates = 100  # (a resumed EMA after 100 updates: state_dict carries the count)
    ema.update()  # capped at 0.5
    assert torch.allclose(ema.shadow[0], start + 1.9)
    trained = model.weight.detach().clone()
    with ema.swapped():
        assert torch.allclose(model.weight, start + 1.9)
    assert torch.equal(model.weight, trained)


def test_metrics_rewind_and_plot(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s, "lr": 0.1}) + "\n" for s in range(1, 21)))
    rewind_jsonl(path, 10)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == list(range(1, 11))
    plot_loss_curve(path, tmp_path / "loss.png")
    from PIL import Image

    assert Image.open(tmp_path / "loss.png").size[0] > 100


def test_a_late_evaluation_joins_its_step_or_gets_a_record(tmp_path):
    """add_to_step: GRPO's held-out reward after the loop (step 10: the last record's) and before it (step 0: its own
    record, which rewind_jsonl keeps); plot_reward_curve draws both series."""
    path = tmp_path / "metrics.jsonl"
    add_to_step(path, 0, {"eval/reward": 0.0})
    with open(path, "a") as out:
        out.write("".join(json.dumps({"step": s, "loss": 0.1, "reward": s / 10}) + "\n" for s in range(1, 11)))
    add_to_step(path, 10, {"eval/reward": 1.0})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(11))
    assert records[0] == {"step": 0, "eval/reward": 0.0}
    assert records[-1] == {"step": 10, "loss": 0.1, "reward": 1.0, "eval/reward": 1.0}
    rewind_jsonl(path, 0)
    assert path.read_text() == json.dumps({"step": 0, "eval/reward": 0.0}) + "\n"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    plot_reward_curve(path, tmp_path / "reward.png")
    from PIL import Image

    assert Image.open(tmp_path / "reward.png").size[0] > 100


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only expectations")
@pytest.mark.parametrize(
    "toggles", [TogglesConfig(attention="flash"), TogglesConfig(precision="fp8"), TogglesConfig(precision="fp16")]
)
def test_gpu_only_toggles_fail_clearly_on_cpu(toggles):
    with pytest.raises(ConfigError, match="toggles"):
        check_toggles(toggles)
    check_toggles(TogglesConfig(precision="bf16"))  # bf16 is fine on CPU


@pytest.mark.parametrize(
    "switch, backend, on",
    [
        (None, "nccl", True),
        (None, "gloo", False),
        ("1", "gloo", True),
        ("0", "nccl", False),
        ("1", "nccl", True),
    ],
)
def test_watchdog_is_on_under_nccl_and_switchable(monkeypatch, switch, backend, on):
    from common.distributed import watchdog_enabled

    if switch is None:
        monkeypatch.delenv("KILN_WATCHDOG", raising=False)
    else:
        monkeypatch.setenv("KILN_WATCHDOG", switch)
    assert watchdog_enabled(backend) is on


def test_bad_watchdog_switch_is_one_line(tmp_path):
    import os
    import subprocess
    import sys

    from tests.conftest import REPO, TRAIN

    proc = subprocess.run(
        [sys.executable, TRAIN, "recipe=dit_tiny", f"run.dir={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KILN_WATCHDOG": "yes"},
    )
    assert proc.returncode == 2 and not (tmp_path / "config.yaml").exists()
    assert proc.stderr == "kiln: error: KILN_WATCHDOG='yes': use 1 (on) or 0 (off); unset: on under NCCL only\n"


def test_copy_checked_loads_a_checkpoints_tensors_or_names_the_first_mismatch(tmp_path):
    """scripts/export.py's load of a LoRA checkpoint's tensors into the model the run's config.yaml builds: equal
    names and shapes copy in place; another name or shape is one line naming it, and the model is left as it was."""
    from common.ds_export import copy_checked
    from common.errors import UserError

    model = torch.nn.Linear(3, 2)
    params = dict(model.named_parameters())
    saved = {"weight": torch.arange(6.0).reshape(2, 3), "bias": torch.tensor([7.0, 8.0])}
    copy_checked(params, saved, tmp_path)
    assert torch.equal(model.weight, saved["weight"]) and torch.equal(model.bias, saved["bias"])
    with pytest.raises(UserError, match=r"holds weight of shape \(3, 2\); the run's config.yaml builds \(2, 3\)"):
        copy_checked(params, {**saved, "weight": torch.zeros(3, 2), "bias": torch.zeros(2)}, tmp_path)
    assert torch.equal(model.bias, saved["bias"])  # checked before anything is copied
    with pytest.raises(UserError, match="bias is in one of them only"):
        copy_checked(params, {"weight": saved["weight"]}, tmp_path)
