"""The DiT images server (scripts/serve.py on a DiT export: recipes/dit/serve.py) on the export of a real
dit_tiny run, driven by the official openai client. References: scripts/sample_dit.py with the same seed
on PyTorch (the model as trained; the server runs the fp32 ONNX graph on onnxruntime), PNG decoding by
PIL, and the server's own log of the batches it ran."""

from __future__ import annotations

import base64
import io
import json
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime  # noqa: F401  (a declared dependency: imported, never skipped)
import openai
import pytest
from PIL import Image

from scripts.kiln.serving import http, running_server
from tests.conftest import FAST_DIT, load_script, run_train

pytestmark = pytest.mark.integration

KEY = "kiln-images-key"
MAX_PIXEL_DIFF = 2  # of 255: PyTorch vs onnxruntime after the whole sampler (as tests/integration/test_dit_onnx.py)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A short dit_tiny run's export (10 classes "0".."9", 16x16 grayscale) with its fp32 ONNX graph."""
    run = tmp_path_factory.mktemp("dit_serve")
    run_train([*FAST_DIT, f"run.dir={run}", "trainer.max_steps=4", "trainer.eval=false", "checkpoint.final=false"])
    assert load_script("export_dit").main([str(run / "export"), "--precision", "fp32"]) == 0
    return run / "export"


@pytest.fixture(scope="module")
def server(export):
    log = export.parent / "serve.log"
    # A long batching window, so that the concurrent test's requests surely share batches.
    with running_server(
        export, "serve.batch_wait_ms=300", "serve.max_batch_images=8", log_path=log, env={"KILN_API_KEY": KEY}
    ) as base:
        yield base, openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120), log


def decode(item) -> np.ndarray:
    with Image.open(io.BytesIO(base64.b64decode(item.b64_json))) as im:
        assert im.format == "PNG"
        return np.array(im)


def test_generate_returns_pngs_of_the_models_size(server):
    base, client, log = server
    result = client.images.generate(model="dit_tiny", prompt="3", n=2, size="16x16", response_format="b64_json")
    images = [decode(item) for item in result.data]
    assert len(images) == 2 and all(im.shape == (16, 16) and im.dtype == np.uint8 for im in images)
    assert "engine=onnxruntime" in log.read_text()


def test_a_seeded_request_equals_sample_dit_with_that_seed(server, export, tmp_path):
    """Sent among others that share its batch, a seeded request still gets sample_dit.py's images."""
    _, client, _ = server
    ask = dict(model="dit_tiny", n=2, extra_body={"seed": 1234, "num_inference_steps": 8})
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(client.images.generate, prompt=str(c), **ask) for c in (1, 2, 4)]
        ours = client.images.generate(prompt="7", **ask)
        [f.result() for f in others]
    served = np.stack([decode(item) for item in ours.data])
    folder = tmp_path / "sampled"
    assert (
        load_script("sample_dit").main(
            [
                str(export),
                "backend=torch",
                "classes=7",
                "per_class=2",
                "seed=1234",
                "steps=8",
                f"out={tmp_path / 'grid.png'}",
                f"images={folder}",
            ]
        )
        == 0
    )
    sampled = np.stack([np.array(Image.open(p)) for p in sorted(folder.glob("*.png"))])
    assert sampled.shape == served.shape == (2, 16, 16)
    diff = np.abs(served.astype(np.int16) - sampled.astype(np.int16)).max()
    print(f"max pixel difference, served vs sample_dit.py: {diff} / 255")
    assert diff <= MAX_PIXEL_DIFF, diff
    # Not vacuous: another seed gives other images.
    other = np.stack(
        [
            decode(i)
            for i in client.images.generate(
                prompt="7", **{**ask, "extra_body": {"seed": 99, "num_inference_steps": 8}}
            ).data
        ]
    )
    assert np.abs(other.astype(np.int16) - sampled.astype(np.int16)).max() > 20


def test_eight_concurrent_requests_are_answered_in_shared_batches(server):
    _, client, log = server
    before = log.read_text().count("kiln: images batch:")
    with ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(
                lambda c: client.images.generate(prompt=str(c % 10), extra_body={"num_inference_steps": 4}), range(8)
            )
        )
    assert all(len(r.data) == 1 and decode(r.data[0]).shape == (16, 16) for r in results)
    batches = [
        (int(n), int(k))
        for n, k in re.findall(r"kiln: images batch: (\d+) images from (\d+) requests", log.read_text())
    ][before:]
    print(f"batches (images, requests): {batches}")
    assert sum(n for n, _ in batches) == 8 and max(k for _, k in batches) > 1, batches


def test_an_unknown_class_is_a_400_naming_valid_ones(server):
    _, client, _ = server
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="a cat")
    message = str(info.value)
    assert "'a cat' is not a class" in message and "'0', '1', '2'" in message


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b'{"prompt": "3",', 400, "not valid JSON"),
        (json.dumps({"prompt": "3", "size": "64x64"}).encode(), 400, "16x16 images only"),
        (json.dumps({"prompt": "3", "response_format": "url"}).encode(), 400, "only b64_json"),
        (json.dumps({"prompt": "3", "n": 9}).encode(), 400, "1 to 8 images"),
        (json.dumps({"prompt": "3", "style": "vivid"}).encode(), 400, "Extra inputs are not permitted"),
        (json.dumps({"prompt": "3", "model": "dall-e-3"}).encode(), 404, "does not exist"),
    ],
)
def test_bad_requests_are_4xx_with_a_message_and_the_server_stays_up(server, body, status, words):
    base, _, _ = server
    import urllib.request

    request = urllib.request.Request(
        f"{base}/v1/images/generations",
        data=body,
        headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"},
    )
    try:
        urllib.request.urlopen(request, timeout=60)
        code, text = 200, ""
    except urllib.error.HTTPError as exc:
        code, text = exc.code, exc.read().decode()
    assert code == status and words in json.loads(text)["error"]["message"], text
    assert http(f"{base}/health")[0] == 200


def test_the_key_is_required(server):
    base, _, _ = server
    no_key = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        no_key.images.generate(prompt="3")
    assert http(f"{base}/v1/models")[0] == 401


@pytest.mark.gpu
def test_the_tensorrt_engine_serves_what_pytorch_samples(export, tmp_path):
    """On a GPU with TensorRT: auto picks the engine scripts/export_dit.py builds, and a seeded request is
    PyTorch's image within the fp16 engine's bound."""
    import shutil

    pytest.importorskip("tensorrt", reason="the tensorrt package is not installed")
    if shutil.which("trtexec") is None:
        pytest.skip("trtexec is not on PATH")
    gpu_export = tmp_path / "export"
    shutil.copytree(export, gpu_export, ignore=shutil.ignore_patterns("onnx"))
    assert load_script("export_dit").main([str(gpu_export), "--precision", "fp16", "--max-batch", "16"]) == 0
    with running_server(gpu_export, log_path=tmp_path / "serve.log") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        served = decode(client.images.generate(prompt="5", extra_body={"seed": 3, "num_inference_steps": 8}).data[0])
    assert "engine=tensorrt" in (tmp_path / "serve.log").read_text()
    folder = tmp_path / "sampled"
    assert (
        load_script("sample_dit").main(
            [
                str(gpu_export),
                "backend=torch",
                "classes=5",
                "per_class=1",
                "seed=3",
                "steps=8",
                f"out={tmp_path / 'grid.png'}",
                f"images={folder}",
            ]
        )
        == 0
    )
    sampled = np.array(Image.open(next(folder.glob("*.png"))))
    assert np.abs(served.astype(np.int16) - sampled.astype(np.int16)).max() <= 8  # fp16 engine vs fp32 PyTorch
