"""Host memory and wall time of loading a Hugging Face Llama checkpoint: Kiln's sharded model.init_from
(1 rank, tp=2, pp=2, dp=2) next to transformers' from_pretrained in one process.

Builds a random LlamaForCausalLM checkpoint once (meta init, filled in place, save_pretrained in 4
safetensors shards with an index, like Llama 3.1 8B's 4 files), 0.5B parameters (--quick: 50M), in
fp32: the dtype of the training weights, so a rank holding half of the model holds half of the
checkpoint's bytes. Each measurement runs in fresh processes (scripts/kiln/processes.py's spawn_ranks:
torch.multiprocessing spawn, 1 thread each, results back as JSON): a rank records its resident set
(VmRSS) after imports and process-group start as its baseline, resets the kernel's peak counter
(/proc/self/clear_refs), builds its part of the model as the trainer does (recipes/llm/train.py:
build_model: meta, split, parallelize, allocate) and fills it from the checkpoint (recipes/llm/weights.py:
load_weights), reads every weight once, then reads the peak (VmHWM). The peak counts every resident
page, mapped safetensors pages included.

Target: each of 2 ranks peaks at no more than 0.6x the checkpoint's bytes above its baseline.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from scripts.benchmarks.report import Section, Target, md_table, say

TARGET = 0.6
# ~0.50B and ~50M parameters (untied, GQA); 4 shards either way.
SIZES = {
    "full": dict(
        hidden_size=1536,
        intermediate_size=4096,
        num_hidden_layers=16,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
    "quick": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=14,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8000,
    ),
}
LAYOUTS = {
    "kiln, 1 rank": (1, []),
    "kiln, tp=2": (2, ["parallel.tp=2"]),
    "kiln, pp=2": (2, ["parallel.pp=2"]),
    "kiln, dp=2 (FSDP2)": (2, []),
}


def build_checkpoint(out: Path, size: str) -> int:
    """A random fp32 LlamaForCausalLM in ``out`` (4 safetensors shards); its bytes on disk."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SIZES[size], max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, dtype="float32")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(out, max_shard_size=nbytes // 4 + 1)
    _write_tokenizer(out)
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def _write_tokenizer(out: Path) -> None:
    """model.init_from wants a tokenizer in the folder; loading does not read it."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE()), bos_token="<s>", eos_token="</s>"
    ).save_pretrained(out)


def _status(field: str) -> int:
    """A /proc/self/status field (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS (Linux >= 4.0); the baseline."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _load_kiln(folder: str, extra: list[str]) -> dict:
    import torch

    from common.parallel_dims import ParallelDims
    from recipes.llm import weights
    from recipes.llm.train import build_model, llama_args
    from scripts.kiln.launch import compose

    cfg = compose(["recipe=llm_tiny", f"model.init_from={folder}", *extra])
    mesh = ParallelDims.from_config(cfg.parallel, torch.distributed.get_world_size()).build_mesh("cpu")
    args = llama_args(cfg, 0)
    baseline = _reset_peak()
    start = time.perf_counter()
    model = build_model(args, cfg, mesh, torch.device("cpu"))
    weights.load_weights(model, args, folder)
    return _loaded(model, baseline, start)


def _load_transformers(folder: str) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    baseline = _reset_peak()
    start = time.perf_counter()
    return _loaded(LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32), baseline, start)


def _loaded(model, baseline: int, start: float) -> dict:
    """Peak and time once every weight has been read: transformers 5 may leave weights as views of the
    mapped safetensors files, whose pages become resident only when first read."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    return {"peak": _status("VmHWM") - baseline, "seconds": time.perf_counter() - start}


def measure(folder: Path) -> dict[str, list[dict]]:
    """Per loader: each rank's {"peak": bytes above its baseline, "seconds"}, each loader in fresh processes."""
    from scripts.kiln.processes import spawn_ranks

    rows = {}
    with tempfile.TemporaryDirectory() as out:
        rows["transformers from_pretrained, 1 process"] = spawn_ranks(_load_transformers, (str(folder),), 1, out)
        for name, (world, extra) in LAYOUTS.items():
            rows[name] = spawn_ranks(_load_kiln, (str(folder), extra), world, out)
    return rows


def section(rows: dict[str, list[dict]], checkpoint_bytes: int, n_params: int) -> Section:
    gib = 2**30
    s = Section("loading", "Loading a Llama checkpoint: host memory per rank")
    table = [
        [
            name,
            len(ranks),
            " / ".join(f"{r['peak'] / gib:.2f}" for r in ranks),
            " / ".join(f"{r['peak'] / checkpoint_bytes:.2f}x" for r in ranks),
            f"{max(r['seconds'] for r in ranks):.1f}",
        ]
        for name, ranks in rows.items()
    ]
    s.notes.append(
        f"Loading a {n_params / 1e9:.2f}B-parameter Llama ({checkpoint_bytes / gib:.2f} GiB of fp32 "
        "safetensors in 4 shards); peak RSS above each process's baseline"
    )
    s.tables.append(
        md_table(["loader", "ranks", "peak RSS per rank (GiB)", "x checkpoint bytes", "wall time (s)"], table)
    )
    for name, ranks in rows.items():
        if len(ranks) == 2:
            worst = max(r["peak"] for r in ranks) / checkpoint_bytes
            s.targets.append(
                Target(
                    f"{name}: each of 2 ranks <= {TARGET}x the checkpoint's bytes above baseline",
                    f"worst {worst:.2f}x",
                    worst <= TARGET,
                )
            )
    s.data = {"checkpoint_bytes": checkpoint_bytes, "loaders": rows}
    return s


def run(opts) -> Section:
    size = opts.pick("full", "quick")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        say(f"loading: building a random {size}-size Llama checkpoint in {folder}")
        checkpoint_bytes = build_checkpoint(folder, size)
        say(f"loading: from_pretrained and Kiln's loader on {', '.join(LAYOUTS)}, fresh processes each")
        rows = measure(folder)
    return section(rows, checkpoint_bytes, checkpoint_bytes // 4)
