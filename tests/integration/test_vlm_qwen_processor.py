"""Kiln's Qwen2.5-VL and Qwen3-VL sample encoding against transformers' own Qwen2_5_VLProcessor and Qwen3VLProcessor.
The processors need a video processor that needs torchvision, which the training env's CPU torch lacks (PITFALLS.md),
so they run in vLLM's environment (.venv-serve: the CUDA build of torch, with torchvision, on CPU; one process for
both architectures, whose start-up is most of the time). On the same rendered conversation and
three images of different sizes, it must give the token ids `encode_qwen` gives (each <|image_pad|> expanded to
its image's tokens) and the same patch grids. Pixel values are compared loosely: .venv-serve's image processor is
the torchvision backend, Kiln's the PIL one (their bicubic resizes differ by ~0.015 in normalized units)."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from common.tools.fixtures import make_qwen2_5_vl, make_qwen3_vl
from common.tools.serving import serve_env, serve_venv
from recipes.vlm.data import IMAGE_TOKEN, render_turns
from recipes.vlm.qwen import IMAGE_SLOT, encode_qwen
from tests.unit.test_vlm_qwen import image

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

for job in json.loads(open(sys.argv[1]).read()):
    tokenizer = AutoTokenizer.from_pretrained(job["folder"])
    processor = getattr(transformers, job["processor"])(
        image_processor=AutoImageProcessor.from_pretrained(job["folder"]),
        tokenizer=tokenizer,
        video_processor=getattr(transformers, job["video_processor"])(),
        chat_template=tokenizer.chat_template,
    )
    images = [Image.open(p).convert("RGB") for p in job["images"]]
    enc = processor(text=[job["text"]], images=images, return_tensors="np")
    np.save(job["pixels"], enc["pixel_values"])
    print(json.dumps({"input_ids": enc["input_ids"][0].tolist(), "image_grid_thw": enc["image_grid_thw"].tolist()}))
"""

# model_type -> (its fixture, transformers' processor and video processor, the grids of the three images below: 28-px
# units for Qwen2.5-VL's 14-px patches, 32-px for Qwen3-VL's 16-px ones)
ARCHS = {
    "qwen2_5_vl": (
        make_qwen2_5_vl,
        "Qwen2_5_VLProcessor",
        "Qwen2VLVideoProcessor",
        [[1, 18, 12], [1, 4, 6], [1, 10, 16]],
    ),
    "qwen3_vl": (make_qwen3_vl, "Qwen3VLProcessor", "Qwen3VLVideoProcessor", [[1, 18, 12], [1, 4, 6], [1, 8, 14]]),
}
MESSAGES = [
    {"role": "user", "content": "Compare <image> and <image>.\n<image>"},
    {"role": "assistant", "content": "Five."},
]


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    """model_type -> (Kiln's encoding, the processor's: its ids and grids, and its pixel values) of one conversation
    with three images of different sizes."""
    from transformers import AutoImageProcessor, AutoTokenizer

    root = tmp_path_factory.mktemp("qwen_processors")
    images = [image(300, 200, 0), image(56, 84, 1), image(140, 224, 2)]
    paths = [str(root / f"image{i}.png") for i in range(len(images))]
    for im, path in zip(images, paths, strict=True):
        im.save(path)
    jobs, ours = [], {}
    for arch, (make, processor, video_processor, _) in ARCHS.items():
        folder = make(root / arch)
        tokenizer, image_processor = AutoTokenizer.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder)
        ours[arch] = encode_qwen(MESSAGES, images, tokenizer, image_processor)
        text, _ = render_turns(
            [{**m, "content": m["content"].replace(IMAGE_TOKEN, IMAGE_SLOT)} for m in MESSAGES], tokenizer
        )
        jobs.append(
            dict(
                folder=str(folder),
                text=text,
                images=paths,
                processor=processor,
                video_processor=video_processor,
                pixels=str(root / f"{arch}.npy"),
            )
        )
    (root / "jobs.json").write_text(json.dumps(jobs))
    (root / "reference.py").write_text(REFERENCE)
    proc = subprocess.run(
        [str(serve_venv() / "bin" / "python"), str(root / "reference.py"), str(root / "jobs.json")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    refs = [json.loads(line) for line in proc.stdout.strip().splitlines()[-len(jobs) :]]
    return {arch: (ours[arch], ref, np.load(job["pixels"])) for arch, ref, job in zip(ARCHS, refs, jobs, strict=True)}


@pytest.mark.parametrize("arch", ARCHS)
def test_encoding_matches_the_qwen_processor(encoded, arch):
    enc, ref, pixels = encoded[arch]
    assert enc["input_ids"].tolist() == ref["input_ids"]
    assert enc["image_grid_thw"].tolist() == ref["image_grid_thw"] == ARCHS[arch][3]
    assert pixels.shape == tuple(enc["pixel_values"].shape)
    assert np.abs(pixels - enc["pixel_values"].numpy()).max() < 0.05
