"""finetune=lora on t2i_tiny (a tiny random StableDiffusion3Pipeline): the checkpoints hold the adapter only, and the
export is diffusers' LoRA file, checked against diffusers itself -- StableDiffusion3Pipeline.from_pretrained(base)
.load_lora_weights(export) draws, from a prompt and a seed, the image Kiln's sampler draws with the adapted
transformer; export.merge_lora's pipeline draws it too; the adapter changes the image; scripts/export.py from the
run's checkpoint writes the same export, tensor for tensor."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.conftest import load_script
from tests.fixtures.lora import assert_same_export
from tests.fixtures.t2i import IMAGE_SIZE, t2i_lora_run_args
from tests.support.launcher import run_train

pytestmark = pytest.mark.integration
# Measured max pixel difference (0-255 scale) between diffusers' pipelines (base + load_lora_weights; merged) and
# Kiln's sampler on the adapted transformer: 0.0 (fp32 on CPU: the same ops in the same order; peft's LoRA layer
# computes base(x) + B(A(x)) * scale in both). The bound leaves room for another BLAS's summation order.
MAX_PIXEL_DIFF = 1.0
ADAPTED = 2 * (8 + 7)  # (A, B) x the joint attention's 8 linears in block 0, 7 in the last (no to_add_out)


def test_t2i_lora_export_loads_in_diffusers_and_samples_like_kiln(trained, t2i_world, tmp_path, capsys):
    from diffusers import StableDiffusion3Pipeline
    from omegaconf import OmegaConf
    from safetensors.torch import load_file

    from common.diffusion.release import LORA_WEIGHTS as WEIGHTS
    from common.diffusion.release import adapted_model
    from common.ds_export import ZeroCheckpoint, saved_ema
    from common.lora import is_adapter_key
    from recipes.t2i import weights
    from recipes.t2i.sampling import PromptSampler

    run, base = trained(t2i_lora_run_args(t2i_world)), t2i_world["pipeline"]
    export = run / "export"

    # (a) The checkpoint holds the adapter (and its Adam state and EMA), no base weight: DeepSpeed's module states
    # are the adapter's parameters and the model's buffers only.
    ckpt = run / "checkpoints" / "step_0000006"
    states = torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=False)
    params = [k for k in states["module"] if k not in states["buffer_names"]]
    assert len(params) == ADAPTED and all(is_adapter_key(k) for k in params), params
    ema = saved_ema(ZeroCheckpoint(ckpt).trainer_state())
    assert sorted(ema) == sorted(params)

    info = json.loads((export / "kiln.json").read_text())
    assert info["base"] == str(base) and info["step"] == 6 and info["lora"]["rank"] == 8
    lora = load_file(export / WEIGHTS)
    assert len(lora) == ADAPTED and all(k.startswith("transformer.transformer_blocks.") for k in lora)

    # Kiln's sampler with the adapted transformer: the base's weights, peft's LoRA layers, the checkpoint's EMA
    # adapter (what the end of the run exported: (e) below checks the export from this checkpoint is that one).
    cfg = OmegaConf.load(run / "config.yaml")
    model = adapted_model(weights, cfg, base).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(ema[name])
    sampler = PromptSampler.from_export(base, image_size=IMAGE_SIZE, max_sequence_length=info["max_sequence_length"])
    sampler.model = model
    prompt, steps, guidance = "a picture of a handwritten 7", 4, 3.0
    kiln = sampler([prompt], torch.Generator().manual_seed(7), steps=steps, guidance_scale=guidance)[0]
    kiln = ((kiln + 1) / 2).permute(1, 2, 0).numpy()

    def draw(pipe) -> np.ndarray:
        pipe.set_progress_bar_config(disable=True)
        return pipe(
            prompt,
            height=IMAGE_SIZE,
            width=IMAGE_SIZE,
            num_inference_steps=steps,
            guidance_scale=guidance,
            generator=torch.Generator().manual_seed(7),
            max_sequence_length=info["max_sequence_length"],
            output_type="np",
        ).images[0]

    pipe = StableDiffusion3Pipeline.from_pretrained(base)
    before = draw(pipe)
    pipe.load_lora_weights(export)  # (b) diffusers' own loader on the base pipeline
    adapted = draw(pipe)
    merged = draw(StableDiffusion3Pipeline.from_pretrained(export / "merged"))  # (c)
    error = np.abs(adapted - kiln).max() * 255
    merge_error = np.abs(merged - kiln).max() * 255
    moved = np.abs(before - kiln).max() * 255
    print(
        f"max pixel difference (of 255) to Kiln's sampler: base + load_lora_weights {error:.3f}, merged "
        f"{merge_error:.3f}; the base without the adapter {moved:.3f}"
    )
    assert kiln.shape == (IMAGE_SIZE, IMAGE_SIZE, 3) and kiln.std() > 0.01
    assert error <= MAX_PIXEL_DIFF and merge_error <= MAX_PIXEL_DIFF
    # (d) the adapter changes the image (measured 5.7 of 255 on the 6-step run): the comparisons above can fail.
    assert moved > 4 * MAX_PIXEL_DIFF
    assert json.loads((export / "merged" / "kiln.json").read_text())["diffusers_pipeline"] == "StableDiffusion3Pipeline"

    # (e) scripts/export.py from the checkpoint: the end of the run's export, file for file, bit for bit.
    again = tmp_path / "again"
    assert load_script("export").main([str(run), "--out", str(again)]) == 0, capsys.readouterr().err
    assert_same_export(export, again)

    # A resume that would train another adapter on the checkpoint's stops with one line (common/lora.py).
    proc = run_train(
        [*t2i_lora_run_args(t2i_world), "lora.rank=4", f"run.resume={ckpt}", f"run.dir={tmp_path / 'resumed'}"],
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"kiln: error: run.resume: {ckpt} holds an adapter with lora.rank=8, this run asks for 4; resume with "
        "lora.rank=8 or start a new run.dir"
    )
