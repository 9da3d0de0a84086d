"""The text-to-image recipe in the memory model (recipes/t2i/sizing.py): activations against the bytes the real SD3
transformer keeps for backward, the frozen models beside the engine against what the trainer loads, and the
sd35_medium preset sized without its folder against diffusers' own SD3Transformer2DModel."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from common.launch import compose
from common.memory import Layout, estimate, layer_activation_bytes
from common.tools.activations import kept_for_backward
from recipes.t2i.sizing import memory_spec
from tests.fixtures.t2i import IMAGE_SIZE


def tiny_cfg(pipeline, *extra):
    return compose(["recipe=t2i_tiny", f"model.init_from={pipeline}", "run.dry_run=true", *extra])


@pytest.fixture(scope="module")
def sd35_shaped(t2i_world, tmp_path_factory):
    """The t2i_world pipeline with SD3.5's transformer changes (QK RMSNorm, dual attention in its first layer of 2):
    only config.json is read for sizing."""
    folder = tmp_path_factory.mktemp("sd35") / "sd3"
    shutil.copytree(t2i_world["pipeline"], folder)
    path = folder / "transformer" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "qk_norm": "rms_norm", "dual_attention_layers": [0]}))
    return folder


@pytest.mark.parametrize("shape", ["sd3", "sd35"])
@pytest.mark.parametrize("ac", ["none", "selective"])
def test_t2i_activations_match_saved_tensors(t2i_world, sd35_shaped, shape, ac):
    """One fp32 forward of the pipeline's SD3Transformer2DModel at the recipe's micro batch, image tokens + CLIP +
    T5 tokens in joint attention, with recipes/t2i/parallelize.py's AC: what the memory model says the layers keep.
    Not modelled: the CPU kernel's attention output copied by its reshape (flash on GPU writes it in place), the
    timestep/pooled embeddings (b x h), and outside the layers the patch embedding and the final norm and projection
    (~3 h per image token: what full AC keeps besides the layer inputs, measured 1.6x of them on this 2-layer model,
    ~12% of sd35_medium's 24 layer inputs; full AC is not compared here for that reason)."""
    from diffusers import SD3Transformer2DModel
    from diffusers.models.attention import JointTransformerBlock

    from common.toggles import apply_ac

    folder = t2i_world["pipeline"] if shape == "sd3" else sd35_shaped
    cfg = tiny_cfg(folder, f"toggles.activation_checkpointing={ac}")
    spec = memory_spec(cfg)
    config = json.loads((folder / "transformer" / "config.json").read_text())
    torch.manual_seed(0)
    model = SD3Transformer2DModel.from_config(config)
    if ac != "none":
        apply_ac(model, ac, (JointTransformerBlock,), recompute_widening=True)
    b, latent = cfg.trainer.micro_batch_size, config["sample_size"]
    text = spec.seq - (latent // config["patch_size"]) ** 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, config["in_channels"], latent, latent, generator=g)
    context = torch.randn(b, text, config["joint_attention_dim"], generator=g)
    pooled = torch.randn(b, config["pooled_projection_dim"], generator=g)
    t = torch.rand(b, generator=g) * 1000
    measured, out = kept_for_backward(
        lambda: model(x, encoder_hidden_states=context, pooled_projections=pooled, timestep=t).sample,
        [*model.parameters(), *model.buffers(), x, context, pooled, t],
    )
    predicted = spec.layers * layer_activation_bytes(spec.block, seq=spec.seq, batch=b, act_bytes=4, recompute=ac)
    print(
        f"t2i {shape} AC={ac}: predicted {predicted:,.0f} B, measured {measured:,.0f} B, "
        f"ratio {predicted / measured:.3f}"
    )
    assert predicted == pytest.approx(measured, rel=0.15)
    del out


def test_frozen_models_beside_the_engine_are_what_the_trainer_loads(t2i_world):
    """The bytes held whole on every GPU are those of the trainer's own PromptEncoder (text encoders in the compute
    dtype) and VAE (fp32), plus the transformer's buffers, loaded from the pipeline folder; ZeRO-3 shards none of it."""
    from common.diffusion import vae as vae_lib
    from recipes.t2i.pipeline import SD3PromptEncoder, load_transformer

    folder = t2i_world["pipeline"]
    cfg = tiny_cfg(folder)
    spec = memory_spec(cfg)
    encode = SD3PromptEncoder(
        folder, device="cpu", dtype=torch.float32, max_sequence_length=cfg.model.max_sequence_length
    )
    vae = vae_lib.load_vae(vae_lib.vae_geometry(folder / "vae", IMAGE_SIZE), "cpu")
    encoders = [m for _, m in encode.clip] + [encode.t5[1]]
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    loaded = sum(nbytes(m.parameters()) for m in [*encoders, vae]) + nbytes(load_transformer(folder).buffers())
    assert spec.unsharded_bytes == loaded
    zero3 = estimate(spec, Layout(dp=4, tp=1, pp=1, zero_stage=3, ac="full"))
    bare = estimate(spec.__class__(**{**spec.__dict__, "unsharded_bytes": 0}), Layout(4, 1, 1, 3, "full"))
    assert zero3["weights"] - bare["weights"] == loaded


def test_sd35_medium_is_the_release_sized_without_its_folder():
    """recipe=sd35_medium with model.init_from absent here: the transformer counted from RELEASED equals diffusers'
    SD3Transformer2DModel built on the meta device from stabilityai/stable-diffusion-3.5-medium's published config
    (written out here, independently); 1024 px through the 1/8 VAE and 2x2 patches is 4096 image tokens + 77 CLIP +
    256 T5."""
    from diffusers import SD3Transformer2DModel

    cfg = compose(
        ["recipe=sd35_medium", "run.dry_run=true", "model.init_from=/nonexistent/stable-diffusion-3.5-medium"]
    )
    spec = memory_spec(cfg)
    with torch.device("meta"):
        reference = SD3Transformer2DModel(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            num_layers=24,
            attention_head_dim=64,
            num_attention_heads=24,
            joint_attention_dim=4096,
            caption_projection_dim=1536,
            pooled_projection_dim=2048,
            out_channels=16,
            pos_embed_max_size=384,
            dual_attention_layers=tuple(range(13)),
            qk_norm="rms_norm",
        )
    assert spec.total_params == sum(p.numel() for p in reference.parameters()) == 2_243_171_520
    assert spec.seq == 4096 + 77 + 256 and spec.micro_batch == cfg.trainer.micro_batch_size
    assert spec.block.qk_norm and spec.block.attention2 == pytest.approx(13 / 24 * 4096 / spec.seq)
    assert "a run on a data.latents cache loads them only for its eval" in spec.note and "T5-XXL 4.76B" in spec.note


def test_an_unknown_missing_pipeline_is_one_line_when_sizing():
    from common.errors import ConfigError

    cfg = compose(["recipe=sd35_medium", "run.dry_run=true", "model.init_from=/nonexistent/my-sd"])
    with pytest.raises(ConfigError, match="no pipeline folder there to size from.*stable-diffusion-3.5-medium"):
        memory_spec(cfg)
