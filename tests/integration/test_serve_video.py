"""The text-to-video server (scripts/serve.py on a video export: recipes/video/serve.py over the shared
common/diffusion/server.py, at POST /v1/videos/generations) on a tiny random WanPipeline folder with the kiln.json a
video run's export writes (data/tiny_bases.py make_wan_pipeline, recipes/video/weights.py export_info), started as a
user starts it. References: diffusers' own WanPipeline on the folder with the same prompt, seed, steps and guidance;
PyAV decoding the MP4s; the same requests sent one at a time; the server's own log of the batches it ran."""

from __future__ import annotations

import base64
import io
import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import av
import numpy as np
import pytest
import torch

from scripts.kiln.serving import http, running_server

pytestmark = pytest.mark.integration

KEY = "kiln-video-key"
FRAMES, HEIGHT, WIDTH = 5, 32, 48  # not square: `size` is "WxH"
SIZE = f"{WIDTH}x{HEIGHT}"
# The MP4 is H.264 in yuv420p (lossy; recipes/video/sampling.py write_mp4). Measured on this untrained folder's
# noisy clips (a worst case for a codec), as mean absolute differences of 255: the served MP4s decoded vs
# WanPipeline's frames written through the same encoder, 0 (max 0: before encoding the frames agree within 1 of 255,
# and here exactly); vs WanPipeline's raw frames (the codec's loss), 7.5-7.7 (max single pixel ~70); another seed's
# clip vs the reference, ~8. Batched vs alone: the same fp32 frames, so the same MP4s (identical).
MAX_MEAN_DIFF = 0.5  # room for another BLAS's rounding flipping a few pixels before the encoder
MEAN_CODEC_LOSS = 10.0


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from data.tiny_bases import make_wan_pipeline
    from recipes.video.weights import export_info
    from scripts.kiln.launch import compose

    folder = make_wan_pipeline(
        tmp_path_factory.mktemp("video_serve") / "export",
        num_layers=2,
        num_attention_heads=2,
        attention_head_dim=16,
        base_dim=8,
    )
    cfg = compose(
        ["recipe=video_tiny", f"model.init_from={folder}", f"data.num_frames={FRAMES}", f"data.width={WIDTH}"]
    )
    (folder / "kiln.json").write_text(json.dumps(export_info(cfg, folder, step=0)))
    return folder


@pytest.fixture(scope="module")
def server(export):
    log = export.parent / "serve.log"
    # A long batching window, so that requests sent together surely share a batch.
    with running_server(
        export, "serve.batch_wait_ms=300", "serve.max_batch_images=4", log_path=log, env={"KILN_API_KEY": KEY}
    ) as base:
        yield base, log


def post(base: str, body: dict, key: str = KEY) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{base}/v1/videos/generations",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def decode(result: dict) -> np.ndarray:
    """The response's clips as uint8 [N, F, H, W, 3], each MP4 decoded by PyAV."""
    clips = []
    for item in result["data"]:
        with av.open(io.BytesIO(base64.b64decode(item["b64_json"]))) as container:
            stream = container.streams.video[0]
            assert stream.codec_context.name == "h264" and stream.average_rate == 16
            clips.append(np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)]))
    return np.stack(clips)


def generate(base: str, prompt: str, seed: int, guidance: float, n: int = 1, steps: int = 3) -> np.ndarray:
    body = {"prompt": prompt, "n": n, "seed": seed, "num_inference_steps": steps, "guidance_scale": guidance}
    code, result = post(base, body)
    assert code == 200, result
    assert {k: result[k] for k in ("output_format", "size", "num_frames", "fps")} == {
        "output_format": "mp4",
        "size": SIZE,
        "num_frames": FRAMES,
        "fps": 16,
    }
    return decode(result)


def mp4_frames(frames: np.ndarray) -> np.ndarray:
    """uint8 frames [F, H, W, 3] through the server's MP4 encoder, decoded."""
    from recipes.video.serve import mp4_bytes

    clip = torch.from_numpy(frames).permute(3, 0, 1, 2).double() / 127.5 - 1
    return decode({"data": [{"b64_json": base64.b64encode(mp4_bytes(clip.float())).decode()}]})[0]


def mean_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a.astype(np.float64) - b).mean())


def test_a_seeded_request_draws_what_wanpipeline_draws(server, export):
    from diffusers import WanPipeline

    base, log = server
    prompt, seed, steps, guidance = "the digit 7 drifting right", 1234, 3, 2.5
    served = generate(base, prompt, seed, guidance, n=2, steps=steps)
    assert "engine=torch" in log.read_text() and "as 'video_tiny'" in log.read_text()
    info = json.loads((export / "kiln.json").read_text())
    pipe = WanPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(
        prompt,
        num_frames=FRAMES,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=steps,
        guidance_scale=guidance,
        num_videos_per_prompt=2,
        generator=torch.Generator().manual_seed(seed),
        max_sequence_length=info["max_sequence_length"],
        output_type="np",
    ).frames
    theirs = (frames * 255).round().astype(np.uint8)  # diffusers' numpy_to_pil rounding
    assert served.shape == theirs.shape == (2, FRAMES, HEIGHT, WIDTH, 3) and theirs.std() > 20
    # Through the same H.264 encoder (PyAV's libx264, deterministic), WanPipeline's frames give the served clips.
    reencoded = np.stack([mp4_frames(t) for t in theirs])
    diffs = [mean_diff(s, r) for s, r in zip(served, reencoded)]
    losses = [mean_diff(s, t) for s, t in zip(served, theirs)]
    print(
        f"mean pixel difference of the served MP4s: vs WanPipeline's frames in the same MP4 {diffs}, vs its raw "
        f"frames {losses} / 255"
    )
    assert max(diffs) <= MAX_MEAN_DIFF, diffs
    assert max(losses) <= MEAN_CODEC_LOSS, losses
    other = generate(base, prompt, 99, guidance, n=2, steps=steps)  # not vacuous: another seed, other clips
    assert min(mean_diff(o, r) for o, r in zip(other, reencoded)) > 4


def test_two_prompts_in_one_batch_give_the_clips_each_gives_alone(server):
    base, log = server
    asks = [("a handwritten 3 moving up", 5, 1.5), ("the digit 8 spinning", 6, 4.0)]  # (prompt, seed, guidance)
    before = log.read_text().count("kiln: videos batch:")
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda a: generate(base, *a), asks))
    batches = re.findall(r"kiln: videos batch: (\d+) videos from (\d+) requests", log.read_text())[before:]
    assert batches == [("2", "2")], batches  # they shared one denoising loop
    alone = [generate(base, *a) for a in asks]  # one request at a time: each its own batch
    for t, a in zip(together, alone):
        np.testing.assert_array_equal(t, a)
    assert mean_diff(alone[0], alone[1]) > 4  # two prompts, two seeds: two clips


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"prompt": "a 3", "size": "32x32"}, 400, f"size='32x32': this model makes {SIZE} videos only"),
        ({"prompt": "a 3", "size": f"{HEIGHT}x{WIDTH}"}, 400, f"makes {SIZE} videos only"),
        ({"prompt": "a 3", "n": 0}, 400, "1 to 4 videos per request"),
        ({"prompt": "a 3", "n": 5}, 400, "1 to 4 videos per request"),
        ({"prompt": "a handwritten seven " * 20}, 400, "longer than this model's text encoder reads (UMT5: 32 tokens"),
        ({"prompt": "a 3", "output_format": "png"}, 400, "output_format='png': only mp4"),
        ({"prompt": "a 3", "model": "other"}, 404, "this server serves `video_tiny`"),
    ],
)
def test_bad_requests_are_4xx_with_a_message_and_the_server_stays_up(server, body, status, words):
    base, _ = server
    code, result = post(base, body)
    assert code == status and words in result["error"]["message"], result
    assert http(f"{base}/health")[0] == 200


def test_the_key_is_required_and_models_lists_the_export(server):
    base, _ = server
    assert post(base, {"prompt": "a 3"}, key="wrong")[0] == 401
    assert http(f"{base}/v1/models")[0] == 401
    request = urllib.request.Request(f"{base}/v1/models", headers={"authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        (entry,) = json.loads(response.read())["data"]
    assert entry["id"] == "video_tiny" and (entry["num_frames"], entry["fps"], entry["size"]) == (FRAMES, 16, SIZE)
