#!/usr/bin/env python
"""Ask a DiT on Triton (scripts/serve.py serve.engine=triton) for images with tritonclient, from Triton's own
environment (make triton-env): .venv-triton/bin/python scripts/triton_client.py URL MODEL [options].

    .venv-triton/bin/python scripts/triton_client.py 127.0.0.1:8000 dit_tiny --class 3 --seed 1 --out three.npz
    ... --requests '[[3, 1], [5, 2]]' --concurrency 16     # [class, seed] each, 16 in flight at a time

Writes an .npz: images [N, C, S, S] in [-1, 1] (NaN where a request failed), status [N] (200, or Triton's HTTP
status), seconds (the whole batch of requests, wall clock); prints one line per failed request. It imports only
tritonclient and numpy (no Kiln), so it runs where Triton's client is installed."""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def infer(client, model: str, label: int, seed: int, steps: int, guidance: float | None):
    """(image [C, S, S], 200) or (None, Triton's status) of one request of one image."""
    from tritonclient.http import InferInput, InferRequestedOutput
    from tritonclient.utils import InferenceServerException

    values = {"class_label": ("INT64", label), "seed": ("INT64", seed)}
    if steps:
        values["steps"] = ("INT32", steps)
    if guidance is not None:
        values["guidance_scale"] = ("FP32", guidance)
    inputs = []
    for name, (dtype, value) in values.items():
        tensor = InferInput(name, [1, 1], dtype)
        numpy_type = {"INT64": np.int64, "INT32": np.int32, "FP32": np.float32}[dtype]
        tensor.set_data_from_numpy(np.array([[value]], dtype=numpy_type))
        inputs.append(tensor)
    try:
        result = client.infer(model, inputs, outputs=[InferRequestedOutput("image")])
    except InferenceServerException as exc:
        print(f"triton_client: class {label} seed {seed}: {exc.status()} {exc.message()}", file=sys.stderr)
        return None, int(exc.status() or 0)
    return result.as_numpy("image")[0], 200


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url", help="host:port of Triton's HTTP endpoint")
    ap.add_argument("model", help="the sampler model's name (serve.served_model_name)")
    ap.add_argument("--class", dest="label", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", default="", help="JSON list of [class, seed] pairs (instead of --class/--seed)")
    ap.add_argument("--steps", type=int, default=0, help="0: the export's")
    ap.add_argument("--guidance", type=float, default=None, help="default: the export's")
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    ap.add_argument("--out", default="images.npz")
    args = ap.parse_args(argv)
    import tritonclient.http as httpclient

    pairs = json.loads(args.requests) if args.requests else [[args.label, args.seed]]
    client = httpclient.InferenceServerClient(args.url, concurrency=args.concurrency, network_timeout=600)
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(lambda p: infer(client, args.model, p[0], p[1], args.steps, args.guidance), pairs))
    seconds = time.perf_counter() - start
    shape = next((im.shape for im, _ in results if im is not None), (0,))
    images = np.stack([im if im is not None else np.full(shape, np.nan, np.float32) for im, _ in results])
    np.savez(args.out, images=images, status=np.array([s for _, s in results]), seconds=seconds)
    print(f"triton_client: {len(pairs)} requests, {sum(s == 200 for _, s in results)} answered, {seconds:.2f} s")
    return 0 if all(s == 200 for _, s in results) else 1


if __name__ == "__main__":
    sys.exit(main())
