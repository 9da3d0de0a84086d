"""Kiln's Qwen2.5-VL and Qwen3-VL sample encoding against transformers' own Qwen2_5_VLProcessor and Qwen3VLProcessor.
The processors need a video processor that needs torchvision, which the training env's CPU torch cannot import,
so they run in vLLM's environment (.venv-serve: the CUDA build of torch, with torchvision, on CPU; one process for
both architectures, whose start-up is most of the time). On the same rendered conversation and
three images of different sizes, it must give the token ids `encode_qwen` gives (each <|image_pad|> expanded to
its image's tokens) and the same patch grids. Pixel values are compared loosely: .venv-serve's image processor is
the torchvision backend, Kiln's the PIL one (their bicubic resizes differ by ~0.015 in normalized units).

Videos the same way, against the processor's own Qwen2VLVideoProcessor / Qwen3VLVideoProcessor as AutoProcessor
loads them from the folder (Qwen3-VL's from its video_preprocessor_config.json, whose budget is not the image
processor's, as released; Qwen2.5-VL's from preprocessor_config.json, as its release ships no video config), on the
same frames: one of 25 frames that it samples itself (do_sample_frames, the video's metadata: 10 fps for Qwen2.5-VL, 5
for Qwen3-VL, whose clip-wide pixel budget then binds; at the folder's rate, Qwen2.5-VL's given by the caller as
qwen-vl-utils does: its folder names none) and resizes, one of 5 frames (odd: padded with the last) already at a
size the budget keeps, taken as sampled at 2 fps. Then Kiln's export of a run (QwenProcessing.save_pretrained) with
data.video_fps / data.max_frames / data.max_pixels set, from a folder whose video config turns the per-frame cap on:
the processor AutoProcessor loads from the export must encode the 25 frames as the run did. Token ids (Qwen3-VL's:
with its `<t seconds>` text and vision start/end per temporal patch), video grids and Qwen2.5-VL's
second_per_grid_ts must be equal, and the loaded video processor's values Kiln's; the pixels of the video kept at its
size too (to float rounding, as both only rescale and normalize), those of the resized one within the resize
difference. One reference process answers every call (starting it is most of the test's time)."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

from data.tiny_bases import make_qwen2_5_vl, make_qwen3_vl
from recipes.vlm.data import IMAGE_TOKEN, render_turns
from recipes.vlm.qwen import IMAGE_SLOT, VIDEO_SLOT, VIDEO_TOKEN, encode_qwen, load_processing
from recipes.vlm.video import QWEN2_FPS, VIDEO_CONFIG, frames_video
from scripts.kiln.serving import serve_venv
from tests.fixtures.vllm import NEEDS_VLLM
from tests.fixtures.vlm import frames, image, video_conversation

pytestmark = NEEDS_VLLM

REFERENCE = """
import json, sys
import numpy as np
from PIL import Image
from transformers import AutoProcessor

out = sys.argv[2]
answers = {}
for job in json.loads(open(sys.argv[1]).read()):
    # the processor as transformers (and vLLM) load it from the folder: its video processor from the folder's files
    processor = AutoProcessor.from_pretrained(job["folder"], local_files_only=True)
    v = processor.video_processor
    results = []
    answers[job["name"]] = {
        "classes": [type(processor).__name__, type(v).__name__],
        "video": [v.size["shortest_edge"], v.size["longest_edge"], v.fps, v.min_frames, v.max_frames,
                  bool(v.cap_pixels_per_frame), v.max_video_tokens],
        "calls": results,
    }
    for i, call in enumerate(job["calls"]):
        video = {}
        if "video" in call:
            video = dict(videos=[np.load(call["video"])], video_metadata=[call["metadata"]])
            video["do_sample_frames"] = call["sample"]  # what the frames are: a whole video, or sampled already
            if "fps" in call:  # a caller's rate, for a video processor that names none (qwen-vl-utils')
                video["fps"] = call["fps"]
        images = [Image.open(p).convert("RGB") for p in call["images"]] or None
        enc = processor(text=[call["text"]], images=images, return_tensors="np", **video)
        result = {"input_ids": enc["input_ids"][0].tolist()}
        for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
            if pixels in enc:
                np.save(f"{out}/{job['name']}_{pixels}{i}.npy", enc[pixels])
                result[grid] = enc[grid].tolist()
        if "second_per_grid_ts" in enc:
            result["second_per_grid_ts"] = np.asarray(enc["second_per_grid_ts"]).tolist()
        results.append(result)
print(json.dumps(answers))
"""

# model_type -> (its fixture, transformers' processor and video processor, the grids of the three images below: 28-px
# units for Qwen2.5-VL's 14-px patches, 32-px for Qwen3-VL's 16-px ones; the videos: the rate of the 25 frames, the
# (frames, height, width) of the ones taken as sampled, at a size the budget keeps, the two videos' grids; the export's
# video config: the folder's with the per-frame cap on, and the 25 frames' grid the run gives them)
ARCHS = {
    "qwen2_5_vl": (
        make_qwen2_5_vl,
        "Qwen2_5_VLProcessor",
        "Qwen2VLVideoProcessor",
        [[1, 18, 12], [1, 4, 6], [1, 10, 16]],
        (10.0, (5, 84, 56), [[[2, 8, 10]], [[3, 6, 4]]]),
        # its own video config (the release ships none), the legacy pixel keys; the cap: 90% of 20 tokens over 4
        # frames, 7056 pixels a frame: 100 x 150 -> 56 x 84
        (
            {
                "min_pixels": 28 * 28 * 4,
                "max_pixels": 28 * 28 * 32,
                "cap_pixels_per_frame": True,
                "max_video_tokens": 20,
            },
            [[2, 4, 6]],
        ),
    ),
    "qwen3_vl": (
        make_qwen3_vl,
        "Qwen3VLProcessor",
        "Qwen3VLVideoProcessor",
        [[1, 18, 12], [1, 4, 6], [1, 8, 14]],
        # 25 frames at 5 fps: 10 sampled, 10 x 96 x 160 px over the video budget (128 x 32 x 32): 64 x 128 each (the
        # image budget, 64 x 32 x 32, would make them 64 x 96)
        (5.0, (5, 96, 64), [[[5, 4, 8]], [[3, 6, 4]]]),
        # the cap: 4 tokens a frame (floored at 1.05 x 4096 pixels), 4 frames of 25 (data.max_frames): 32 x 64
        ({"cap_pixels_per_frame": True, "max_video_tokens": 4}, [[2, 2, 4]]),
    ),
}
# The export's run: data.video_fps=1, data.max_frames=4 and a smaller image budget.
RUN = dict(video_fps=1.0, max_frames=4)
MESSAGES = [
    {"role": "user", "content": "Compare <image> and <image>.\n<image>"},
    {"role": "assistant", "content": "Five."},
]


def qwen_text(messages: list[dict], tokenizer) -> str:
    """The conversation as Qwen's chat template renders it, with a pad per image and video (the processor's input)."""
    slots = [
        {**m, "content": m["content"].replace(IMAGE_TOKEN, IMAGE_SLOT).replace(VIDEO_TOKEN, VIDEO_SLOT)}
        for m in messages
    ]
    return render_turns(slots, tokenizer)[0]


def export_of_a_run(folder, out, video_settings: dict):
    """Kiln's export of a run (QwenProcessing.save_pretrained beside the model's config.json, as the trainer writes
    it) on a copy of `folder` whose video processor config adds `video_settings`, with RUN's rate and frame cap and
    half the folder's image budget; and the run's processing."""
    source = out.with_name(out.name + "_source")
    shutil.copytree(folder, source, ignore=shutil.ignore_patterns("*.safetensors"))
    settings = json.loads((source / VIDEO_CONFIG).read_text()) if (source / VIDEO_CONFIG).exists() else {}
    (source / VIDEO_CONFIG).write_text(json.dumps({**settings, **video_settings}))
    config = json.loads((source / "config.json").read_text())
    high = json.loads((source / "preprocessor_config.json").read_text())["size"]["longest_edge"] // 2
    run = load_processing(source, config["image_token_id"], max_pixels=high, **RUN)
    out.mkdir()
    run.save_pretrained(out)
    shutil.copy(source / "config.json", out)
    return run


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """model_type -> Kiln's encodings of its calls and its video values (the folder's, the export's run's), the
    same name -> the reference processor's answers to the same calls and its video processor's values, all in one
    process: for both architectures three images of different sizes, an image and a 25-frame video (the processor
    samples it and resizes it: 100x150 is no multiple of 28 or 32), and 5 frames taken as sampled at 2 fps, at a
    size the budget keeps, from the folder; the image and the 25 frames from the export."""
    tmp = tmp_path_factory.mktemp("qwen_processor")
    images = [image(300, 200, 0), image(56, 84, 1), image(140, 224, 2)]
    paths = []
    for i, im in enumerate(images):
        paths.append(str(tmp / f"image{i}.png"))
        im.save(paths[-1])
    clip = frames(25, 100, 150, 3)
    np.save(tmp / "clip.npy", clip)
    jobs, kiln = [], {}
    for arch, (make, _, _, _, (rate, given, _), (capped, _)) in ARCHS.items():
        folder = make(tmp / arch)
        config = json.loads((folder / "config.json").read_text())
        processing = load_processing(folder, config["image_token_id"])
        run = export_of_a_run(folder, tmp / f"{arch}_export", capped)
        as_given = frames(*given, 4)
        np.save(tmp / f"{arch}_given.npy", as_given)
        # the 25-frame video: the processor samples it (at Qwen2.5-VL's caller's rate: its folder names none)
        sampled = {
            "images": paths[1:2],
            "video": str(tmp / "clip.npy"),
            "metadata": {"total_num_frames": 25, "fps": rate},
            "sample": True,
        }
        caller = {"fps": QWEN2_FPS} if arch == "qwen2_5_vl" else {}
        for name, p, calls in (
            (
                arch,
                processing,
                [
                    (MESSAGES, images, [], {"images": paths}),
                    (
                        video_conversation(1),
                        images[1:2],
                        [frames_video(list(clip), processing.video, source_fps=rate)],
                        {**sampled, **caller},
                    ),
                    (
                        video_conversation(),
                        [],
                        [frames_video(list(as_given), processing.video)],
                        {
                            "images": [],
                            "video": str(tmp / f"{arch}_given.npy"),
                            "sample": False,
                            # the frames as they were taken: Qwen3VLProcessor's timestamps need their indices
                            "metadata": {"total_num_frames": 5, "fps": 2.0, "frames_indices": list(range(5))},
                        },
                    ),
                ],
            ),
            (
                f"{arch}_export",
                run,
                [(video_conversation(1), images[1:2], [frames_video(list(clip), run.video, source_fps=rate)], sampled)],
            ),
        ):
            kiln[name] = (
                p.video,
                [
                    encode_qwen(m, ims, p.tokenizer, p.image_processor, videos=videos, video_config=p.video)
                    for m, ims, videos, _ in calls
                ],
            )
            jobs.append(
                {
                    "name": name,
                    "folder": str(tmp / name),
                    "calls": [{"text": qwen_text(m, p.tokenizer), **call} for m, _, _, call in calls],
                }
            )
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    (tmp / "reference.py").write_text(REFERENCE)
    proc = subprocess.run(
        [str(serve_venv() / "bin" / "python"), str(tmp / "reference.py"), str(tmp / "jobs.json"), str(tmp)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return kiln, json.loads(proc.stdout.strip().splitlines()[-1]), tmp


def video_values(video) -> list:
    """A Kiln VideoConfig's values as the reference reports its video processor's."""
    return [video.min_pixels, video.max_pixels, video.fps, video.min_frames, video.max_frames]


@pytest.mark.parametrize("arch", ARCHS)
def test_encoding_matches_the_qwen_processor(world, arch):
    kiln, refs, tmp = world
    enc, ref = kiln[arch][1][0], refs[arch]["calls"][0]
    assert enc["input_ids"].tolist() == ref["input_ids"]
    assert enc["image_grid_thw"].tolist() == ref["image_grid_thw"] == ARCHS[arch][3]
    pixels = np.load(tmp / f"{arch}_pixel_values0.npy")
    assert pixels.shape == tuple(enc["pixel_values"].shape)
    assert np.abs(pixels - enc["pixel_values"].numpy()).max() < 0.05


@pytest.mark.parametrize("arch", ARCHS)
def test_video_encoding_matches_the_qwen_video_processor(world, arch):
    kiln, refs, tmp = world
    (video, kiln), loaded = kiln[arch], refs[arch]
    refs = loaded["calls"]
    diffs = []
    for i, (enc, ref) in enumerate(zip(kiln[1:], refs[1:], strict=True), start=1):
        assert enc["input_ids"].tolist() == ref["input_ids"]
        assert enc["video_grid_thw"].tolist() == ref["video_grid_thw"]
        if "second_per_grid_ts" in ref:  # Qwen2.5-VL's time positions (Qwen3-VL's: its timestamp texts)
            assert enc["second_per_grid_ts"].tolist() == ref["second_per_grid_ts"]
        pixels = np.load(tmp / f"{arch}_pixel_values_videos{i}.npy")
        assert pixels.shape == tuple(enc["pixel_values_videos"].shape)
        diffs.append(float(np.abs(pixels - enc["pixel_values_videos"].numpy()).max()))
    assert kiln[1]["image_grid_thw"].tolist() == refs[1]["image_grid_thw"] == [[1, 4, 6]]
    print(f"{arch}: max |pixel_values_videos - processor's| resized, kept at size: {diffs}")
    assert [r["video_grid_thw"] for r in refs[1:]] == ARCHS[arch][4][2]
    if arch == "qwen2_5_vl":
        assert [r["second_per_grid_ts"] for r in refs[1:]] == [[1.25], [1.0]]  # 2 / (4 of 25 frames x 10 fps), 2 / 2
    else:  # the temporal patches' mean frame times, as text: 10 of 25 frames at 5 fps, then 5 at 2 fps
        text = [tokenizer_text(tmp, r["input_ids"]) for r in refs[1:]]
        assert [t.count("seconds>") for t in text] == [5, 3]
        assert "<0.3 seconds><|vision_start|><|video_pad|>" in text[0] and "<2.0 seconds>" in text[1]
    assert diffs[0] < 0.05 and diffs[1] < 1e-5
    assert loaded["classes"] == list(ARCHS[arch][1:3])
    # the folder's video processor: Qwen2.5-VL's names no rate (Kiln's: qwen-vl-utils' 2), nor turns the cap on
    want = [*loaded["video"][:2], loaded["video"][2] or QWEN2_FPS, *loaded["video"][3:5]]
    assert video_values(video) == want and not video.cap_pixels_per_frame


@pytest.mark.parametrize("arch", ARCHS)
def test_the_export_encodes_videos_as_the_run_did(world, arch):
    """The export of a run with data.video_fps=1, data.max_frames=4 and the per-frame cap on (its folder's): the
    processor transformers loads from it holds the run's values and encodes the 25 frames as the run did."""
    kiln, refs, tmp = world
    (video, (enc,)), ref = kiln[f"{arch}_export"], refs[f"{arch}_export"]
    assert ref["classes"] == list(ARCHS[arch][1:3])
    assert ref["video"] == [*video_values(video), True, video.max_video_tokens]
    assert (video.fps, video.max_frames, video.cap_pixels_per_frame) == (1.0, 4, True)
    (ref,) = ref["calls"]
    assert enc["input_ids"].tolist() == ref["input_ids"]
    assert enc["video_grid_thw"].tolist() == ref["video_grid_thw"] == ARCHS[arch][5][1]
    assert enc["image_grid_thw"].tolist() == ref["image_grid_thw"]
    if "second_per_grid_ts" in ref:
        assert enc["second_per_grid_ts"].tolist() == ref["second_per_grid_ts"]
    pixels = np.load(tmp / f"{arch}_export_pixel_values_videos0.npy")
    assert np.abs(pixels - enc["pixel_values_videos"].numpy()).max() < 0.05


def tokenizer_text(tmp, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tmp / "qwen3_vl").decode(ids)
