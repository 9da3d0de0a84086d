"""video_tiny on a tiny Wan 2.1 pipeline (random parts of diffusers' and transformers' classes) and moving-digit clips:
the run trains (the flow loss falls), writes sample clips (contact sheet and MP4s), and exports a WanPipeline folder
that diffusers' own WanPipeline samples exactly as Kiln's sampler does; scripts/export.py rebuilds that export from
the last checkpoint, tensor for tensor."""

from __future__ import annotations

import json
import math

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

    # The prompt-adherence eval (recipes/video/evaluate.py) ran on the held-out phrasings: one prompt per (digit,
    # direction), none a training caption; the mean is the per-digit shares' mean (4 clips each). (The scorer's own
    # check on real clips is tests/unit/test_video_eval.py: this world's random VAE renders them unreadable.)
    result = json.loads((run / "eval.json").read_text())
    assert result["num_samples"] == 40 and result["prompts_seen_in_training"] == 0 and result["step"] == 10
    assert (result["chance_digit"], result["chance_direction"]) == (0.1, 0.25)
    assert math.isclose(sum(result["per_digit_accuracy"].values()) / 10, result["digit_accuracy"])
    assert 0 <= result["real_val_digit_accuracy"] <= 1 and 0 <= result["real_val_direction_accuracy"] <= 1
    assert (samples / "eval.png").is_file() and len(list(samples.glob("eval_*.mp4"))) == 4
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


def test_the_latent_cache_holds_the_encoders_output_and_trains_the_same_losses(trained, video_world, tmp_path):
    """python -m data.cache_latents recipe=video_tiny ...: each clip's VAE posterior and its caption's UMT5 embedding
    as WanPipeline computes them (its own encode_prompt, its VAE on the stored clip); a run on the cache trains the
    on-the-fly run's losses without loading UMT5; a cache made with other settings is refused in one line."""
    import io

    import numpy as np
    import pytest
    from diffusers import WanPipeline

    from common.data.video import decode_video_sample
    from common.data.webdataset import iter_samples
    from common.errors import DataError
    from data import cache_latents
    from recipes.video.data import load_cache_meta
    from recipes.video.weights import encoders_identity
    from scripts.kiln.launch import compose
    from tests.conftest import run_train

    args = video_run_args(video_world)
    keep = [a for a in args if a.split("=")[0] in ("recipe", "model.init_from", "data.root", "data.build")]
    cache = tmp_path / "cache"
    assert cache_latents.main([*keep, "--out", str(cache), "--batch-size", "16"]) == 0

    pipe = WanPipeline.from_pretrained(video_world["pipeline"])
    cached = [s for _, s in zip(range(3), iter_samples([str(p) for p in sorted(cache.glob("train-*.tar"))]))]
    clips = [s for _, s in zip(range(3), iter_samples([str(p) for p in sorted(video_world["shards"].glob("train-*"))]))]
    with torch.no_grad():
        videos = torch.stack([decode_video_sample(s)["video"] for s in clips])
        dist = pipe.vae.encode(videos).latent_dist
        context, _ = pipe.encode_prompt(
            [s["txt"].decode() for s in clips], do_classifier_free_guidance=False, max_sequence_length=32
        )
    for i, s in enumerate(cached):
        moments = np.load(io.BytesIO(s["moments.npy"]))
        np.testing.assert_allclose(moments[0], dist.mean[i].numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(moments[1], dist.std[i].numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.load(io.BytesIO(s["context.npy"])), context[i].numpy(), rtol=1e-5, atol=1e-6)

    run = tmp_path / "cached"
    steps = 3
    short = [a for a in args if not a.startswith(("trainer.max_steps=", "checkpoint.every="))]
    proc = run_train(
        [*short, f"trainer.max_steps={steps}", "checkpoint.every=0", f"data.latents={cache}", f"run.dir={run}"]
        + ["trainer.eval=false"]  # the eval's held-out prompts are no cached caption: it would load UMT5
    )
    assert "Loading weights" not in proc.stdout + proc.stderr  # UMT5 never loaded: its sample prompts are cached too
    fly, on_cache = losses(trained(args)), losses(run)
    assert sorted(on_cache) == list(range(1, steps + 1))
    for step in on_cache:
        assert on_cache[step] == pytest.approx(fly[step], rel=1e-5), (step, fly, on_cache)

    cfg = compose([*args, f"data.latents={cache}", "data.num_frames=5"])
    with pytest.raises(DataError) as err:
        load_cache_meta(cfg, encoders_identity(video_world["pipeline"]))
    assert "data.num_frames=5 (the cache's: 9)" in str(err.value) and "\n" not in str(err.value)


def test_bucketed_clips_come_in_batches_of_one_shape(video_world, tmp_path):
    """data.buckets=true on prepare_videos --buckets shards: every global batch is one bucket's clips, each stored
    at its shape (never squashed), both shapes of the folder among them; unbucketed settings on them are refused."""
    import pytest

    from common.distributed import DistInfo
    from common.errors import DataError
    from data.prepare_videos import build_video_shards
    from data.tiny_bases import make_clip_folder
    from recipes.video.data import build_train_loader, prepare_data
    from scripts.kiln.launch import compose

    clips = make_clip_folder(tmp_path / "clips", n=24, bad=False)
    root = tmp_path / "buckets"
    clip = {"num_frames": 9, "height": 48, "width": 48}
    build_video_shards(
        root, input=clips, **clip, buckets=["1:1", "3:2"], train_shards=2, val_shards=1, val_fraction=0.2
    )
    args = ["recipe=video_tiny", f"model.init_from={video_world['pipeline']}", "data=clips", f"data.root={root}"]
    args += ["data.build=[]", *(f"data.{k}={v}" for k, v in clip.items()), "trainer.micro_batch_size=2"]
    cfg = compose([*args, "data.buckets=true"])
    meta = prepare_data(cfg, DistInfo(0, 1, 0, torch.device("cpu")), dp=1)
    assert sorted(meta["buckets"]["samples"]["train"]) == ["48x48", "64x32"]
    shapes = set()
    for _, batch in zip(range(12), build_train_loader(cfg, meta, rank=0, dp=1)):
        videos = batch["video"]
        assert videos.shape[:3] == (2, 3, 9)  # one shape per batch: a stack would fail otherwise
        shapes.add(tuple(videos.shape[3:]))
    assert shapes == {(48, 48), (32, 64)}
    with pytest.raises(DataError, match="holds aspect-ratio buckets"):
        prepare_data(compose(args), DistInfo(0, 1, 0, torch.device("cpu")), dp=1)
