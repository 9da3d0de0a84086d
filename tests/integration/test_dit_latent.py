"""Latent DiT end to end on CPU with a random VAE: an ImageFolder -> data.prepare_images -> data.cache_latents ->
training on cached and on-the-fly latents (equal losses) -> an export that diffusers' DiTPipeline loads and
samples, a flow-matching run sampled by scripts/sample_dit.py, and ONNX parity for both objectives."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from common.data.dataset import read_meta
from common.diffusion.sampling import sample_images
from common.diffusion.vae import folder_decoder
from data import cache_latents
from tests.conftest import load_script, losses, run_train

pytestmark = pytest.mark.integration
SIZE = 32  # images; the fixture VAE halves them: 4 x 16 x 16 latents
STEPS = 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory, latent_dit_data):
    root = tmp_path_factory.mktemp("dit_latent")
    vae, shards = latent_dit_data(SIZE).values()  # shared with test_dit_lora
    latents = root / "latents"
    common = [
        "recipe=dit_tiny",
        "data=images",
        f"data.root={shards}",
        f"data.image_size={SIZE}",
        f"diffusion.vae={vae}",
        "trainer.micro_batch_size=8",
        "data.num_workers=1",
        "trainer.progress_bar=false",
        "trainer.log_every=1",
        "diffusion.sample_steps=2",
        "diffusion.samples_per_class=1",
        "diffusion.eval_samples_per_class=2",
    ]
    assert cache_latents.main([*common, "--out", str(latents), "--batch-size", "16"]) == 0
    runs = {"fly": root / "fly", "cached": root / "cached", "flow": root / "flow"}
    run_train([*common, f"run.dir={runs['fly']}", f"trainer.max_steps={STEPS}"])
    run_train(
        [
            *common,
            f"run.dir={runs['cached']}",
            f"trainer.max_steps={STEPS}",
            f"data.latents={latents}",
            "trainer.eval=false",
        ]
    )
    run_train(
        [
            *common,
            f"run.dir={runs['flow']}",
            "trainer.max_steps=2",
            f"data.latents={latents}",
            "trainer.eval=false",
            "diffusion.objective=flow",
            "model.shared_conditioning=true",
        ]
    )
    return {"root": root, "vae": vae, "shards": shards, "latents": latents, "common": common, **runs}


def test_cache_mirrors_the_image_shards(setup):
    images, cache = read_meta(setup["shards"]), read_meta(setup["latents"])
    assert cache["source"] == "latents" and (cache["latent_channels"], cache["latent_size"]) == (4, SIZE // 2)
    for split in ("train", "val"):
        assert cache["splits"][split]["shards"] == images["splits"][split]["shards"]
        assert cache["splits"][split]["shard_samples"] == images["splits"][split]["shard_samples"]
    assert cache["corrupt_shards"] == {}


def test_cached_and_on_the_fly_latents_give_equal_losses(setup):
    fly, cached = losses(setup["fly"]), losses(setup["cached"])
    assert sorted(fly) == sorted(cached) == list(range(1, STEPS + 1))
    for step in fly:
        assert cached[step] == pytest.approx(fly[step], rel=1e-6), step


def test_vae_stays_outside_the_engine(setup):
    info = json.loads((setup["fly"] / "memory.json").read_text())
    assert info["vae"] == {
        "params": info["vae"]["params"],
        "zero_partitioned": False,
        "requires_grad": False,
        "in_engine_module": False,
    }
    transformer = json.loads((setup["fly"] / "export" / "transformer" / "config.json").read_text())
    assert transformer["in_channels"] == transformer["out_channels"] == 4 and transformer["sample_size"] == SIZE // 2


def test_export_runs_in_diffusers_dit_pipeline(setup):
    """DiTPipeline loads the export and samples images of the data's size; with the same seed its
    images are those of Kiln's own sampler (DDIM, the export's VAE decode)."""
    from diffusers import DiTPipeline

    export = setup["fly"] / "export"
    info = json.loads((export / "kiln.json").read_text())
    assert info["diffusers_pipeline"] == "DiTPipeline" and info["classes"] == ["digit_0", "digit_1", "digit_2"]
    pipe = DiTPipeline.from_pretrained(export)
    assert pipe.get_label_ids(["digit_2"]) == [2]
    out = pipe(
        class_labels=[0, 1],
        guidance_scale=1.0,
        num_inference_steps=2,
        output_type="np",
        generator=torch.Generator().manual_seed(7),
    ).images
    assert out.shape == (2, SIZE, SIZE, 3)
    scheduler = json.loads((export / "scheduler" / "scheduler_config.json").read_text())
    ours = sample_images(
        pipe.transformer,
        scheduler,
        torch.tensor([0, 1]),
        null_class=info["null_class"],
        image_size=SIZE // 2,
        in_channels=4,
        steps=2,
        guidance_scale=1.0,
        generator=torch.Generator().manual_seed(7),
        device=torch.device("cpu"),
        decode=folder_decoder(export / "vae", SIZE, torch.device("cpu")),
    )
    np.testing.assert_allclose(out, (ours.permute(0, 2, 3, 1).numpy() + 1) / 2, atol=1e-4)


def test_flow_export_samples_with_sample_dit(setup, tmp_path, capsys):
    export = setup["flow"] / "export"
    info = json.loads((export / "kiln.json").read_text())
    assert info["objective"] == "flow" and info["diffusers_pipeline"] is None
    assert not (export / "model_index.json").exists()
    assert (
        json.loads((export / "scheduler" / "scheduler_config.json").read_text())["_class_name"]
        == "FlowMatchEulerDiscreteScheduler"
    )
    out = tmp_path / "grid.png"
    assert load_script("sample_dit").main([str(export), "steps=2", "per_class=2", f"out={out}"]) == 0
    from PIL import Image

    grid = Image.open(out)
    assert grid.mode == "RGB" and grid.size == (2 * (SIZE * 4 + 1) + 1, 3 * (SIZE * 4 + 1) + 1)


@pytest.mark.parametrize("run", ["fly", "flow"])
def test_onnx_parity_for_latent_models(setup, run, capsys):
    """The ONNX graph is the latent transformer; onnxruntime must match PyTorch on fresh inputs
    (fractional timesteps: flow's), and the whole sampler agrees with the VAE decode in PyTorch."""
    export = setup[run] / "export"
    assert load_script("export_dit").main([str(export), "--max-batch", "8"]) == 0
    onnx = json.loads((export / "onnx" / "onnx.json").read_text())
    assert onnx["image_size"] == SIZE // 2 and onnx["in_channels"] == 4
    assert all(e <= 1e-5 for e in onnx["parity_rel_err"].values()), onnx["parity_rel_err"]
    capsys.readouterr()
    assert (
        load_script("sample_dit").main(
            [
                str(export),
                "backend=onnxruntime",
                "compare=torch",
                "steps=2",
                "per_class=1",
                f"out={setup['root'] / f'grid_{run}.png'}",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["max_abs_pixel_diff"] <= 2


def test_cache_counts_a_corrupt_shard(setup, tmp_path):
    shards = tmp_path / "shards"
    shutil.copytree(setup["shards"], shards)
    first = shards / read_meta(shards)["splits"]["train"]["shards"][0]
    first.write_bytes(first.read_bytes()[: first.stat().st_size // 3])  # truncated mid-shard
    meta = json.loads((shards / "meta.json").read_text())
    meta["splits"]["train"]["shard_bytes"][0] = first.stat().st_size  # a damaged copy, not an incomplete dataset
    (shards / "meta.json").write_text(json.dumps(meta))
    common = [a for a in setup["common"] if not a.startswith("data.root=")]
    assert cache_latents.main([*common, f"data.root={shards}", "--out", str(tmp_path / "latents")]) == 0
    cache = read_meta(tmp_path / "latents")
    assert list(cache["corrupt_shards"]) == [first.name]
    assert 0 < cache["splits"]["train"]["shard_samples"][0] < meta["splits"]["train"]["shard_samples"][0]


def test_cache_refuses_shards_its_builder_did_not_build(setup, tmp_path, capsys):
    """data.build runs on every start, as training runs it: shards built with other settings (another split seed)
    stop the cache with the builder's one line, rather than being cached as if they were the recipe's."""
    from common.data.dataset import run_builder

    root = tmp_path / "digits"
    run_builder(["data.prepare_digits", "--seed", "1"], root)
    common = [a for a in setup["common"] if not a.startswith(("data=", "data.root="))]
    argv = [*common, "data=digits", f"data.root={root}", "--out", str(tmp_path / "latents")]
    assert cache_latents.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds" in err and "--force" in err, err
    assert not (tmp_path / "latents").exists()
