"""scripts/bench.py --quick runs its overhead and activation-checkpointing sections and writes tables
whose numbers parse (timing targets belong to the benchmark, not to tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration


def table_rows(markdown: str) -> list[list[str]]:
    """Cells of every markdown table row (header and separator rows included)."""
    return [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in markdown.splitlines()
        if line.startswith("|")
    ]


def number(cell: str) -> float:
    """12.3 / 1.05x / 47.95 MiB / 1,234 -> float."""
    return float(cell.split()[0].rstrip("x").replace(",", ""))


def test_quick_bench_overhead_and_ac(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "bench.py"),
        "--quick",
        "--only",
        "overhead,ac",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    markdown = (tmp_path / "bench.md").read_text()
    assert markdown in proc.stdout  # the same report on stdout
    assert f"wrote {tmp_path / 'bench.md'}, {tmp_path / 'bench.json'}" in proc.stdout  # and where it went
    rows = {row[0]: row for row in table_rows(markdown)}

    for loop in ("bare PyTorch loop", "Kiln `train_step`", "Kiln loop iteration"):
        assert number(rows[loop][2]) > 0 and number(rows[loop][3]) > 0, rows[loop]
    ac = {(row[0], row[1]): row for row in table_rows(markdown) if row[0] in ("llm_tiny", "dit_tiny")}
    assert set(ac) == {(r, m) for r in ("llm_tiny", "dit_tiny") for m in ("none", "full")}
    for recipe in ("llm_tiny", "dit_tiny"):
        none, full = ac[(recipe, "none")], ac[(recipe, "full")]
        assert number(full[2]) < number(none[2])  # bytes are deterministic: full AC keeps less
        assert number(none[4]) > 0 and number(full[4]) > 0 and number(full[5]) > 0

    report = json.loads((tmp_path / "bench.json").read_text())
    assert set(report) == {"overhead", "ac"}
    assert all(not s["error"] and s["targets"] for s in report.values())
    assert all(isinstance(t["met"], bool) for s in report.values() for t in s["targets"])
    assert report["overhead"]["data"]["max_loss_rel_diff"] < 1e-5  # both loops computed the same steps
