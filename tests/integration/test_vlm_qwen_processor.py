"""Kiln's Qwen2.5-VL and Qwen3-VL sample encoding against transformers' own Qwen2_5_VLProcessor and Qwen3VLProcessor.
The processors need a video processor that needs torchvision, which the training env's CPU torch lacks (PITFALLS.md),
so they run in vLLM's environment (.venv-serve: the CUDA build of torch, with torchvision, on CPU; one process for
both architectures, whose start-up is most of the time). On the same rendered conversation and
three images of different sizes, it must give the token ids `encode_qwen` gives (each <|image_pad|> expanded to
its image's tokens) and the same patch grids. Pixel values are compared loosely: .venv-serve's image processor is
the torchvision backend, Kiln's the PIL one (their bicubic resizes differ by ~0.015 in normalized units).

Videos the same way, against the processor's own Qwen2VLVideoProcessor / Qwen3VLVideoProcessor on the same frames:
one of 25 frames that it samples itself at 2 fps (do_sample_frames, the video's metadata: 10 fps for Qwen2.5-VL, 5
for Qwen3-VL, whose clip-wide pixel budget then binds) and resizes, one of 5 frames (odd: padded with the last)
already at a size the budget keeps, taken as sampled at 2 fps. Token ids (Qwen3-VL's: with its `<t seconds>` text and
vision start/end per temporal patch), video grids and Qwen2.5-VL's second_per_grid_ts must be equal; the pixels of
the video kept at its size too (to float rounding, as both only rescale and normalize), those of the resized one
within the resize difference. One reference process answers every call (starting it is most of the test's time)."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from common.tools.fixtures import make_qwen2_5_vl, make_qwen3_vl
from common.tools.serving import serve_env, serve_venv
from recipes.vlm.archs import QWEN_ARCHS
from recipes.vlm.data import IMAGE_TOKEN, render_turns
from recipes.vlm.qwen import IMAGE_SLOT, VIDEO_SLOT, VIDEO_TOKEN, encode_qwen
from recipes.vlm.video import frames_video
from tests.unit.test_vlm_qwen import frames, image, video_conversation

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(serve_env() is None, reason="needs vLLM's environment: make serve-env (.venv-serve)"),
]

REFERENCE = """
import json, sys
import numpy as np
from PIL import Image
import transformers
from transformers import AutoImageProcessor, AutoTokenizer

out = sys.argv[2]
answers = {}
for job in json.loads(open(sys.argv[1]).read()):
    tokenizer = AutoTokenizer.from_pretrained(job["folder"])
    image_processor = AutoImageProcessor.from_pretrained(job["folder"])
    processor = getattr(transformers, job["processor"])(
        image_processor=image_processor,
        tokenizer=tokenizer,
        # the image processor's pixel budget, as a release's one preprocessor_config.json gives both
        video_processor=getattr(transformers, job["video_processor"])(size=dict(image_processor.size)),
        chat_template=tokenizer.chat_template,
    )
    results = answers[job["name"]] = []
    for i, call in enumerate(job["calls"]):
        video = {}
        if "video" in call:
            video = dict(
                videos=[np.load(call["video"])],
                video_metadata=[call["metadata"]],
                do_sample_frames=call["sample"],
                fps=2.0,
                cap_pixels_per_frame=False,
            )
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
# (frames, height, width) of the ones taken as sampled, at a size the budget keeps, and the two videos' grids)
ARCHS = {
    "qwen2_5_vl": (
        make_qwen2_5_vl,
        "Qwen2_5_VLProcessor",
        "Qwen2VLVideoProcessor",
        [[1, 18, 12], [1, 4, 6], [1, 10, 16]],
        (10.0, (5, 84, 56), [[[2, 8, 10]], [[3, 6, 4]]]),
    ),
    "qwen3_vl": (
        make_qwen3_vl,
        "Qwen3VLProcessor",
        "Qwen3VLVideoProcessor",
        [[1, 18, 12], [1, 4, 6], [1, 8, 14]],
        # 25 frames at 5 fps: 10 sampled, 10 x 96 x 160 px over the budget (64 x 32 x 32): 64 x 96 each
        (5.0, (5, 96, 64), [[[5, 4, 6]], [[3, 6, 4]]]),
    ),
}
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


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """model_type -> Kiln's encodings of its calls, model_type -> the reference processor's answers to the same
    calls, all in one process: for both architectures three images of different sizes, an image and a 25-frame video
    (the processor samples it at 2 fps and resizes it: 100x150 is no multiple of 28 or 32), and 5 frames taken as
    sampled at 2 fps, at a size the budget keeps."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tmp = tmp_path_factory.mktemp("qwen_processor")
    images = [image(300, 200, 0), image(56, 84, 1), image(140, 224, 2)]
    paths = []
    for i, im in enumerate(images):
        paths.append(str(tmp / f"image{i}.png"))
        im.save(paths[-1])
    clip = frames(25, 100, 150, 3)
    np.save(tmp / "clip.npy", clip)
    jobs, kiln = [], {}
    for arch, (make, processor, video_processor, _, (rate, given, _)) in ARCHS.items():
        rule = QWEN_ARCHS[arch].video
        folder = make(tmp / arch)
        tokenizer, image_processor = AutoTokenizer.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder)
        as_given = frames(*given, 4)
        np.save(tmp / f"{arch}_given.npy", as_given)
        calls = [
            (MESSAGES, images, [], {"images": paths}),
            (
                video_conversation(1),
                images[1:2],
                [frames_video(list(clip), 2.0, 768, source_fps=rate, rule=rule)],
                {
                    "images": paths[1:2],
                    "video": str(tmp / "clip.npy"),
                    "metadata": {"total_num_frames": 25, "fps": rate},
                },
            ),
            (
                video_conversation(),
                [],
                [frames_video(list(as_given), 2.0, 768, rule=rule)],
                {
                    "images": [],
                    "video": str(tmp / f"{arch}_given.npy"),
                    # the frames as they were taken: Qwen3VLProcessor's timestamps need their indices
                    "metadata": {"total_num_frames": 5, "fps": 2.0, "frames_indices": list(range(5))},
                },
            ),
        ]
        kiln[arch] = [
            encode_qwen(m, ims, tokenizer, image_processor, videos=videos, video_rule=rule)
            for m, ims, videos, _ in calls
        ]
        jobs.append(
            {
                "name": arch,
                "folder": str(folder),
                "processor": processor,
                "video_processor": video_processor,
                # the 25-frame video: the processor samples it; the 5 frames: as given
                "calls": [
                    {"text": qwen_text(m, tokenizer), "sample": i == 1, **call}
                    for i, (m, _, _, call) in enumerate(calls)
                ],
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


@pytest.mark.parametrize("arch", ARCHS)
def test_encoding_matches_the_qwen_processor(world, arch):
    kiln, refs, tmp = world
    enc, ref = kiln[arch][0], refs[arch][0]
    assert enc["input_ids"].tolist() == ref["input_ids"]
    assert enc["image_grid_thw"].tolist() == ref["image_grid_thw"] == ARCHS[arch][3]
    pixels = np.load(tmp / f"{arch}_pixel_values0.npy")
    assert pixels.shape == tuple(enc["pixel_values"].shape)
    assert np.abs(pixels - enc["pixel_values"].numpy()).max() < 0.05


@pytest.mark.parametrize("arch", ARCHS)
def test_video_encoding_matches_the_qwen_video_processor(world, arch):
    kiln, refs, tmp = world
    kiln, refs = kiln[arch], refs[arch]
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


def tokenizer_text(tmp, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tmp / "qwen3_vl").decode(ids)
