"""The VLM loader's plan inputs (data.pack_buffer): a raw sample's size measured without decoding its pixels equals
what the encoder then makes of it: Qwen2.5-VL's tokens and tower patches from the real processor (a tiny random
release folder, data/tiny_bases.py) at several sizes and aspect ratios, Qwen2.5-VL's and Qwen3-VL's with a
video (a container, frame files), and LLaVA's (conversations, digits)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from data.tiny_bases import make_qwen2_5_vl, make_qwen3_vl
from recipes.vlm.archs import QWEN_ARCHS
from recipes.vlm.inputs import measure_llava_qwen
from recipes.vlm.qwen import encode_llava_qwen
from recipes.vlm.video import read_video_config
from tests.support.video import encode_video


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
    video = read_video_config(folder, QWEN_ARCHS["qwen2_5_vl"].video)
    return AutoTokenizer.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder), video


@pytest.mark.parametrize(
    "sizes",
    [[], [(300, 200)], [(56, 84), (140, 224), (1344, 224)], [(700, 1000)] * 4],
    ids=["text", "one", "three", "four"],
)
def test_qwen_measure_is_what_the_encoder_makes(processing, sizes):
    tokenizer, processor, video = processing
    prompt = "".join("<image>" for _ in sizes) + "Tell me about these, at some length please."
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": "They are pictures. " * 7}]
    sample = raw_sample(messages, sizes)
    enc = encode_llava_qwen(sample, tokenizer, processor, video_config=video)
    measure = measure_llava_qwen(sample, tokenizer, processor, video_config=video)
    assert measure == (len(enc["input_ids"]), len(enc["pixel_values"]))


@pytest.fixture(scope="module")
def processing3(tmp_path_factory):
    from transformers import AutoImageProcessor, AutoTokenizer

    # its video processor's budget (over the clip) is not its image processor's: the measure takes the video's
    folder = make_qwen3_vl(tmp_path_factory.mktemp("qwen3"))
    video = read_video_config(folder, QWEN_ARCHS["qwen3_vl"].video)
    return AutoTokenizer.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder), video


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize(
    "video",
    # 25 frames at 10 fps in a container, sampled at 2 fps (an MP4 that records its frame count, a Matroska that
    # does not); 7 frame files taken at 5 fps, sampled the same way; 5 frame files taken as sampled
    [("mp4", 25, 10), ("mkv", 25, 10), ("frames", 7, 5.0), ("frames", 5, None)],
    ids=["mp4", "mkv", "frames-at-a-rate", "frames-as-sampled"],
)
def test_qwen_measure_counts_the_video(processing, processing3, arch, video):
    """A sample with an image and a video: the measure (frame count, rate and size from the container's stream or
    the record and the first frame file's header, no frame decoded) equals the encoder's tokens (Qwen3-VL's
    timestamp texts included) and its image's and video's tower patches, with the frames at a size each budget
    resizes (over one frame for Qwen2.5-VL, over the clip for Qwen3-VL)."""
    tokenizer, processor, video_config = processing if arch == "qwen2_5_vl" else processing3
    kind, n, rate = video
    messages = [
        {"role": "user", "content": "<image>\nFirst this, then this: <video>\nWhat happens?"},
        {"role": "assistant", "content": "Something moves. " * 3},
    ]
    sample = raw_sample(messages, [(90, 130)])
    record = json.loads(sample["json"])
    clip = np.random.default_rng(7).integers(0, 256, (n, 150, 100, 3), dtype=np.uint8)
    if kind == "frames":
        from PIL import Image

        record["video"] = {"frames": n, "fps": rate}
        for i, frame in enumerate(clip):
            buf = io.BytesIO()
            Image.fromarray(frame).save(buf, "PNG")
            sample[f"frame{i}"] = buf.getvalue()
    else:
        record["video"] = {"container": kind}
        sample["video"] = encode_video(clip, rate, kind)
    sample["json"] = json.dumps(record).encode()
    enc = encode_llava_qwen(sample, tokenizer, processor, video_config=video_config)
    patches = len(enc["pixel_values"]) + len(enc["pixel_values_videos"])
    measure = measure_llava_qwen(sample, tokenizer, processor, video_config=video_config)
    assert len(enc["video_grid_thw"]) == 1 and measure == (len(enc["input_ids"]), patches)


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
