"""Toggles on the real recipe: bf16 mixed precision on one rank (ZeRO-0), and torch.compile per block."""

from __future__ import annotations

import ast
import json
import math
import sys

import pytest

from tests.conftest import FAST_DIT, losses, run_train
from tests.support.launcher import launch_env, run_python

pytestmark = pytest.mark.integration
SHORT = [*FAST_DIT, "trainer.eval=false", "checkpoint.final=false", "trainer.micro_batch_size=32"]


def test_bf16_on_one_rank_trains_at_zero0(tmp_path):
    """bf16 with parallel.zero_stage=2 (the GPU presets') on one process: nothing to partition, so DeepSpeed runs
    ZeRO-0 (its bf16 optimizer wrapper: fp32 masters, torch's AdamW) with one line saying so (common/deepspeed.py
    zero_stage)."""
    proc = run_train(
        [*SHORT, f"run.dir={tmp_path}", "trainer.max_steps=30", "toggles.precision=bf16", "parallel.zero_stage=2"]
    )
    assert proc.stdout.count("kiln: parallel.zero_stage=2 on one rank: nothing to partition over") == 1
    memory = json.loads((tmp_path / "memory.json").read_text())
    # DeepSpeed's bf16 optimizer at ZeRO-0 (fp32 master copies; no ZeRO partitions) over torch's AdamW
    assert memory["zero_stage"] == 0 and memory["optimizer"].startswith("FP16_UnfusedOptimizer > AdamW")
    ls = losses(tmp_path)
    assert all(math.isfinite(v) for v in ls.values())
    assert sum(ls[s] for s in range(26, 31)) < 0.7 * sum(ls[s] for s in range(1, 6))
    assert (tmp_path / "export" / "transformer" / "config.json").exists()


# scripts/train.py's main in process, then dynamo's counters of that process: what torch.compile captured.
TRAIN_AND_COUNT = """
import sys
from torch._dynamo.utils import counters
from scripts.kiln.launch import main
code = main(sys.argv[1:])
print("kiln-test dynamo", dict(counters["stats"]), flush=True)
sys.exit(code)
"""


def test_compile_matches_eager(tmp_path):
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    run_train([*SHORT, f"run.dir={eager}", "trainer.max_steps=3"])
    args = [*SHORT, f"run.dir={compiled}", "trainer.max_steps=3", "toggles.compile=true"]
    proc = run_python([sys.executable, "-c", TRAIN_AND_COUNT, *args], env=launch_env(1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = ast.literal_eval(proc.stdout.split("kiln-test dynamo ")[-1].splitlines()[0])
    # The blocks were compiled: dynamo captured graphs (one per block shape, reused by every block) and ran them.
    assert stats.get("unique_graphs", 0) >= 1 and stats.get("calls_captured", 0) >= 1, stats
    a, b = losses(eager), losses(compiled)
    for step in (1, 2, 3):
        assert b[step] == pytest.approx(a[step], rel=1e-4)
