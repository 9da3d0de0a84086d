"""Kiln's Qwen2.5-VL sample encoding against transformers' own Qwen2_5_VLProcessor. The processor needs a video
processor that needs torchvision, which the training env's CPU torch lacks (PITFALLS.md), so it runs in vLLM's
environment (.venv-serve: the CUDA build of torch, with torchvision, on CPU). On the same rendered conversation and
three images of different sizes, it must give the token ids `encode_qwen` gives (each <|image_pad|> expanded to
its image's tokens) and the same patch grids. Pixel values are compared loosely: .venv-serve's image processor is
the torchvision backend, Kiln's the PIL one (their bicubic resizes differ by ~0.015 in normalized units).

Videos the same way, against the processor's own Qwen2VLVideoProcessor on the same frames: one of 25 frames at
10 fps that it samples itself at 2 fps (do_sample_frames, the video's metadata) and resizes, one of 5 frames
(odd: padded with the last) already at a size the budget keeps, taken as sampled at 2 fps. Token ids, video grids
and second_per_grid_ts must be equal; the pixels of the video kept at its size too (to float rounding, as both
only rescale and normalize), those of the resized one within the resize difference. One reference process answers
every call (starting it is most of the test's time)."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from common.tools.fixtures import make_qwen2_5_vl
from common.tools.serving import serve_env, serve_venv
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
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLVideoProcessor

folder, job, out = sys.argv[1], json.loads(open(sys.argv[2]).read()), sys.argv[3]
tokenizer, image_processor = AutoTokenizer.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder)
processor = Qwen2_5_VLProcessor(
    image_processor=image_processor,
    tokenizer=tokenizer,
    # the image processor's pixel budget, as a release's one preprocessor_config.json gives both
    video_processor=Qwen2VLVideoProcessor(size=dict(image_processor.size)),
    chat_template=tokenizer.chat_template,
)
results = []
for i, call in enumerate(job):
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
            np.save(f"{out}/{pixels}{i}.npy", enc[pixels])
            result[grid] = enc[grid].tolist()
    if "second_per_grid_ts" in enc:
        result["second_per_grid_ts"] = np.asarray(enc["second_per_grid_ts"]).tolist()
    results.append(result)
print(json.dumps(results))
"""


def qwen_text(messages: list[dict], tokenizer) -> str:
    """The conversation as Qwen's chat template renders it, with a pad per image and video (the processor's input)."""
    slots = [
        {**m, "content": m["content"].replace(IMAGE_TOKEN, IMAGE_SLOT).replace(VIDEO_TOKEN, VIDEO_SLOT)}
        for m in messages
    ]
    return render_turns(slots, tokenizer)[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Kiln's encodings of three calls and the reference processor's answers to the same calls, in one process:
    three images of different sizes; an image and a 25-frame video at 10 fps (the processor samples it at 2 fps and
    resizes it: 100x150 is no multiple of 28); 5 frames taken as sampled at 2 fps, at a size the budget keeps."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tmp = tmp_path_factory.mktemp("qwen_processor")
    folder = make_qwen2_5_vl(tmp / "qwen")
    tokenizer, image_processor = AutoTokenizer.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder)
    images = [image(300, 200, 0), image(56, 84, 1), image(140, 224, 2)]
    paths = []
    for i, im in enumerate(images):
        paths.append(str(tmp / f"image{i}.png"))
        im.save(paths[-1])
    clips = [frames(25, 100, 150, 3), frames(5, 84, 56, 4)]
    for i, clip in enumerate(clips):
        np.save(tmp / f"clip{i}.npy", clip)
    compare = [
        {"role": "user", "content": "Compare <image> and <image>.\n<image>"},
        {"role": "assistant", "content": "Five."},
    ]
    calls = [
        (compare, images, [], {"images": paths}),
        (
            video_conversation(1),
            images[1:2],
            [frames_video(list(clips[0]), 2.0, 768, source_fps=10.0)],
            {"images": paths[1:2], "video": str(tmp / "clip0.npy"), "metadata": {"total_num_frames": 25, "fps": 10.0}},
        ),
        (
            video_conversation(),
            [],
            [frames_video(list(clips[1]), 2.0, 768)],
            {"images": [], "video": str(tmp / "clip1.npy"), "metadata": {"total_num_frames": 5, "fps": 2.0}},
        ),
    ]
    kiln = [encode_qwen(m, ims, tokenizer, image_processor, videos=videos) for m, ims, videos, _ in calls]
    job = [
        {"text": qwen_text(m, tokenizer), "sample": i == 1, **call} for i, (m, _, _, call) in enumerate(calls)
    ]  # the 25-frame video: the processor samples it; the 5 frames: as given
    (tmp / "job.json").write_text(json.dumps(job))
    (tmp / "reference.py").write_text(REFERENCE)
    proc = subprocess.run(
        [str(serve_venv() / "bin" / "python"), str(tmp / "reference.py"), str(folder), str(tmp / "job.json"), str(tmp)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return kiln, json.loads(proc.stdout.strip().splitlines()[-1]), tmp


def test_encoding_matches_the_qwen_processor(world):
    kiln, refs, tmp = world
    enc, ref = kiln[0], refs[0]
    assert enc["input_ids"].tolist() == ref["input_ids"]
    assert enc["image_grid_thw"].tolist() == ref["image_grid_thw"] == [[1, 18, 12], [1, 4, 6], [1, 10, 16]]
    pixels = np.load(tmp / "pixel_values0.npy")
    assert pixels.shape == tuple(enc["pixel_values"].shape)
    assert np.abs(pixels - enc["pixel_values"].numpy()).max() < 0.05


def test_video_encoding_matches_the_qwen_video_processor(world):
    kiln, refs, tmp = world
    diffs = []
    for i, (enc, ref) in enumerate(zip(kiln[1:], refs[1:], strict=True), start=1):
        assert enc["input_ids"].tolist() == ref["input_ids"]
        assert enc["video_grid_thw"].tolist() == ref["video_grid_thw"]
        assert enc["second_per_grid_ts"].tolist() == ref["second_per_grid_ts"]
        pixels = np.load(tmp / f"pixel_values_videos{i}.npy")
        assert pixels.shape == tuple(enc["pixel_values_videos"].shape)
        diffs.append(float(np.abs(pixels - enc["pixel_values_videos"].numpy()).max()))
    assert kiln[1]["image_grid_thw"].tolist() == refs[1]["image_grid_thw"] == [[1, 4, 6]]
    print(f"max |pixel_values_videos - processor's| resized, kept at size: {diffs}")
    assert [r["video_grid_thw"] for r in refs[1:]] == [[[2, 8, 10]], [[3, 6, 4]]]
    assert [r["second_per_grid_ts"] for r in refs[1:]] == [[1.25], [1.0]]  # 2 / (4 of 25 frames x 10 fps), 2 / 2
    assert diffs[0] < 0.05 and diffs[1] < 1e-5
