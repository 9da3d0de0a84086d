"""Kiln's Qwen2.5-VL sample encoding against transformers' own Qwen2_5_VLProcessor. The processor needs a video
processor that needs torchvision, which the training env's CPU torch lacks (PITFALLS.md), so it runs in vLLM's
environment (.venv-serve: the CUDA build of torch, with torchvision, on CPU). On the same rendered conversation and
three images of different sizes, it must give the token ids `encode_qwen` gives (each <|image_pad|> expanded to
its image's tokens) and the same patch grids. Pixel values are compared loosely: .venv-serve's image processor is
the torchvision backend, Kiln's the PIL one (their bicubic resizes differ by ~0.015 in normalized units)."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from common.tools.fixtures import make_qwen2_5_vl
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
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLVideoProcessor

folder, job, pixels = sys.argv[1], json.loads(open(sys.argv[2]).read()), sys.argv[3]
tokenizer = AutoTokenizer.from_pretrained(folder)
processor = Qwen2_5_VLProcessor(
    image_processor=AutoImageProcessor.from_pretrained(folder),
    tokenizer=tokenizer,
    video_processor=Qwen2VLVideoProcessor(),
    chat_template=tokenizer.chat_template,
)
images = [Image.open(p).convert("RGB") for p in job["images"]]
enc = processor(text=[job["text"]], images=images, return_tensors="np")
np.save(pixels, enc["pixel_values"])
print(json.dumps({"input_ids": enc["input_ids"][0].tolist(), "image_grid_thw": enc["image_grid_thw"].tolist()}))
"""


def test_encoding_matches_the_qwen_processor(tmp_path):
    from transformers import AutoImageProcessor, AutoTokenizer

    folder = make_qwen2_5_vl(tmp_path / "qwen")
    tokenizer, image_processor = AutoTokenizer.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder)
    images = [image(300, 200, 0), image(56, 84, 1), image(140, 224, 2)]
    messages = [
        {"role": "user", "content": "Compare <image> and <image>.\n<image>"},
        {"role": "assistant", "content": "Five."},
    ]
    enc = encode_qwen(messages, images, tokenizer, image_processor)
    text, _ = render_turns(
        [{**m, "content": m["content"].replace(IMAGE_TOKEN, IMAGE_SLOT)} for m in messages], tokenizer
    )
    paths = []
    for i, im in enumerate(images):
        paths.append(str(tmp_path / f"image{i}.png"))
        im.save(paths[-1])
    (tmp_path / "job.json").write_text(json.dumps({"text": text, "images": paths}))
    (tmp_path / "reference.py").write_text(REFERENCE)
    proc = subprocess.run(
        [
            str(serve_venv() / "bin" / "python"),
            str(tmp_path / "reference.py"),
            str(folder),
            str(tmp_path / "job.json"),
            str(tmp_path / "pixels.npy"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    ref = json.loads(proc.stdout.strip().splitlines()[-1])
    assert enc["input_ids"].tolist() == ref["input_ids"]
    assert enc["image_grid_thw"].tolist() == ref["image_grid_thw"] == [[1, 18, 12], [1, 4, 6], [1, 10, 16]]
    pixels = np.load(tmp_path / "pixels.npy")
    assert pixels.shape == tuple(enc["pixel_values"].shape)
    assert np.abs(pixels - enc["pixel_values"].numpy()).max() < 0.05
