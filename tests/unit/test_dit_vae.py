"""DiT model pieces: the VAE folder's geometry and its bad inputs, DiT-XL/2's size, the paper's shared
conditioning, and selective activation checkpointing (bytes kept vs common/memory.py, exact gradients)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from diffusers import DiTTransformer2DModel
from diffusers.models.attention import BasicTransformerBlock

from common.activations import kept_for_backward
from common.diffusion.vae import vae_geometry
from common.errors import ConfigError
from common.memory import layer_activation_bytes
from common.toggles import apply_ac
from data.tiny_bases import make_vae
from recipes.dit.config import DiTModelConfig
from recipes.dit.model import build_model, shared_conditioning, untied
from recipes.dit.sizing import memory_spec
from scripts.kiln.launch import compose, dry_run
from tests.conftest import TRAIN
from tests.support.launcher import run_python


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    return make_vae(tmp_path_factory.mktemp("vae") / "sd-vae-ft-mse", block_out_channels=(16, 32))  # downsamples by 2


@pytest.fixture(scope="module")
def not_a_vae(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dit") / "transformer"
    build_model(DiTModelConfig(num_layers=1), 8).save_pretrained(folder)
    return folder


def test_geometry_follows_the_vae_config(vae_dir):
    g = vae_geometry(vae_dir, 32)
    assert (g.latent_channels, g.downsample, g.latent_size, g.image_channels) == (4, 2, 16, 3)
    assert g.scaling_factor == pytest.approx(0.18215) and g.shift_factor == 0.0
    cfg = compose(["recipe=dit_tiny", "data=images", f"diffusion.vae={vae_dir}", "data.image_size=32"])
    spec = memory_spec(cfg)
    assert spec.seq == (16 // cfg.model.patch_size) ** 2
    assert json.loads((vae_dir / "config.json").read_text())["_class_name"] == "AutoencoderKL"


def test_shift_factor_is_read(tmp_path):
    g = vae_geometry(make_vae(tmp_path / "flux_like", shift_factor=0.1159), 16)
    assert g.shift_factor == pytest.approx(0.1159)
    mean, std, eps = torch.randn(2, 4, 8, 8), torch.rand(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    from common.diffusion.vae import to_latents

    torch.testing.assert_close(to_latents(mean, std, eps, g), (mean + std * eps - 0.1159) * g.scaling_factor)


@pytest.mark.parametrize(
    "override, needle",
    [
        (
            "diffusion.vae={not_a_vae}",
            "is not a diffusers AutoencoderKL folder (its config.json describes a DiTTransformer2DModel)",
        ),
        ("diffusion.vae={empty}", "is not a diffusers AutoencoderKL folder (no readable config.json)"),
        ("diffusion.vae={vae} data.image_size=31", "data.image_size=31: the VAE in diffusion.vae="),
        (
            "diffusion.vae={vae} data.image_size=18",
            "the latent size 9 (data.image_size=18 through diffusion.vae) must be a multiple",
        ),
        ("data.latents=/tmp/somewhere", "data.latents=/tmp/somewhere needs diffusion.vae"),
        ("diffusion.objective=score", "diffusion.objective='score' is not allowed"),
        (
            "diffusion.objective=flow diffusion.flow_timesteps=normal",
            "diffusion.flow_timesteps='normal' is not allowed",
        ),
    ],
)
def test_bad_latent_config_is_one_config_error(override, needle, vae_dir, not_a_vae, tmp_path):
    (tmp_path / "empty").mkdir()
    override = override.format(vae=vae_dir, not_a_vae=not_a_vae, empty=tmp_path / "empty")
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        compose(["recipe=dit_tiny", "data=images", *override.split()])


@pytest.mark.parametrize(
    "what, needle",
    [
        ("not_a_vae", "is not a diffusers AutoencoderKL folder"),
        ("image_size", "data.image_size=33: the VAE in diffusion.vae="),
        ("empty_images", "no dataset there"),
    ],
)
def test_cli_bad_inputs_print_one_line(what, needle, vae_dir, not_a_vae, tmp_path):
    """scripts/train.py: a folder that is not a VAE, an image size the VAE cannot downsample evenly
    (both refused before anything is written), an image folder with no dataset in it: one
    `kiln: error:` line, exit 2."""
    (tmp_path / "empty").mkdir()
    args = {
        "not_a_vae": [f"diffusion.vae={not_a_vae}"],
        "image_size": [f"diffusion.vae={vae_dir}", "data.image_size=33"],
        "empty_images": [f"diffusion.vae={vae_dir}", f"data.root={tmp_path / 'empty'}", "data.image_size=32"],
    }
    run_dir = tmp_path / "run"
    proc = run_python([sys.executable, TRAIN, "recipe=dit_tiny", "data=images", *args[what], f"run.dir={run_dir}"])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("kiln: error: ") and needle in lines[0]
    assert what == "empty_images" or not run_dir.exists()


def test_dit_xl2_is_the_papers_size(capsys):
    """DiT-XL/2 (Peebles & Xie 2023): 675M parameters; 4x32x32 latents of 256x256 images, 256 tokens.
    Sized without the VAE folder (SD's latent shape assumed)."""
    cfg = compose(["recipe=dit_xl2", "diffusion.vae=/nonexistent/sd-vae-ft-mse", "parallel.dp=8"])
    spec = memory_spec(cfg)
    dry_run(cfg, spec, world_size=1)
    out = capsys.readouterr().out
    assert "recipe dit_xl2: 674,816,272 parameters (0.67B)" in out and "micro batch 32 x 256 tokens" in out
    assert spec.layers == 28 and spec.block.hidden == 1152 and spec.block.heads == 16
    assert "selective" in spec.ac_modes


def test_shared_conditioning_is_one_embedding_and_exports_untied(tmp_path):
    cfg = DiTModelConfig(num_layers=3, num_attention_heads=2, attention_head_dim=16, norm_num_groups=8, num_classes=5)
    torch.manual_seed(0)
    plain = build_model(cfg, 8, 4)
    torch.manual_seed(0)
    tied = build_model(DiTModelConfig(**{**cfg.__dict__, "shared_conditioning": True}), 8, 4)
    emb = shared_conditioning(tied)
    assert emb is not None and shared_conditioning(plain) is None
    per_block = sum(p.numel() for p in emb.parameters())
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731  (parameters() counts a shared one once)
    assert n(tied) == n(plain) - 2 * per_block
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([10.0, 900.5]), torch.tensor([1, 5])
    copy = untied(tied)
    assert shared_conditioning(copy) is None
    copy.save_pretrained(tmp_path / "transformer")
    loaded = DiTTransformer2DModel.from_pretrained(tmp_path / "transformer")
    with torch.no_grad():
        ref = tied(x, timestep=t, class_labels=y).sample
        torch.testing.assert_close(loaded(x, timestep=t, class_labels=y).sample, ref, rtol=0, atol=0)


def test_selective_ac_keeps_what_the_memory_model_says_and_recomputes_exactly():
    """dit_tiny at its micro batch: common/toggles.py's selective policy (the DiT's, recompute_widening)
    keeps common/memory.py's save_narrow_matmuls tensors, under half of no AC, and its gradients are
    those of no AC."""
    cfg = compose(["recipe=dit_tiny"])
    spec = memory_spec(cfg)
    b, size = cfg.trainer.micro_batch_size, cfg.data.image_size
    g = torch.Generator().manual_seed(0)
    x, t, y = (
        torch.randn(b, 1, size, size, generator=g),
        torch.randint(0, 1000, (b,), generator=g),
        torch.arange(b) % 11,
    )
    kept, grads = {}, {}
    for mode in ("none", "selective"):
        torch.manual_seed(0)
        model = build_model(cfg.model, size)
        if mode != "none":
            apply_ac(model, mode, (BasicTransformerBlock,), recompute_widening=True)
        kept[mode], loss = kept_for_backward(
            lambda: model(x, timestep=t, class_labels=y).sample.square().mean(),
            [*model.parameters(), *model.buffers(), x, t, y],
        )
        loss.backward()
        grads[mode] = [p.grad for p in model.parameters()]
    shape = dict(seq=spec.seq, batch=b, act_bytes=4)
    for mode in ("none", "selective"):
        predicted = spec.layers * layer_activation_bytes(spec.block, recompute=mode, **shape)
        print(f"dit_tiny AC={mode}: kept {kept[mode]:,} B, common/memory.py (blocks) {predicted:,.0f} B")
        # What is not modelled lies outside the blocks: patch embedding, output head, loss (<= 15%).
        assert predicted <= kept[mode] <= 1.15 * predicted
    assert kept["selective"] < 0.5 * kept["none"]
    for a, b_ in zip(grads["selective"], grads["none"]):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-7)
