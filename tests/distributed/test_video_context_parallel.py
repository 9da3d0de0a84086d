"""video_tiny at parallel.cp=2 (Ulysses over a clip's video tokens: the self-attention's all-to-all, the RoPE table
and the tokens split from blocks.0 to proj_out) under ZeRO-3 with activation checkpointing, on 2 gloo ranks, takes
the steps of the 1-rank run: the same losses and gradient norms (AdamW hides a gradient's scale from the losses: a
cp-fold error shows only in the norms). Its last checkpoint exports, through scripts/export.py, the end of the run's
export, every tensor bit for bit."""

from __future__ import annotations

import pytest

from tests.conftest import load_script, metrics
from tests.fixtures.lora import assert_same_export
from tests.fixtures.video import video_run_args

pytestmark = pytest.mark.distributed


def test_cp2_zero3_matches_one_rank(trained, video_world, tmp_path, capsys):
    args = video_run_args(video_world)
    one = metrics(trained(args))
    layout = ["parallel.cp=2", "parallel.zero_stage=3", "toggles.activation_checkpointing=full"]
    run = trained([*args, *layout], nproc=2)
    two = metrics(run)
    assert sorted(two) == sorted(one)
    for key in ("loss", "grad_norm"):
        worst = max(abs(two[s][key] - one[s][key]) / abs(one[s][key]) for s in one)
        print(f"video_tiny cp=2 ZeRO-3 vs one rank: max relative {key} difference over {len(one)} steps {worst:.1e}")
        assert worst <= 1e-5, key
    assert load_script("export").main([str(run), "--out", str(tmp_path / "again")]) == 0, capsys.readouterr().err
    assert_same_export(run / "export", tmp_path / "again")
