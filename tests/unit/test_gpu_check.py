"""scripts/gpu_check.py (make gpu-check) without a GPU: its one-line refusal and its pure helpers."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("kiln_gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_without_a_gpu_it_stops_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and not proc.stdout and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("kiln: error: gpu-check needs a CUDA GPU: torch ")
    assert not (tmp_path / "out").exists()  # nothing written


def test_bad_section_is_one_line():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--only", "versions,speed"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == ("kiln: error: --only: unknown section(s) speed; choose from "
                                                    "versions, tests, recipes, throughput\n")


def test_markdown_table():
    assert gpu_check.md_table(["a", "b"], [[1, "x"], [2.5, None]]) == "| a | b |\n|---|---|\n| 1 | x |\n| 2.5 | None |"


@pytest.mark.parametrize("line, counts", [
    ("3 passed, 1 skipped, 2 deselected in 4.21s", {"passed": 3, "skipped": 1, "deselected": 2}),
    ("1 failed, 2 passed, 1 error in 9.00s", {"failed": 1, "passed": 2, "errors": 1}),
    ("== 5 passed in 1.0s ==", {"passed": 5}),
])
def test_pytest_summary(line, counts):
    assert gpu_check.parse_pytest_summary(f"....F\nsome output\n{line}\n") == counts
    assert gpu_check.parse_pytest_summary("no tests ran\n") == {}


PLAN = {"layouts": [  # the shape of scripts/plan.py --json (its own test checks the numbers)
    {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 0, "ac": "none", "total_bytes": 26480398336.0},
    {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 0, "ac": "full", "total_bytes": 19144331264.0},
    {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 2, "ac": "full", "total_bytes": 17000000000.0},
    {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 0, "ac": "none", "total_bytes": 1.0},
]}


def test_planned_bytes_picks_the_one_gpu_layout():
    assert gpu_check.planned_bytes(PLAN, "none") == 26480398336.0
    assert gpu_check.planned_bytes(PLAN, "full") == 19144331264.0  # the first (ranked) one
    assert gpu_check.planned_bytes(PLAN, "full", zero_stage=2) == 17000000000.0
    assert gpu_check.planned_bytes(PLAN, "selective") is None and gpu_check.planned_bytes({}, "none") is None


def test_medians_and_loss():
    records = [{"step": s, "step_time_s": t} for s, t in enumerate([9.0, 9.0, 9.0, 9.0, 9.0, 1.0, 3.0, 2.0], 1)]
    assert gpu_check.median_after_warmup(records, "step_time_s") == 2.0  # steps 6-8 only
    assert gpu_check.median_after_warmup(records, "mfu") is None
    assert gpu_check.loss_fell([4.0] * 10 + [2.0] * 10) == (4.0, 2.0, True)
    assert gpu_check.loss_fell([1.0] * 5 + [3.0] * 5, window=5)[2] is False


def test_kiln_row_and_table():
    records = [{"step": s, "step_time_s": 0.5, "tokens_per_s": 24576.0, "token_utilization": 0.75, "mfu": 0.41}
               for s in range(1, 11)]
    row = gpu_check.kiln_llm_row("Kiln", records, {"max_allocated": 3 * 2**30}, 2**31)
    assert row["slots_per_s"] == 32768.0 and row["step_time_s"] == 0.5 and row["mfu"] == 0.41
    table = gpu_check.throughput_table([row, {"run": "flash", "error": "toggles.attention=flash is not in the LLM recipe yet"}])
    assert table.splitlines()[2] == "| Kiln | 0.5000 | 2.00 | 32,768 | 41.0% | 3.0 GiB | 2.0 GiB |"
    assert table.splitlines()[3].startswith("| flash | not available: toggles.attention=flash is not in the LLM recipe")
