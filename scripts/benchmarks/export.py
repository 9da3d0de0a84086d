"""Host memory of exporting a ZeRO-3 checkpoint: scripts/export.py (streamed safetensors shards) next to DeepSpeed's
zero_to_fp32 (convert_zero_checkpoint_to_fp32_state_dict, safetensors) on the same checkpoint.

A widened dit_tiny (~5M parameters, --quick ~1.4M) trains one step on 2 ranks under ZeRO-3 in fp32 and saves its
checkpoint (fp32 masters + Adam moments + the EMA: tens of MB). Each exporter then runs in a fresh process
(scripts/kiln/processes.py's spawn_ranks, one rank): it records its resident set after imports as the baseline,
resets the kernel's peak counter, exports, and reads the peak (VmHWM): every resident page counts, mapped
checkpoint pages included. Both write the same number of fp32 weight bytes (Kiln the EMA, zero_to_fp32 the masters).

Target: Kiln's peak above baseline is at most half of zero_to_fp32's (its default 5GB shard holds the whole model).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from scripts.benchmarks.harness import fresh_dir, train_run
from scripts.benchmarks.loading import _reset_peak, _status
from scripts.benchmarks.report import Section, Target, md_table, say

TARGET = 0.5
SHARD = "2MB"  # Kiln's --max-shard-size here: a few of the model's largest tensors (1.5 MB in the full size)
WIDTHS = {
    "full": ["model.num_attention_heads=8", "model.attention_head_dim=32"],
    "quick": ["model.num_attention_heads=4", "model.attention_head_dim=32"],
}


def _imports() -> None:
    """What the exporters import, loaded in both processes before the baseline: the peak is what an export of
    this checkpoint costs, not the libraries' code and tables (~200 MiB for Kiln's DiT modules)."""
    import deepspeed.utils.zero_to_fp32  # noqa: F401
    import omegaconf  # noqa: F401
    import safetensors.torch  # noqa: F401

    import recipes.dit.export  # noqa: F401


def _kiln(run_dir: str, out: str) -> dict:
    import importlib.util

    from scripts.kiln.processes import REPO

    _imports()
    spec = importlib.util.spec_from_file_location("kiln_export", REPO / "scripts" / "export.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    baseline = _reset_peak()
    start = time.perf_counter()
    code = script.main([run_dir, "--out", out, "--max-shard-size", SHARD])
    if code:
        raise RuntimeError(f"scripts/export.py exited {code}")
    return _measured(baseline, start, out)


def _zero_to_fp32(checkpoints: str, tag: str, out: str) -> dict:
    _imports()
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    baseline = _reset_peak()
    start = time.perf_counter()
    convert_zero_checkpoint_to_fp32_state_dict(checkpoints, out, safe_serialization=True, tag=tag)
    return _measured(baseline, start, out)


def _measured(baseline: int, start: float, out: str) -> dict:
    return {
        "peak": _status("VmHWM") - baseline,
        "seconds": time.perf_counter() - start,
        "written": sum(f.stat().st_size for f in Path(out).rglob("*.safetensors")),
    }


def measure(run_dir: Path) -> tuple[dict[str, dict], int]:
    """Per exporter: {"peak": bytes above baseline, "seconds", "written"}; and the checkpoint's bytes."""
    from scripts.kiln.processes import spawn_ranks

    step = (run_dir / "checkpoints" / "latest").read_text().strip()
    checkpoint_bytes = sum(f.stat().st_size for f in (run_dir / "checkpoints" / step).iterdir())
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        rows[f"kiln scripts/export.py (--max-shard-size {SHARD})"] = spawn_ranks(
            _kiln, (str(run_dir), str(Path(tmp) / "kiln")), 1, tmp
        )[0]
        rows["deepspeed zero_to_fp32 (safetensors, default 5GB shards)"] = spawn_ranks(
            _zero_to_fp32, (str(run_dir / "checkpoints"), step, str(Path(tmp) / "ds")), 1, tmp
        )[0]
    return rows, checkpoint_bytes


def section(rows: dict[str, dict], checkpoint_bytes: int) -> Section:
    mib = 2**20
    s = Section("export", "Exporting a ZeRO-3 checkpoint: peak host memory")
    s.tables.append(
        md_table(
            [
                "exporter",
                "peak RSS above baseline (MiB)",
                "x checkpoint bytes",
                "weights written (MiB)",
                "wall time (s)",
            ],
            [
                [
                    name,
                    f"{r['peak'] / mib:.1f}",
                    f"{r['peak'] / checkpoint_bytes:.2f}x",
                    f"{r['written'] / mib:.1f}",
                    f"{r['seconds']:.1f}",
                ]
                for name, r in rows.items()
            ],
        )
    )
    s.notes.append(
        f"a dit_tiny widened to {checkpoint_bytes / mib:.1f} MiB of ZeRO-3 checkpoint (2 ranks, fp32: "
        "masters, Adam moments, EMA); each exporter in a fresh process"
    )
    kiln, ds = rows.values()
    ratio = kiln["peak"] / ds["peak"]
    s.targets.append(
        Target(f"Kiln's peak <= {TARGET}x zero_to_fp32's on the same checkpoint", f"{ratio:.2f}x", ratio <= TARGET)
    )
    s.data = {
        "checkpoint_bytes": checkpoint_bytes,
        "max_shard_size": SHARD,
        "exporters": rows,
        "peak_ratio_kiln_over_zero_to_fp32": ratio,
    }
    return s


def run(opts) -> Section:
    run_dir = fresh_dir(opts.work / "export_dit_zero3")
    say("export: one ZeRO-3 step of a widened dit_tiny on 2 ranks, with its checkpoint")
    train_run(
        opts,
        "dit_tiny",
        [
            *WIDTHS[opts.pick("full", "quick")],
            "parallel.zero_stage=3",
            "trainer.max_steps=1",
            "trainer.micro_batch_size=4",
            "data.num_workers=1",
            "checkpoint.final=true",
        ],
        run_dir,
        nproc=2,
    )
    say("export: scripts/export.py and zero_to_fp32, fresh processes each")
    rows, checkpoint_bytes = measure(run_dir)
    return section(rows, checkpoint_bytes)
