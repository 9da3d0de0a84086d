"""A DiT export on the real Triton Inference Server (scripts/serve.py serve.engine=triton: .venv-triton's bundled
tritonserver on the model repository recipes/dit/triton.py writes), driven by tritonclient (scripts/triton_client.py).
References: Kiln's own sampler on the same export in this process (ExportSampler on onnxruntime; the graph against
PyTorch is tests/integration/test_dit_onnx.py's), Triton's own statistics for the batches it ran, and its HTTP
statuses. One server for the module; the export is a cached run's (tests/fixtures/layouts.py), with its fp32 ONNX
graph. Another family's export is refused in tests/unit/test_serve_config.py (no server needed)."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
import torch

from recipes.dit.onnx import ExportSampler
from scripts.kiln.serving import http, running_server
from scripts.kiln.triton import HEALTH, ask
from tests.conftest import load_script
from tests.fixtures.layouts import DIT, layout
from tests.fixtures.triton import NEEDS_TRITON

pytestmark = NEEDS_TRITON

MODEL = "dit_tiny"
STEPS = 5
# Max |Triton - Kiln's sampler on onnxruntime| in [-1, 1]: the same graph on the same ONNX Runtime, batched with other
# requests inside Triton, alone here.
MAX_DIFF = 1e-5
REQUESTS = [[3, 1], [7, 1234], [0, 5], [9, 77], [3, 2], [5, 5], [1, 8], [2, 9]]


@pytest.fixture(scope="module")
def export(layout_runs, tmp_path_factory):
    """A copy of a cached dit_tiny run's export (10 classes, 16x16 grayscale) with its fp32 ONNX graph."""
    folder = tmp_path_factory.mktemp("triton") / "export"
    shutil.copytree(layout_runs.full(DIT, *layout(1, 0, accum=2)) / "export", folder)
    assert load_script("export_dit").main([str(folder), "--precision", "fp32"]) == 0
    return folder


@pytest.fixture(scope="module")
def server(export, triton_env):
    log, start = export.parent / "triton.log", time.perf_counter()
    with running_server(
        export, "serve.engine=triton", "serve.max_batch_images=8", health=HEALTH, log_path=log, startup_s=240
    ) as base:
        print(f"Triton ready in {time.perf_counter() - start:.1f} s")
        yield base, log


def test_tritonclient_images_equal_kilns_sampler_and_share_batches(server, export, triton_env, tmp_path):
    base, _ = server
    got = ask(triton_env, base, MODEL, REQUESTS, tmp_path / "got.npz", steps=STEPS, concurrency=len(REQUESTS))
    assert (got["status"] == 200).all(), got["stderr"]
    # Kiln's sampler, one image at a time: each request's image does not depend on what shared its batch.
    sampler = ExportSampler(export, "onnxruntime")
    reference = torch.cat([sampler(torch.tensor([y]), noise=sampler.noise(1, s), steps=STEPS) for y, s in REQUESTS])
    images = torch.from_numpy(got["images"])
    diff = (images - reference).abs().max().item()
    print(f"Triton vs Kiln's sampler (onnxruntime, in this process): max |diff| {diff:.3g} in [-1, 1]")
    assert images.shape == (len(REQUESTS), 1, 16, 16)
    assert diff <= MAX_DIFF, diff
    assert (images[0] - images[4]).abs().max() > 0.1  # not vacuous: class 3 with another seed is another image
    # Triton's own count: the requests ran in fewer model executions than requests (dynamic batching).
    status, text = http(f"{base}/v2/models/{MODEL}/stats")
    stats = json.loads(text)["model_stats"][0]
    batches = [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]]
    print(f"Triton's batches (size, executions): {batches}")
    assert status == 200 and stats["inference_count"] == len(REQUESTS) > stats["execution_count"], stats


def test_malformed_requests_get_4xx_and_the_server_stays_up(server, triton_env, tmp_path):
    base, _ = server
    got = ask(triton_env, base, MODEL, [[10, 1], [-1, 1], [3, -5]], tmp_path / "bad.npz")
    assert got["status"].tolist() == [400, 400, 400], got["stderr"]
    assert "class_label [10]: the classes are 0..9" in got["stderr"] and "seeds are 0..2**63-1" in got["stderr"]
    missing = {"inputs": [{"name": "class_label", "shape": [1, 1], "datatype": "INT64", "data": [3]}]}
    status, text = http(f"{base}/v2/models/{MODEL}/infer", json.dumps(missing).encode())
    assert status == 400 and "seed" in text, (status, text)
    good = ask(triton_env, base, MODEL, [[4, 4]], tmp_path / "good.npz", steps=2)
    assert good["status"].tolist() == [200] and np.isfinite(good["images"]).all()
    assert http(f"{base}{HEALTH}")[0] == 200
