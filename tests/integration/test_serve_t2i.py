"""The text-to-image images server (scripts/serve.py on a t2i export: recipes/t2i/serve.py over the shared
common/diffusion/server.py) on the export of the shared 12-step t2i_tiny run, driven by the official openai client.
References: diffusers' own StableDiffusion3Pipeline on the export with the same prompt, seed, steps and guidance;
the same requests sent one at a time; the server's own log of the batches it ran."""

from __future__ import annotations

import base64
import io
import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from scripts.kiln.serving import http, running_server
from tests.fixtures.t2i import IMAGE_SIZE, t2i_run_args

pytestmark = pytest.mark.integration

KEY = "kiln-t2i-key"
SIZE = f"{IMAGE_SIZE}x{IMAGE_SIZE}"
# Measured max pixel difference (of 255) between the served PNGs and diffusers' pipeline (output_type="pil"), and
# between a prompt batched with another and the same request alone: 0 (fp32 on CPU, the same ops). The bound leaves
# room for another BLAS's summation order.
MAX_PIXEL_DIFF = 1


@pytest.fixture(scope="module")
def export(trained, t2i_world):
    return trained(t2i_run_args(t2i_world)) / "export"


@pytest.fixture(scope="module")
def server(export, tmp_path_factory):
    log = tmp_path_factory.mktemp("t2i_serve") / "serve.log"
    # A long batching window, so that requests sent together surely share a batch.
    with running_server(
        export, "serve.batch_wait_ms=300", "serve.max_batch_images=8", log_path=log, env={"KILN_API_KEY": KEY}
    ) as base:
        yield base, openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120), log


def decode(result) -> np.ndarray:
    images = []
    for item in result.data:
        with Image.open(io.BytesIO(base64.b64decode(item.b64_json))) as im:
            assert im.format == "PNG"
            images.append(np.array(im))
    return np.stack(images)


def max_diff(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


def test_a_seeded_request_draws_what_diffusers_draws(server, export):
    from diffusers import StableDiffusion3Pipeline

    _, client, log = server
    prompt, seed, steps, guidance = "a picture of a handwritten 7", 1234, 5, 2.5
    served = decode(
        client.images.generate(
            model="t2i_tiny",
            prompt=prompt,
            n=2,
            size=SIZE,
            response_format="b64_json",
            extra_body={"seed": seed, "num_inference_steps": steps, "guidance_scale": guidance},
        )
    )
    assert "engine=torch" in log.read_text() and "as 't2i_tiny'" in log.read_text()
    info = json.loads((export / "kiln.json").read_text())
    pipe = StableDiffusion3Pipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(
        prompt,
        height=IMAGE_SIZE,
        width=IMAGE_SIZE,
        num_inference_steps=steps,
        guidance_scale=guidance,
        num_images_per_prompt=2,
        generator=torch.Generator().manual_seed(seed),
        max_sequence_length=info["max_sequence_length"],
        output_type="pil",
    ).images
    theirs = np.stack([np.array(im) for im in theirs])
    assert served.shape == (2, IMAGE_SIZE, IMAGE_SIZE, 3) and served.std() > 3
    diff = max_diff(served, theirs)
    print(f"max pixel difference, served vs diffusers' StableDiffusion3Pipeline: {diff} / 255")
    assert diff <= MAX_PIXEL_DIFF, diff
    assert max_diff(served[0], served[1]) > 20  # the request's two images are two draws
    # Not vacuous: another seed gives other images.
    other = decode(
        client.images.generate(
            prompt=prompt, n=2, extra_body={"seed": 99, "num_inference_steps": steps, "guidance_scale": guidance}
        )
    )
    assert max_diff(other, theirs) > 20


def test_two_prompts_in_one_batch_give_the_images_each_gives_alone(server):
    _, client, log = server
    asks = [("a handwritten 3", 5, 1.5), ("the digit 8", 6, 4.0)]  # (prompt, seed, guidance)

    def ask(prompt, seed, guidance):
        extra = {"seed": seed, "num_inference_steps": 4, "guidance_scale": guidance}
        return decode(client.images.generate(prompt=prompt, extra_body=extra))

    before = log.read_text().count("kiln: images batch:")
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda a: ask(*a), asks))
    batches = re.findall(r"kiln: images batch: (\d+) images from (\d+) requests", log.read_text())[before:]
    assert batches == [("2", "2")], batches  # they shared one denoising loop
    alone = [ask(*a) for a in asks]  # one request at a time: each its own batch
    diffs = [max_diff(t, a) for t, a in zip(together, alone)]
    print(f"max pixel difference, batched vs alone: {diffs} / 255")
    assert max(diffs) <= MAX_PIXEL_DIFF, diffs
    assert max_diff(alone[0], alone[1]) > 20  # two prompts, two seeds: two images


@pytest.mark.parametrize(
    "body, words",
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": "  "}, "prompt is empty"),
        ({"prompt": 7}, "prompt: Input should be a valid string"),
        ({"prompt": ["a 3", "a 4"]}, "prompt: Input should be a valid string"),
        ({"prompt": "a handwritten seven " * 40}, "longer than every text encoder of this model reads"),
        ({"prompt": "a 3", "n": 0}, "1 to 8 images"),
        ({"prompt": "a 3", "n": 9}, "1 to 8 images"),
        ({"prompt": "a 3", "num_inference_steps": 0}, "num_inference_steps=0 must be in 1..1000"),
        ({"prompt": "a 3", "guidance_scale": -1}, "guidance_scale=-1 must be in [0, 100]"),
        ({"prompt": "a 3", "guidance_scale": "high"}, "guidance_scale"),
        ({"prompt": "a 3", "size": "1024x1024"}, f"{SIZE} images only"),
    ],
)
def test_bad_requests_are_400_with_a_message_and_the_server_stays_up(server, body, words):
    base, _, _ = server
    request = urllib.request.Request(
        f"{base}/v1/images/generations",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"},
    )
    try:
        urllib.request.urlopen(request, timeout=60)
        code, text = 200, ""
    except urllib.error.HTTPError as exc:
        code, text = exc.code, exc.read().decode()
    assert code == 400 and words in json.loads(text)["error"]["message"], text
    assert http(f"{base}/health")[0] == 200


def test_the_key_is_required(server):
    base, _, _ = server
    no_key = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        no_key.images.generate(prompt="a 3")
    assert http(f"{base}/v1/models")[0] == 401
