"""Triton Inference Server on a DiT export (scripts/serve.py serve.engine=triton, `make triton-env`): 16 one-image
requests through tritonclient one at a time vs all at once (Triton's dynamic batcher: one sampling loop for the requests
that arrive together), and Kiln's images server (serve.engine=onnxruntime) on the same export and requests.

The DiT is dit_tiny built from its recipe config (speed does not depend on the weights), with its fp32 ONNX graph; both
servers run that graph on ONNX Runtime (Triton inside its Python backend, with Kiln's sampler as a BLS model).
Requests are timed inside the client (scripts/triton_client.py; the openai client for the images server). Without
Triton's environment the section says so and measures nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from scripts.benchmarks.harness import fresh_dir
from scripts.benchmarks.report import Section, Target, md_table, say
from scripts.benchmarks.serving import dit_tiny_export, images_per_s

TARGET = 2.0  # 16 concurrent / one at a time through Triton, as the images server's dynamic batching gives (2.58x)


@dataclass(frozen=True)
class Config:
    requests: int = 16  # one-image requests per measurement
    steps: int = 10  # DDIM steps per request
    repeat: int = 1  # runs per cell; the fastest counts


def triton_rates(opts, cfg: Config, work, export) -> tuple[float, float]:
    """(images/s one request at a time, images/s all at once) through Triton."""
    from scripts.kiln.serving import running_server
    from scripts.kiln.triton import HEALTH, ask, triton_venv

    n, venv = cfg.requests, triton_venv()
    pairs = [[i % 10, i] for i in range(n)]
    with running_server(
        export,
        "serve.engine=triton",
        f"serve.max_batch_images={n}",
        health=HEALTH,
        log_path=work / "triton.log",
        env={"OMP_NUM_THREADS": str(opts.threads)},
    ) as base:
        ask(venv, base, "dit_tiny", pairs[:2], work / "warmup.npz", steps=2)

        def rate(concurrency: int) -> float:
            got = ask(venv, base, "dit_tiny", pairs, work / "got.npz", steps=cfg.steps, concurrency=concurrency)
            if not (got["status"] == 200).all():
                raise RuntimeError(f"Triton failed requests: {got['stderr'][-1000:]}")
            return n / got["seconds"]

        return max(rate(1) for _ in range(cfg.repeat)), max(rate(n) for _ in range(cfg.repeat))


def server_rates(opts, cfg: Config, work, export) -> tuple[float, float]:
    """(images/s one request at a time, images/s all at once) through Kiln's images server on onnxruntime."""
    from scripts.kiln.serving import running_server

    n = cfg.requests
    with running_server(
        export,
        "serve.engine=onnxruntime",
        f"serve.max_batch_images={n}",
        log_path=work / "images_server.log",
        env={"OMP_NUM_THREADS": str(opts.threads)},
    ) as base:
        images_per_s(base, 2, 2, 1)  # warm-up
        single = max(images_per_s(base, n, cfg.steps, 1) for _ in range(cfg.repeat))
        return single, max(images_per_s(base, n, cfg.steps, n) for _ in range(cfg.repeat))


def run(opts, cfg: Config | None = None) -> Section:
    from scripts.kiln.triton import check_env, triton_venv

    cfg = cfg or Config()
    n = cfg.requests
    s = Section("triton", f"Triton Inference Server (DiT): {n} concurrent requests vs one at a time")
    if problem := check_env(triton_venv()):
        s.notes.append(f"not measured: {problem}")
        return s
    work = fresh_dir(opts.work / "triton")
    export = dit_tiny_export(work / "dit_export")
    triton = triton_rates(opts, cfg, work, export)
    server = server_rates(opts, cfg, work, export)
    say(f"triton: {triton[0]:.1f} / {triton[1]:.1f} images/s; images server {server[0]:.1f} / {server[1]:.1f}")
    rows = [
        [name, f"{one:.1f}", f"{many:.1f}", f"{many / one:.2f}x", f"{many / server[1]:.2f}x"]
        for name, (one, many) in (("Triton (serve.engine=triton)", triton), ("Kiln's images server", server))
    ]
    s.tables.append(
        md_table(
            ["server", "images/s one at a time", f"images/s {n} concurrent", "concurrent / one", "vs images server"],
            rows,
        )
    )
    s.targets.append(
        Target(
            f"Triton {n} concurrent / one at a time (dynamic batching)",
            f"{triton[1] / triton[0]:.2f}x",
            triton[1] / triton[0] >= TARGET,
        )
    )
    s.notes.append(
        f"dit_tiny (16x16, CFG), {cfg.steps} DDIM steps, {n} one-image requests, best of {cfg.repeat}; both servers "
        "run the fp32 ONNX graph on ONNX Runtime (CPU)"
    )
    s.data.update(
        triton={"single_images_per_s": triton[0], "batched_images_per_s": triton[1]},
        images_server={"single_images_per_s": server[0], "batched_images_per_s": server[1]},
    )
    return s
