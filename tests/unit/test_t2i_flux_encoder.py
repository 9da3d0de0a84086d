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
