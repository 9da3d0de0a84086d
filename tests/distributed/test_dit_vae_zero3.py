"""A latent DiT on 2 gloo ranks: under ZeRO-3 the VAE stays whole, frozen and outside the engine on every
rank, and the losses are those of ZeRO-0 (the DiT-XL/2 layout: conditioning shared by all blocks)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import losses, run_train

pytestmark = pytest.mark.distributed
STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory, latent_dit_data):
    root = tmp_path_factory.mktemp("dit_vae_zero")
    vae, shards = latent_dit_data(16).values()  # shared with test_export_any
    out = {}
    for stage in (0, 3):
        out[stage] = root / f"zero{stage}"
        run_train(
            [
                "recipe=dit_tiny",
                "data=images",
                f"data.root={shards}",
                "data.image_size=16",
                f"diffusion.vae={vae}",
                "model.shared_conditioning=true",
                f"parallel.zero_stage={stage}",
                f"trainer.max_steps={STEPS}",
                "trainer.micro_batch_size=4",
                "data.num_workers=1",
                "trainer.eval=false",
                "checkpoint.final=false",
                "trainer.progress_bar=false",
                "trainer.log_every=1",
                "diffusion.sample_steps=2",
                "diffusion.samples_per_class=1",
                f"run.dir={out[stage]}",
            ],
            nproc=2,
            timeout=600,
        )
    return out


def test_zero3_losses_match_zero0(runs):
    reference, zero3 = losses(runs[0]), losses(runs[3])
    assert sorted(reference) == sorted(zero3) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert zero3[step] == pytest.approx(loss, rel=1e-5), step


def test_vae_is_not_partitioned(runs):
    for stage, run in runs.items():
        info = json.loads((run / "memory.json").read_text())
        assert info["world_size"] == 2 and info["zero_stage"] == stage
        assert info["vae"]["params"] > 0
        assert not info["vae"]["zero_partitioned"] and not info["vae"]["requires_grad"]
        assert not info["vae"]["in_engine_module"]
    # DeepSpeed's own count of what it manages is the DiT alone, the same at both stages.
    counts = {s: json.loads((run / "memory.json").read_text())["num_params"] for s, run in runs.items()}
    assert counts[0] == counts[3]
    assert (runs[3] / "export" / "vae" / "config.json").exists()
