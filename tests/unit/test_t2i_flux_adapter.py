"""The text-to-image recipe on a FluxPipeline folder, against diffusers' FluxPipeline itself: the prompt encoder
gives encode_prompt's conditioning, a schnell-shaped pipeline samples as FluxPipeline does, a LoRA export loads
in FluxPipeline.load_lora_weights, and an image size Flux cannot pack is refused with one line."""

from __future__ import annotations

import pytest
import torch

from common.errors import ConfigError
from scripts.kiln.launch import compose


def test_the_flux_prompt_encoder_is_flux_pipelines_encode_prompt(t2i_flux_world):
    from diffusers import FluxPipeline

    from recipes.t2i.weights import FluxPromptEncoder, adapter

    folder = t2i_flux_world["pipeline"]
    prompts = ["a handwritten seven", "the digit 3, drawn by hand", ""]
    pipe = FluxPipeline.from_pretrained(folder)
    with torch.no_grad():  # as FluxPipeline.__call__ runs it (with grad on, SDPA takes another kernel: ~1e-6 off)
        states, pooled, text_ids = pipe.encode_prompt(prompts, prompt_2=None, max_sequence_length=24)
    encode = adapter(folder).prompt_encoder(device="cpu", dtype=torch.float32, max_sequence_length=24)
    assert isinstance(encode, FluxPromptEncoder)
    ours = encode(prompts)
    assert ours["encoder_hidden_states"].shape == (3, 24, 32) and ours["pooled_projections"].shape == (3, 16)
    assert torch.equal(ours["encoder_hidden_states"], states) and torch.equal(ours["pooled_projections"], pooled)
    assert not torch.equal(ours["pooled_projections"][0], ours["pooled_projections"][1])  # the prompts differ
    assert torch.equal(text_ids, torch.zeros(24, 3))  # what Flux.forward passes as txt_ids


def test_an_image_size_flux_cannot_pack_is_one_line(t2i_flux_world):
    folder = t2i_flux_world["pipeline"]
    # Flux packs 2x2 latents: 16 px images on its VAE's 1/2 are 4x4 tokens; 14 px are refused.
    with pytest.raises(ConfigError, match="must be a multiple of 4"):
        compose(["recipe=t2i_tiny", f"model.init_from={folder}", "data.image_size=14"])


def test_a_schnell_shaped_flux_samples_like_flux_pipeline(tmp_path):
    """FLUX.1-schnell's shape (no guidance embedding, a fixed shift): Kiln's sampler on the base folder draws what
    FluxPipeline draws (measured: 0.0 of 255), and the guidance scale changes nothing, as in diffusers."""
    import numpy as np
    from diffusers import FluxPipeline

    from data.tiny_bases import make_flux_pipeline
    from recipes.t2i.sampling import PromptSampler

    folder = make_flux_pipeline(tmp_path / "schnell", guidance_embeds=False)
    pipe = FluxPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    prompt, size, steps = "a handwritten 4", 16, 3
    theirs = pipe(
        prompt,
        height=size,
        width=size,
        num_inference_steps=steps,
        guidance_scale=0.0,
        generator=torch.Generator().manual_seed(3),
        max_sequence_length=24,
        output_type="np",
    ).images[0]
    sampler = PromptSampler.from_export(folder, image_size=size, max_sequence_length=24)
    draw = lambda seed, g: sampler([prompt], torch.Generator().manual_seed(seed), steps=steps, guidance_scale=g)[0]  # noqa: E731
    image = draw(3, 0.0)
    ours = ((image + 1) / 2).permute(1, 2, 0).numpy()
    assert theirs.shape == ours.shape and theirs.std() > 0.01
    assert np.abs(ours - theirs).max() * 255 <= 1.0
    assert torch.equal(draw(3, 5.0), image)  # no guidance embedding, no guidance pair
    assert (draw(4, 0.0) - image).abs().max() * 127.5 > 3  # the seed matters: the comparison can fail


def test_a_flux_lora_export_loads_in_flux_pipeline(t2i_flux_world, tmp_path):
    """finetune=lora on Flux: the default targets (the joint attention's linears, in both kinds of block) adapted,
    the export written as the end of a run writes it; diffusers' FluxPipeline.load_lora_weights on the base, and the
    merged folder, give the transformer output the adapted model gives (and not the base's)."""
    from diffusers import FluxPipeline

    from common.diffusion import release
    from recipes.t2i import weights
    from recipes.t2i.weights import adapter, load_transformer

    base = t2i_flux_world["pipeline"]
    cfg = compose(["recipe=t2i_tiny", f"model.init_from={base}", "finetune=lora", "export.merge_lora=true"])
    model = release.adapted_model(weights, cfg, base).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained adapter's stand-in (B starts at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    assert any(n.startswith("single_transformer_blocks.0.attn.to_q.lora_A") for n, _ in model.named_parameters())
    out = tmp_path / "export"
    out.mkdir()
    release.write_lora_export(weights, model, cfg, out, base=base, step=1)

    spec = adapter(base)
    text = spec.prompt_encoder(device="cpu", dtype=torch.float32, max_sequence_length=8)(["a 3", "the digit 5"])
    x, t = torch.randn(2, 16, 8, 8, generator=generator), torch.tensor([700.0, 200.0])
    with torch.no_grad():
        velocity = lambda transformer: spec.forward(transformer.eval(), x, t, text, torch.full((2,), 3.5))  # noqa: E731
        ours = velocity(model)
        pipe = FluxPipeline.from_pretrained(base)
        pipe.load_lora_weights(out)
        theirs = velocity(pipe.transformer)
        merged = velocity(FluxPipeline.from_pretrained(out / "merged").transformer)
        plain = velocity(load_transformer(base))
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(merged, ours, rtol=0, atol=1e-5)
    assert (plain - ours).abs().max() > 1e-2  # the adapter changes the output: the comparisons can fail
