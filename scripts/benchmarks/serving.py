"""Serving, side by side in one run: vLLM (its build in .venv-serve, where `make serve-env` made one) and
transformers serve (continuous batching) at 1, 4 and 16 concurrent requests vs one-at-a-time
`model.generate` on the same LLM export and prompts; onnxruntime vs eager PyTorch DiT denoising steps/s;
and the DiT images server answering 16 requests one at a time vs all at once (dynamic batching).

llm_tiny is trained briefly (scripts/train.py in a subprocess) for its export; the server is scripts/serve.py
in a subprocess (scripts/kiln/serving.py), answering over HTTP. The DiT is dit_tiny built from its recipe
config (speed does not depend on the weights). Short runs in every mode (`make bench` always ran this
benchmark's quick settings): 32 new tokens per request, 10 DDIM steps, one run per cell.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.benchmarks.harness import fresh_dir, train_run
from scripts.benchmarks.report import Section, md_table, say


@dataclass(frozen=True)
class Config:
    requests: int = 16  # requests per measurement (same prompts everywhere)
    max_tokens: int = 32  # tokens generated per request
    concurrency: tuple[int, ...] = (1, 4, 16)  # concurrent requests to the server
    dit_steps: int = 10  # DDIM steps per DiT sampling run
    dit_images: tuple[int, ...] = (1, 20)  # images per DiT sampling run (CFG doubles the batch)
    # Runs per cell; the fastest counts (timeit's rule: slower runs measure other load on the machine, not the engine).
    repeat: int = 1
    llm_steps: int = 30  # llm_tiny's training run, for its export
    dit_server_requests: int = 16  # one-image requests to the DiT images server, per measurement


def prompts(n: int) -> list[str]:
    """The first words of n Python help topics: text like what llm_tiny was trained on."""
    from pydoc_data.topics import topics

    return [" ".join(topics[name].split()[:8]) for name in sorted(topics)[:n]]


def best(runs: list[tuple[int, float]]) -> tuple[int, float]:
    """The fastest of several (tokens, seconds) runs."""
    return max(runs, key=lambda r: r[0] / r[1])


def bench_generate(export: Path, texts: list[str], max_tokens: int, repeat: int) -> tuple[int, float]:
    """(generated tokens, seconds) of greedy `model.generate`, one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    encoded = [tokenizer(t, return_tensors="pt") for t in texts]
    kwargs = {"max_new_tokens": max_tokens, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}

    def run() -> tuple[int, float]:
        start = time.perf_counter()
        tokens = sum(model.generate(**e, **kwargs).shape[-1] - e["input_ids"].shape[-1] for e in encoded)
        return tokens, time.perf_counter() - start

    with torch.no_grad():
        model.generate(**encoded[0], **kwargs)  # warm-up
        return best([run() for _ in range(repeat)])


async def _completions(base: str, name: str, texts: list[str], max_tokens: int, concurrency: int) -> tuple[int, float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def one(text: str) -> int:
        async with gate:
            reply = await client.completions.create(model=name, prompt=text, max_tokens=max_tokens, temperature=0)
            return reply.usage.completion_tokens

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(t) for t in texts)))
    seconds = time.perf_counter() - start
    await client.close()
    return tokens, seconds


def bench_server(
    export: Path, texts: list[str], cfg: Config, engine: str, threads: int, log: Path
) -> tuple[dict[int, tuple], float]:
    """({concurrency: (generated tokens, seconds)}, start-up seconds) through scripts/serve.py on `engine`."""
    from scripts.kiln.serving import running_server

    name = "bench"
    overrides = [f"serve.engine={engine}", f"serve.served_model_name={name}", "serve.dtype=float32"]
    if engine == "vllm":
        overrides += ["serve.cpu_kvcache_gib=1"]
    results = {}
    start = time.perf_counter()
    # OMP_NUM_THREADS caps transformers serve's torch threads; vLLM's CPU build binds its own worker threads.
    with running_server(export, *overrides, log_path=log, startup_s=600, env={"OMP_NUM_THREADS": str(threads)}) as base:
        startup = time.perf_counter() - start
        say(f"serving: {engine} up in {startup:.0f} s")
        asyncio.run(_completions(base, name, texts[:2], cfg.max_tokens, 2))  # warm-up: caches, kernels
        for c in cfg.concurrency:
            results[c] = best(
                [asyncio.run(_completions(base, name, texts, cfg.max_tokens, c)) for _ in range(cfg.repeat)]
            )
            say(f"serving: {engine}, {c} concurrent: {results[c][0] / results[c][1]:.0f} tokens/s")
    return results, startup


def llm_table(opts, cfg: Config, work: Path, s: Section) -> None:
    from scripts.kiln.serving import serve_env

    say(f"serving: training llm_tiny for {cfg.llm_steps} steps for its export")
    run_dir = work / "llm_tiny"
    train_run(opts, "llm_tiny", [f"trainer.max_steps={cfg.llm_steps}"], run_dir)
    export, texts = run_dir / "export", prompts(cfg.requests)
    gen_tokens, gen_s = bench_generate(export, texts, cfg.max_tokens, cfg.repeat)
    base_rate = gen_tokens / gen_s
    say(f"serving: model.generate one at a time: {base_rate:.0f} tokens/s")
    engines = ["transformers"] + (["vllm"] if serve_env() is not None else [])
    served = {e: bench_server(export, texts, cfg, e, opts.threads, work / f"serve_{e}.log") for e in engines}
    label = {"transformers": "transformers serve (CB)", "vllm": f"vLLM ({serve_env()} build)"}
    rows = [("`model.generate`, one request at a time", gen_tokens, gen_s)]
    rows += [(f"{label[e]}, {c} concurrent", *served[e][0][c]) for e in engines for c in cfg.concurrency]
    s.notes.append(
        f"LLM serving on CPU (llm_tiny trained {cfg.llm_steps} steps; {cfg.requests} requests of "
        f"{cfg.max_tokens} new tokens, greedy, float32; {opts.threads} thread(s) for transformers; "
        f"best of {cfg.repeat}); start-up to /health: "
        + ", ".join(f"{label[e]} {served[e][1]:.0f} s" for e in engines)
        + ("" if "vllm" in served else "; no vLLM row: make serve-env builds its environment")
    )
    s.tables.append(
        md_table(
            ["engine", "tokens", "seconds", "tokens/s", "vs generate"],
            [
                [name, tokens, f"{secs:.2f}", f"{tokens / secs:.0f}", f"{tokens / secs / base_rate:.2f}x"]
                for name, tokens, secs in rows
            ],
        )
    )
    if "vllm" in served:
        top = max(cfg.concurrency)
        (vt, vs), (tt, ts) = served["vllm"][0][top], served["transformers"][0][top]
        ratio = (vt / vs) / (tt / ts)
        s.notes.append(f"vLLM / transformers serve at {top} concurrent: {ratio:.2f}x completion tokens/s")
        s.data["vllm_over_transformers"] = ratio
    s.data["llm"] = {
        "generate": {"tokens": gen_tokens, "seconds": gen_s},
        **{
            e: {"startup_s": up, **{c: {"tokens": t, "seconds": sec} for c, (t, sec) in r.items()}}
            for e, (r, up) in served.items()
        },
    }


def write_dit_export(model, recipe, folder: Path) -> Path:
    """An export folder laid out like DiTTrainer.export() for a model built from `recipe` (random weights:
    speed does not depend on them), with its fp32 ONNX graph where the images server's auto looks."""
    import json

    from common.diffusion.objective import sampling_scheduler
    from recipes.dit.model import null_class
    from recipes.dit.onnx import export_onnx

    d = recipe.diffusion
    model.save_pretrained(folder / "transformer", safe_serialization=True)
    sampling_scheduler(d).save_pretrained(folder / "scheduler")
    classes = [str(c) for c in range(recipe.model.num_classes)]
    (folder / "kiln.json").write_text(
        json.dumps(
            {
                "recipe": "dit_tiny",
                "image_size": recipe.data.image_size,
                "num_classes": len(classes),
                "classes": classes,
                "null_class": null_class(model),
                "sample_steps": d.sample_steps,
                "guidance_scale": d.guidance_scale,
            }
        )
    )
    return export_onnx(
        model, folder / "onnx" / "model.onnx", image_size=recipe.data.image_size, in_channels=recipe.model.in_channels
    )


def dit_tiny_export(folder: Path) -> Path:
    """dit_tiny built from its recipe config (seed 0) as an export (write_dit_export): the DiT the serving benchmarks
    serve."""
    import torch

    from recipes.dit.model import build_model
    from scripts.kiln.launch import compose

    recipe = compose(["recipe=dit_tiny"])
    torch.manual_seed(0)
    write_dit_export(build_model(recipe.model, recipe.data.image_size).eval(), recipe, folder)
    return folder


def images_per_s(base: str, requests: int, steps: int, concurrency: int) -> float:
    """Images/s of `requests` one-image requests to the images server, `concurrency` at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
    one = lambda i: client.images.generate(prompt=str(i % 10), extra_body={"seed": i, "num_inference_steps": steps})  # noqa: E731
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(requests)))
    return requests / (time.perf_counter() - start)


def dit_server_table(opts, cfg: Config, work: Path, model, recipe, s: Section) -> None:
    """The images server on onnxruntime: one request at a time vs all at once (dynamic batching)."""
    from scripts.kiln.serving import running_server

    export = work / "dit_export"
    write_dit_export(model, recipe, export)
    n = cfg.dit_server_requests
    with running_server(
        export,
        "serve.engine=onnxruntime",
        f"serve.max_batch_images={n}",
        log_path=work / "serve_dit.log",
        env={"OMP_NUM_THREADS": str(opts.threads)},
    ) as base:
        images_per_s(base, 2, 2, 1)  # warm-up
        single = max(images_per_s(base, n, cfg.dit_steps, 1) for _ in range(cfg.repeat))
        batched = max(images_per_s(base, n, cfg.dit_steps, n) for _ in range(cfg.repeat))
    say(f"serving: DiT images server: {single:.1f} images/s one at a time, {batched:.1f} images/s {n} at once")
    s.notes.append(
        f"DiT images server (scripts/serve.py, onnxruntime, {cfg.dit_steps} steps, {n} one-image requests; "
        f"best of {cfg.repeat}): batched / one at a time {batched / single:.2f}x images/s"
    )
    s.tables.append(
        md_table(
            ["DiT images server", "images/s", "vs one at a time"],
            [
                ["one request at a time", f"{single:.1f}", "1.00x"],
                [f"{n} concurrent (shared batches)", f"{batched:.1f}", f"{batched / single:.2f}x"],
            ],
        )
    )
    s.data["dit_server"] = {
        "single_images_per_s": single,
        "batched_images_per_s": batched,
        "batched_over_single": batched / single,
    }


def dit_table(opts, cfg: Config, work: Path, s: Section) -> None:
    import torch

    from common.diffusion.objective import ddpm_scheduler
    from common.diffusion.sampling import sample_images
    from recipes.dit.model import build_model, null_class
    from recipes.dit.onnx import OnnxDiT, check_parity, export_onnx
    from scripts.kiln.launch import compose

    recipe = compose(["recipe=dit_tiny"])
    torch.manual_seed(0)
    model = build_model(recipe.model, recipe.data.image_size).eval()
    size, channels = recipe.data.image_size, recipe.model.in_channels
    onnx_path = export_onnx(model, work / "dit.onnx", image_size=size, in_channels=channels)
    parity = max(check_parity(model, onnx_path).values())  # raises above 1e-5: never time a wrong graph
    backends = {"torch": model, "onnxruntime": OnnxDiT(onnx_path, threads=opts.threads)}
    scheduler = dict(ddpm_scheduler(recipe.diffusion).config)

    def steps_per_s(backend, images: int) -> float:
        labels = torch.arange(images) % recipe.model.num_classes
        run = lambda steps: sample_images(  # noqa: E731
            backend,
            scheduler,
            labels,
            null_class=null_class(model),
            image_size=size,
            in_channels=channels,
            steps=steps,
            guidance_scale=recipe.diffusion.guidance_scale,
            generator=torch.Generator().manual_seed(0),
            device=torch.device("cpu"),
        )
        run(2)  # warm-up
        times = []
        for _ in range(cfg.repeat):
            start = time.perf_counter()
            run(cfg.dit_steps)
            times.append(time.perf_counter() - start)
        return cfg.dit_steps / min(times)

    rows, rates = [], {}
    for images in cfg.dit_images:
        rates[images] = {name: steps_per_s(backend, images) for name, backend in backends.items()}
        say(f"serving: DiT {images} images: {rates[images]}")
        r = rates[images]
        rows.append([images, f"{r['torch']:.1f}", f"{r['onnxruntime']:.1f}", f"{r['onnxruntime'] / r['torch']:.2f}x"])
    s.notes.append(
        f"DiT denoising on CPU (dit_tiny, {size}x{size}, CFG, {cfg.dit_steps} DDIM steps, {opts.threads} "
        f"thread(s); best of {cfg.repeat}; onnxruntime vs PyTorch max rel err {parity:.1e})"
    )
    s.tables.append(
        md_table(["images per run", "PyTorch eager steps/s", "onnxruntime steps/s", "onnxruntime / PyTorch"], rows)
    )
    s.data["dit"] = {"steps_per_s": rates, "onnx_max_rel_err": parity}
    dit_server_table(opts, cfg, work, model, recipe, s)


def run(opts, cfg: Config | None = None) -> Section:
    cfg = cfg or Config()
    work = fresh_dir(opts.work / "serving")
    s = Section(
        "serving",
        "Serving: vLLM and transformers serve vs model.generate (LLM); onnxruntime vs PyTorch, "
        "and the images server batched vs one at a time (DiT)",
    )
    llm_table(opts, cfg, work, s)
    dit_table(opts, cfg, work, s)
    return s
