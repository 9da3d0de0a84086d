"""t2i_tiny on a tiny random FluxPipeline (FLUX.1-dev's shape: guidance-distilled, dynamic shifting): a short 1-rank
run through the same recipe as SD3's, then its export checked against an independent reference: diffusers'
FluxPipeline on the export, from the same prompt, seed, steps and guidance, draws the image Kiln's sampler draws;
and scripts/export.py from the run's checkpoint writes the end of the run's export, tensor for tensor."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from common.errors import ConfigError
from common.launch import compose
from tests.conftest import load_script, losses
from tests.fixtures.llm import compare_export
from tests.fixtures.t2i import IMAGE_SIZE, t2i_run_args

# Measured max pixel difference (0-255 scale) between FluxPipeline and Kiln's sampler on the export: 0.0 (4 and 7
# steps, guidance 1.0 and 3.5, on the base and on the trained export: the same ops in the same order on CPU). The
# bound leaves room for another BLAS's summation order, as test_t2i.py's.
MAX_PIXEL_DIFF = 1.0
STEPS = 4


def flux_run_args(world) -> list[str]:
    """t2i_run_args on the Flux pipeline, shortened: 4 steps, no eval."""
    keep = [a for a in t2i_run_args(world) if not a.startswith(("trainer.max_steps=", "diffusion.eval_samples"))]
    return [*keep, f"trainer.max_steps={STEPS}", "trainer.eval=false"]


def test_t2i_on_flux_trains_and_its_export_samples_like_kiln_in_flux_pipeline(
    trained, t2i_flux_world, tmp_path, capsys
):
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from recipes.t2i.sampling import PromptSampler

    base = t2i_flux_world["pipeline"]
    run, _ = trained.run(flux_run_args(t2i_flux_world))
    loss = losses(run)
    assert len(loss) == STEPS and all(math.isfinite(v) for v in loss.values())

    export = run / "export"
    info = json.loads((export / "kiln.json").read_text())
    assert info["diffusers_pipeline"] == "FluxPipeline" and info["step"] == STEPS
    assert info["sample_with"].startswith("FluxPipeline.from_pretrained(EXPORT)(prompt")
    theirs_base = FluxTransformer2DModel.from_pretrained(base / "transformer").state_dict()
    ours_state = FluxTransformer2DModel.from_pretrained(export / "transformer").state_dict()
    assert theirs_base.keys() == ours_state.keys()
    assert not all(torch.equal(theirs_base[k], ours_state[k]) for k in theirs_base)  # it trained
    assert (export / "text_encoder_2" / "model.safetensors").read_bytes() == (
        base / "text_encoder_2" / "model.safetensors"
    ).read_bytes()

    # Parity: diffusers' FluxPipeline on the export vs Kiln's sampler, same prompt (one it never saw), seed, steps,
    # guidance (embedded: no guidance pair), the scheduler's dynamic shift for 16 image tokens.
    prompt, guidance = "a picture of a handwritten 7", 3.5
    pipe = FluxPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(
        prompt,
        height=IMAGE_SIZE,
        width=IMAGE_SIZE,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        generator=torch.Generator().manual_seed(7),
        max_sequence_length=info["max_sequence_length"],
        output_type="np",
    ).images[0]
    sampler = PromptSampler.from_export(export, image_size=IMAGE_SIZE)
    image = sampler([prompt], torch.Generator().manual_seed(7), steps=STEPS, guidance_scale=guidance)[0]
    ours = ((image + 1) / 2).permute(1, 2, 0).numpy()
    assert theirs.shape == ours.shape == (IMAGE_SIZE, IMAGE_SIZE, 3) and theirs.std() > 0.01
    assert np.abs(ours - theirs).max() * 255 <= MAX_PIXEL_DIFF
    # The comparison can fail: another guidance value (the embedded one) draws another image (measured: 7.0 of 255).
    other = sampler([prompt], torch.Generator().manual_seed(7), steps=STEPS, guidance_scale=1.0)[0]
    assert (other - image).abs().max() * 127.5 > 3 * MAX_PIXEL_DIFF

    # scripts/export.py from the final checkpoint: the end of the run's export, tensor for tensor.
    out = tmp_path / "from_checkpoint"
    assert load_script("export").main([str(run), "--out", str(out)]) == 0, capsys.readouterr().err
    assert compare_export(export, out) == {"same_keys": True, "bitwise": True}


def test_context_parallelism_on_flux_is_refused_with_one_line(t2i_flux_world):
    """Ulysses in the text-to-image recipe splits SD3's image tokens; Flux's RoPE runs over the joint token ids."""
    with pytest.raises(ConfigError, match="is a FluxPipeline; context parallelism in the text-to-image recipe"):
        compose(["recipe=t2i_tiny", f"model.init_from={t2i_flux_world['pipeline']}", "parallel.cp=2"])
