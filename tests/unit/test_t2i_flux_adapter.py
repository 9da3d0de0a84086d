"""The text-to-image recipe on a FluxPipeline folder, against diffusers' FluxPipeline itself: the prompt encoder
gives encode_prompt's conditioning, and what the recipe does not size or adapt for Flux yet is refused with one
line."""

from __future__ import annotations

import pytest
import torch

from common.errors import ConfigError
from common.launch import compose


def test_the_flux_prompt_encoder_is_flux_pipelines_encode_prompt(t2i_flux_world):
    from diffusers import FluxPipeline

    from recipes.t2i.pipeline import FluxPromptEncoder, adapter

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


def test_what_flux_is_not_sized_or_adapted_for_is_one_line(t2i_flux_world):
    from recipes.t2i.sizing import memory_spec

    folder = t2i_flux_world["pipeline"]
    with pytest.raises(ConfigError, match="trains LoRA on StableDiffusion3Pipeline folders only"):
        compose(["recipe=t2i_tiny", f"model.init_from={folder}", "finetune=lora"])
    cfg = compose(["recipe=t2i_tiny", f"model.init_from={folder}", "run.dry_run=true"])
    with pytest.raises(ConfigError, match="size StableDiffusion3Pipeline runs only"):
        memory_spec(cfg)
    # Flux packs 2x2 latents: 16 px images on its VAE's 1/2 are 4x4 tokens; 14 px are refused.
    with pytest.raises(ConfigError, match="must be a multiple of 4"):
        compose(["recipe=t2i_tiny", f"model.init_from={folder}", "data.image_size=14"])


def test_a_schnell_shaped_flux_samples_like_flux_pipeline(tmp_path):
    """FLUX.1-schnell's shape (no guidance embedding, a fixed shift): Kiln's sampler on the base folder draws what
    FluxPipeline draws (measured: 0.0 of 255), and the guidance scale changes nothing, as in diffusers."""
    import numpy as np
    from diffusers import FluxPipeline

    from common.tools.fixtures import make_flux_pipeline
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
