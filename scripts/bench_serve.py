#!/usr/bin/env python
"""Serving benchmark, side by side in one run: the CPU serving engine (transformers serve, continuous
batching) at 1, 4 and 16 concurrent requests vs one-at-a-time `model.generate` on the same LLM export
and prompts; and onnxruntime vs eager PyTorch DiT denoising steps/s.

    python scripts/bench_serve.py [--llm EXPORT_DIR] [--quick] [--markdown OUT.md] [--only llm|dit]

Without --llm, llm_tiny is trained briefly into a temporary folder. The DiT is dit_tiny built from
its recipe config (speed does not depend on the weights). `main(argv)` returns the markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llm", help="an llm_tiny-style export folder (default: train llm_tiny briefly)")
    p.add_argument("--requests", type=int, default=16, help="requests per measurement (same prompts everywhere)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--concurrency", default="1,4,16", help="concurrent requests to the server, comma-separated")
    p.add_argument("--dit-steps", type=int, default=50, help="DDIM steps per DiT sampling run")
    p.add_argument("--dit-images", default="1,20", help="images per DiT sampling run (CFG doubles the batch)")
    # One thread by default: these models are too small to gain from more, and on a shared machine a
    # second OpenMP thread waiting at barriers for a busy core made model.generate over 10x slower (measured).
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of every engine (server, generate, ORT)")
    p.add_argument("--repeat", type=int, default=3, help="runs per cell; the fastest counts (timeit's rule: "
                   "slower runs measure other load on the machine, not the engine)")
    p.add_argument("--only", choices=("llm", "dit"), help="run one of the two benchmarks")
    p.add_argument("--quick", action="store_true", help="fewer tokens and DiT steps (about a minute)")
    p.add_argument("--markdown", help="also write the tables to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.max_tokens, args.dit_steps, args.repeat = min(args.max_tokens, 32), min(args.dit_steps, 10), 1
    return args


def prompts(n: int) -> list[str]:
    """The first words of n Python help topics: text like what llm_tiny was trained on."""
    from pydoc_data.topics import topics

    return [" ".join(topics[name].split()[:8]) for name in sorted(topics)[:n]]


def train_llm(run_dir: Path) -> Path:
    cmd = [sys.executable, str(REPO / "scripts" / "train.py"), "recipe=llm_tiny", "trainer.max_steps=30",
           f"run.dir={run_dir}", "trainer.progress_bar=false", "trainer.eval=false", "checkpoint.final=false"]
    print(f"bench_serve: training llm_tiny briefly into {run_dir}", flush=True)
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return run_dir / "export"


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


def bench_server(export: Path, texts: list[str], max_tokens: int, levels: list[int], threads: int, repeat: int,
                 log: Path) -> dict[int, tuple]:
    """{concurrency: (generated tokens, seconds)} through scripts/serve.py (engine=transformers)."""
    from common.tools.serving import running_server

    name = "bench"
    results = {}
    with running_server(export, "serve.engine=transformers", f"serve.served_model_name={name}", log_path=log,
                        env={"OMP_NUM_THREADS": str(threads)}) as base:
        asyncio.run(_completions(base, name, texts[:2], max_tokens, 2))  # warm-up: loads CB, its cache, kernels
        for c in levels:
            results[c] = best([asyncio.run(_completions(base, name, texts, max_tokens, c)) for _ in range(repeat)])
            print(f"bench_serve: server, {c} concurrent: {results[c][0] / results[c][1]:.0f} tokens/s", flush=True)
    return results


def llm_table(args: argparse.Namespace, workdir: Path) -> str:
    export = Path(args.llm) if args.llm else train_llm(workdir / "llm_tiny")
    texts = prompts(args.requests)
    levels = [int(c) for c in args.concurrency.split(",")]
    gen_tokens, gen_s = bench_generate(export, texts, args.max_tokens, args.repeat)
    base_rate = gen_tokens / gen_s
    print(f"bench_serve: model.generate one at a time: {base_rate:.0f} tokens/s", flush=True)
    served = bench_server(export, texts, args.max_tokens, levels, args.threads, args.repeat, workdir / "serve.log")
    rows = [("`model.generate`, one request at a time", gen_tokens, gen_s)]
    rows += [(f"transformers serve (CB), {c} concurrent", *served[c]) for c in levels]
    lines = [f"LLM serving on CPU ({args.llm or 'llm_tiny trained 30 steps'}; {args.requests} requests of "
             f"{args.max_tokens} new tokens, greedy; {args.threads} thread(s) per engine; best of {args.repeat})", "",
             "| engine | tokens | seconds | tokens/s | vs generate |", "|---|---:|---:|---:|---:|"]
    for label, tokens, secs in rows:
        lines.append(f"| {label} | {tokens} | {secs:.2f} | {tokens / secs:.0f} | {tokens / secs / base_rate:.2f}x |")
    return "\n".join(lines)


def dit_table(args: argparse.Namespace, workdir: Path) -> str:
    import torch

    from common.launch import compose
    from recipes.dit.model import build_model, null_class
    from recipes.dit.objective import ddpm_scheduler
    from recipes.dit.onnx import OnnxDiT, check_parity, export_onnx
    from recipes.dit.sampling import sample_images

    cfg = compose(["recipe=dit_tiny"])
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.data.image_size).eval()
    size, channels = cfg.data.image_size, cfg.model.in_channels
    onnx_path = export_onnx(model, workdir / "dit.onnx", image_size=size, in_channels=channels)
    parity = max(check_parity(model, onnx_path).values())  # raises above 1e-5: never time a wrong graph
    backends = {"torch": model, "onnxruntime": OnnxDiT(onnx_path, threads=args.threads)}
    scheduler = dict(ddpm_scheduler(cfg.diffusion).config)

    def steps_per_s(backend, images: int) -> float:
        labels = torch.arange(images) % cfg.model.num_classes
        run = lambda steps: sample_images(  # noqa: E731
            backend, scheduler, labels, null_class=null_class(model), image_size=size, in_channels=channels,
            steps=steps, guidance_scale=cfg.diffusion.guidance_scale, generator=torch.Generator().manual_seed(0),
            device=torch.device("cpu"))
        run(2)  # warm-up
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            run(args.dit_steps)
            times.append(time.perf_counter() - start)
        return args.dit_steps / min(times)

    lines = [f"DiT denoising on CPU (dit_tiny, {size}x{size}, CFG, {args.dit_steps} DDIM steps, {args.threads} thread(s); "
             f"best of {args.repeat}; onnxruntime vs PyTorch max rel err {parity:.1e})", "",
             "| images per run | PyTorch eager steps/s | onnxruntime steps/s | onnxruntime / PyTorch |",
             "|---:|---:|---:|---:|"]
    for images in (int(i) for i in args.dit_images.split(",")):
        rates = {name: steps_per_s(backend, images) for name, backend in backends.items()}
        print(f"bench_serve: DiT {images} images: {rates}", flush=True)
        lines.append(f"| {images} | {rates['torch']:.1f} | {rates['onnxruntime']:.1f} | "
                     f"{rates['onnxruntime'] / rates['torch']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    import torch

    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-serve-") as tmp:
        tables = []
        if args.only in (None, "llm"):
            tables.append(llm_table(args, Path(tmp)))
        if args.only in (None, "dit"):
            tables.append(dit_table(args, Path(tmp)))
    markdown = "\n\n".join(tables) + "\n"
    print("\n" + markdown)
    if args.markdown:
        Path(args.markdown).write_text(markdown)
    return markdown


if __name__ == "__main__":
    main()
