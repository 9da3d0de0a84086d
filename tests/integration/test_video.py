"""video_tiny on a tiny Wan 2.1 pipeline (random parts of diffusers' and transformers' classes) and moving-digit clips:
the run trains (the flow loss falls), writes sample clips (contact sheet and MP4s), and exports a WanPipeline folder
that diffusers' own WanPipeline samples exactly as Kiln's sampler does; scripts/export.py rebuilds that export from
the last checkpoint, tensor for tensor."""

from __future__ import annotations

import json

import torch

from tests.conftest import load_script, losses
from tests.fixtures.lora import assert_same_export
from tests.fixtures.video import CLIP, video_run_args

PROMPTS = ["the digit 3 moving left", "a handwritten seven drifting to the right"]


def test_video_trains_exports_and_samples_like_wanpipeline(trained, video_world, tmp_path, capsys):
    import av
    from diffusers import WanPipeline

    from recipes.video.sampling import VideoSampler

    run = trained(video_run_args(video_world))
    loss = losses(run)
    assert sorted(loss) == list(range(1, 11))
    first, last = sum(loss[s] for s in (1, 2, 3)) / 3, sum(loss[s] for s in (8, 9, 10)) / 3
    print(f"video_tiny loss: steps 1-3 {first:.3f}, steps 8-10 {last:.3f}")
    assert last < 0.9 * first, loss

    # Sample clips: a contact sheet (a row per held-out caption) and each clip as an MP4 that decodes to its frames.
    samples = run / "samples"
    prompts = json.loads((samples / "prompts.json").read_text())
    assert (samples / "final.png").is_file() and len(prompts) == 4
    with av.open(str(samples / "final_0.mp4")) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == CLIP["num_frames"] and frames[0].shape == (CLIP["height"], CLIP["width"], 3)

    # The export: diffusers' WanPipeline draws, for the same prompts and seed, the frames Kiln's sampler draws.
    export = run / "export"
    info = json.loads((export / "kiln.json").read_text())
    assert info["diffusers_pipeline"] == "WanPipeline" and info["step"] == 10
    ours = VideoSampler.from_export(export)(PROMPTS, torch.Generator().manual_seed(7), steps=4, guidance_scale=3.0)
    pipe = WanPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(
        PROMPTS,
        **CLIP,
        num_inference_steps=4,
        guidance_scale=3.0,
        generator=torch.Generator().manual_seed(7),
        output_type="pt",
        max_sequence_length=info["max_sequence_length"],
    ).frames  # [N, F, 3, H, W] in [0, 1]
    worst = ((ours.permute(0, 2, 1, 3, 4) + 1) / 2 - theirs).abs().max().item()
    print(f"video export: WanPipeline vs Kiln's sampler, max pixel difference {worst:.1e} (of 1)")
    assert worst < 1e-4  # measured 1.0e-6

    # scripts/export.py from the last checkpoint: the end of the run's export, every tensor bit for bit.
    assert load_script("export").main([str(run), "--out", str(tmp_path / "again")]) == 0, capsys.readouterr().err
    assert_same_export(export, tmp_path / "again")
