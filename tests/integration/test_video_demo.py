"""The video demo of docs/video.md, its three commands as the docs give them (paths under the test's folder): the
pretrained tiny Wan base (data/tiny_bases.py make_wan_pipeline, pretrained=True: its VAE and UMT5 text encoder
pretrained on the moving digits, cached under data/cache/tiny_bases), the latent cache, then video_tiny's 3,000 steps
of 32 clips on it. The eval samples clips for prompts in phrasings no training caption uses and reads their digit and
direction (recipes/video/evaluate.py).

The docs' figures: digit 0.967, direction 1.000 (targets 0.8 / 0.8; chance 0.10 / 0.25), the real held-out clips
0.930 / 1.000; the run took 9 minutes on a 2-core machine at load 1-2, the base's pretraining 5 more once. More than
CI's budget holds, so `make test` leaves it out (pyproject.toml: -m 'not slow'); `pytest -m slow
tests/integration/test_video_demo.py` runs it."""

from __future__ import annotations

import json

import pytest

from tests.support.launcher import python_ok, run_train

pytestmark = pytest.mark.slow


def test_video_demo_draws_the_prompted_digit_moving_the_prompted_way(tmp_path):
    base, shards, latents, run = (tmp_path / name for name in ("tiny-wan", "moving_digits", "latents", "run"))
    python_ok("-c", f"from data.tiny_bases import make_wan_pipeline; make_wan_pipeline({str(base)!r}, pretrained=True)")
    at = ["recipe=video_tiny", f"model.init_from={base}", f"data.root={shards}"]
    python_ok("-m", "data.cache_latents", *at, "--out", str(latents), timeout=900)
    run_train([*at, f"data.latents={latents}", "trainer.progress_bar=false", f"run.dir={run}"], timeout=3600)
    result = json.loads((run / "eval.json").read_text())
    assert result["prompts_seen_in_training"] == 0 and result["step"] == 3000
    print(
        f"video demo, held-out phrasings: digit {result['digit_accuracy']:.3f}, direction "
        f"{result['direction_accuracy']:.3f}; real held-out clips: digit {result['real_val_digit_accuracy']:.3f}, "
        f"direction {result['real_val_direction_accuracy']:.3f}"
    )
    # Measured 0.967 and 1.000 in two runs (the docs' commands by hand, then this test: 587 s); the scorer on the
    # real held-out clips 0.930 and 1.000.
    assert result["digit_accuracy"] >= 0.9 and result["direction_accuracy"] >= 0.9, result
    assert result["real_val_digit_accuracy"] >= 0.9 and result["real_val_direction_accuracy"] >= 0.9, result
