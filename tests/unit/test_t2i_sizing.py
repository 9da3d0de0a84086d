"""The text-to-image recipe in the memory model (recipes/t2i/sizing.py): activations against the bytes the real SD3
transformer keeps for backward, the frozen models beside the engine against what the trainer loads, and the
sd35_medium preset sized without its folder against diffusers' own SD3Transformer2DModel."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from common.activations import kept_for_backward
from common.memory import Layout, estimate, layer_activation_bytes
from recipes.t2i.sizing import memory_spec
from scripts.kiln.launch import compose
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


@pytest.fixture(scope="module")
def flux_shaped(t2i_flux_world, tmp_path_factory):
    """The tiny FLUX.1-dev-shaped pipeline with FLUX.1-dev's 1:2 ratio of dual- to single-stream blocks (2 + 4, not
    1 + 1: what sits outside the blocks, the packed latents' embedding and the final norm and projection, is then a
    smaller share, as in the release's 57 blocks): only config.json is read for sizing."""
    folder = tmp_path_factory.mktemp("flux") / "flux"
    shutil.copytree(t2i_flux_world["pipeline"], folder)
    path = folder / "transformer" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "num_layers": 2, "num_single_layers": 4}))
    return folder


def sd3_forward(folder, spec, b: int):
    """The SD3 transformer of `folder`, its AC block types, and a forward on random inputs of the spec's tokens."""
    from diffusers import SD3Transformer2DModel
    from diffusers.models.attention import JointTransformerBlock

    config = json.loads((folder / "transformer" / "config.json").read_text())
    torch.manual_seed(0)
    model = SD3Transformer2DModel.from_config(config)
    latent = config["sample_size"]
    text = spec.seq - (latent // config["patch_size"]) ** 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, config["in_channels"], latent, latent, generator=g)
    context = torch.randn(b, text, config["joint_attention_dim"], generator=g)
    pooled = torch.randn(b, config["pooled_projection_dim"], generator=g)
    t = torch.rand(b, generator=g) * 1000
    run = lambda: model(x, encoder_hidden_states=context, pooled_projections=pooled, timestep=t).sample  # noqa: E731
    return model, (JointTransformerBlock,), run, [x, context, pooled, t]


def flux_forward(folder, spec, b: int):
    """The Flux transformer of `folder`, its two AC block types, and the recipe's own call (recipes/t2i/weights.py
    Flux.forward: 2x2 packing, RoPE ids, the guidance input) on random latents and prompt embeddings."""
    from diffusers import FluxTransformer2DModel
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock

    from recipes.t2i.weights import adapter, vae_factor

    config = json.loads((folder / "transformer" / "config.json").read_text())
    torch.manual_seed(0)
    model = FluxTransformer2DModel.from_config(config)
    latent = IMAGE_SIZE // vae_factor(folder)
    text = spec.seq - (latent // 2) ** 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, config["in_channels"] // 4, latent, latent, generator=g)
    prompt = {
        "encoder_hidden_states": torch.randn(b, text, config["joint_attention_dim"], generator=g),
        "pooled_projections": torch.randn(b, config["pooled_projection_dim"], generator=g),
    }
    t, guidance = torch.rand(b, generator=g) * 1000, torch.full((b,), 3.5)
    run = lambda: adapter(folder).forward(model, x, t, prompt, guidance)  # noqa: E731
    return model, (FluxTransformerBlock, FluxSingleTransformerBlock), run, [x, *prompt.values(), t, guidance]


@pytest.mark.parametrize("shape", ["sd3", "sd35", "flux"])
@pytest.mark.parametrize("ac", ["none", "selective"])
def test_t2i_activations_match_saved_tensors(t2i_world, flux_shaped, sd35_shaped, shape, ac):
    """One fp32 forward of the pipeline's transformer at the recipe's micro batch, image tokens + text tokens in joint
    attention (SD3: CLIP + T5; Flux: T5, its 2 dual- and 4 single-stream blocks), with recipes/t2i/parallelize.py's AC:
    what the memory model says the layers keep, summed over the layer types.
    Not modelled: the CPU kernel's attention output copied by its reshape (flash on GPU writes it in place), the
    timestep/pooled embeddings (b x h), and outside the layers the patch embedding and the final norm and projection
    (~3 h per image token: what full AC keeps besides the layer inputs, measured 1.6x of them on this 2-layer model,
    ~12% of sd35_medium's 24 layer inputs; full AC is not compared here for that reason)."""
    from common.toggles import apply_ac

    folder = {"sd3": t2i_world["pipeline"], "sd35": sd35_shaped, "flux": flux_shaped}[shape]
    cfg = tiny_cfg(folder, f"toggles.activation_checkpointing={ac}")
    spec = memory_spec(cfg)
    b = cfg.trainer.micro_batch_size
    model, blocks, run, inputs = (flux_forward if shape == "flux" else sd3_forward)(folder, spec, b)
    if ac != "none":
        apply_ac(model, ac, blocks, recompute_widening=True)
    measured, out = kept_for_backward(run, [*model.parameters(), *model.buffers(), *inputs])
    predicted = sum(
        ty.layers * layer_activation_bytes(ty.block, seq=spec.seq, batch=b, act_bytes=4, recompute=ac)
        for ty in spec.layer_types
    )
    print(
        f"t2i {shape} AC={ac}: predicted {predicted:,.0f} B, measured {measured:,.0f} B, "
        f"ratio {predicted / measured:.3f}"
    )
    assert len(spec.layer_types) == (2 if shape == "flux" else 1)
    assert predicted == pytest.approx(measured, rel=0.15)
    del out


def test_frozen_models_beside_the_engine_are_what_the_trainer_loads(t2i_world):
    """The bytes held whole on every GPU are those of the trainer's own PromptEncoder (text encoders in the compute
    dtype) and VAE (fp32), plus the transformer's buffers, loaded from the pipeline folder; ZeRO-3 shards none of it."""
    from common.diffusion import vae as vae_lib
    from recipes.t2i.weights import SD3PromptEncoder, load_transformer

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
    assert "they encode every batch on the fly" in spec.note and "T5-XXL 4.76B" in spec.note


def test_flux_dev_is_the_release_sized_without_its_folder():
    """recipe=flux_dev without its folder: the dual- and single-stream blocks as two layer types whose parameters add
    up to diffusers' FluxTransformer2DModel built on the meta device from black-forest-labs/FLUX.1-dev's published
    config (written out here); 1024 px through the 1/8 VAE and the 2x2 packing is 4096 image tokens, + 512 T5 (no
    CLIP tokens: Flux takes CLIP-L's pooled vector)."""
    from diffusers import FluxTransformer2DModel

    cfg = compose(["recipe=flux_dev", "run.dry_run=true", "model.init_from=/nonexistent/FLUX.1-dev"])
    spec = memory_spec(cfg)
    with torch.device("meta"):
        reference = FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=19,
            num_single_layers=38,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        )
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert spec.total_params == n(reference) == 11_901_408_320
    dual, single = spec.layer_types
    assert (dual.layers, dual.params) == (19, n(reference.transformer_blocks[0]))
    assert (single.layers, single.params) == (38, n(reference.single_transformer_blocks[0]))
    assert single.block.parallel and not dual.block.parallel and single.block.ffn == 4 * 3072
    assert spec.seq == 4096 + 512 and "CLIP-L 0.12B, T5-XXL 4.76B" in spec.note


def test_flux_dev_lora_trains_the_adapters_only():
    """finetune=lora on flux_dev: the trained parameters are rank x (in + out) per adapted linear (the 8 joint
    attention projections of each dual-stream block, to_q/to_k/to_v of each single-stream one, all 3072 wide), the
    base is frozen weights; at ZeRO-0 the optimizer column is DeepSpeed's 16 B + the EMA's 4 B per adapter weight."""
    cfg = compose(["recipe=flux_dev", "run.dry_run=true", "finetune=lora"])
    spec = memory_spec(cfg)
    r = cfg.lora.rank
    adapter = 19 * 8 * r * (3072 + 3072) + 38 * 3 * r * (3072 + 3072)
    trained = sum(ty.layers * ty.params for ty in spec.layer_types) + spec.first_params
    assert trained == adapter == 13_074_432 and spec.frozen_params == 11_901_408_320
    zero0 = estimate(spec, Layout(dp=1, tp=1, pp=1, zero_stage=0, ac="full"))
    assert zero0["optimizer"] == (16 + 4) * adapter and zero0["grads"] == 2 * adapter


@pytest.mark.parametrize("evaluate", [True, False])
def test_a_cached_run_holds_what_the_trainer_loads_on_a_cache(t2i_world, evaluate):
    """data.latents: beside the engine only the VAE (its encoder dropped unless trainer.eval, as recipes/t2i/train.py
    does) and the transformer's buffers, as loaded from the pipeline folder; no text encoder. The cache is not read."""
    from common.diffusion import vae as vae_lib
    from recipes.t2i.weights import load_transformer

    folder = t2i_world["pipeline"]
    spec = memory_spec(tiny_cfg(folder, "data.latents=/nonexistent/cache", f"trainer.eval={str(evaluate).lower()}"))
    vae = vae_lib.load_vae(vae_lib.vae_geometry(folder / "vae", IMAGE_SIZE), "cpu")
    if not evaluate:
        vae.encoder = vae.quant_conv = None
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    assert spec.unsharded_bytes == nbytes(vae.parameters()) + nbytes(load_transformer(folder).buffers())
    assert "training holds no text encoder" in spec.note and "loads the text encoders" in spec.note


def test_an_unknown_missing_pipeline_is_one_line_when_sizing(capsys):
    from common.errors import ConfigError
    from tests.conftest import load_script

    plan = load_script("plan")

    cfg = compose(["recipe=sd35_medium", "run.dry_run=true", "model.init_from=/nonexistent/my-sd"])
    with pytest.raises(ConfigError, match="no pipeline folder there to size from.*stable-diffusion-3.5-medium"):
        memory_spec(cfg)
    assert plan.main(["recipe=flux_dev", "cluster.gpus=8", "model.init_from=/nonexistent/my-flux"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kiln: error: model.init_from=/nonexistent/my-flux: no pipeline")
