"""The VLM loader's plan inputs (data.pack_buffer): a raw sample's size measured without decoding its pixels equals
what the encoder then makes of it: Qwen2.5-VL's tokens and tower patches from the real processor (a tiny random
release folder, common/tools/fixtures.py) at several sizes and aspect ratios, and LLaVA's (conversations, digits)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from common.tools.fixtures import make_qwen2_5_vl
from recipes.vlm.inputs import measure_llava_qwen
from recipes.vlm.qwen import encode_llava_qwen


def raw_sample(messages: list[dict], sizes: list[tuple[int, int]]) -> dict:
    """A prepare_llava shard sample: its record and one JPEG per image."""
    from PIL import Image

    sample = {"json": json.dumps({"id": "s", "messages": messages, "num_images": len(sizes)}).encode()}
    for i, (h, w) in enumerate(sizes):
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG")
        sample[f"image{i}"] = buf.getvalue()
    return sample


@pytest.fixture(scope="module")
def processing(tmp_path_factory):
    from transformers import AutoImageProcessor, AutoTokenizer

    folder = make_qwen2_5_vl(tmp_path_factory.mktemp("qwen"), max_pixels=28 * 28 * 16)
    return AutoTokenizer.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder)


@pytest.mark.parametrize(
    "sizes",
    [[], [(300, 200)], [(56, 84), (140, 224), (1344, 224)], [(700, 1000)] * 4],
    ids=["text", "one", "three", "four"],
)
def test_qwen_measure_is_what_the_encoder_makes(processing, sizes):
    tokenizer, processor = processing
    prompt = "".join("<image>" for _ in sizes) + "Tell me about these, at some length please."
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": "They are pictures. " * 7}]
    sample = raw_sample(messages, sizes)
    enc = encode_llava_qwen(sample, tokenizer, processor)
    assert measure_llava_qwen(sample, tokenizer, processor) == (len(enc["input_ids"]), len(enc["pixel_values"]))


def test_llava_measure_is_what_the_encoder_makes():
    """LLaVA's measure (every image the tower's size) against `encode_llava` on a conversation with two images and a
    text-only one, and against `encode_sample` on a digits sample."""
    from data import prepare_vlm_digits as vd
    from recipes.vlm.data import encode_llava, encode_sample, measure_llava

    processor = vd.build_processor()
    per_image = vd.num_image_tokens(processor)
    for sizes in ([(16, 16), (40, 24)], []):
        prompt = "".join("<image>\n" for _ in sizes) + "What are these?"
        sample = raw_sample([{"role": "user", "content": prompt}, {"role": "assistant", "content": "Digits."}], sizes)
        enc = encode_llava(sample, processor)
        want = (len(enc["input_ids"]), len(sizes) * per_image)
        assert measure_llava(sample, processor, per_image, conversations=True) == want
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(buf, "PNG")
    digit = {
        "json": json.dumps({"question": "Which digit?", "answer": "Seven.", "label": 7}).encode(),
        "png": buf.getvalue(),
    }
    digit["cls"] = b"7"
    enc = encode_sample(digit, processor)
    assert measure_llava(digit, processor, per_image, conversations=False) == (len(enc["input_ids"]), per_image)
