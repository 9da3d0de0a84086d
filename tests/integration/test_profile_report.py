"""Profiled runs end to end: dit_tiny on one rank, llm_tiny tp=2 on two; the merged Perfetto trace
(one process per rank, communication on its own track, ranks on one clock) and profile_report."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys

import pytest

from scripts.kiln.traces import COMM_PATTERN, ROWS, RankTrace, merge_traces, rank_breakdown
from tests.conftest import FAST_DIT, REPO, run_train

pytestmark = pytest.mark.integration
REPORT = str(REPO / "scripts" / "profile_report.py")
# Step 1 warms the profiler up, steps 2-3 are recorded (ProfilerStep#1, #2; rank{R}_step3.json).
PROFILE = ["trainer.max_steps=3", "profile.enabled=true", "profile.wait=0", "profile.warmup=1", "profile.active=2"]
VERDICTS = ("input-bound", "communication-bound", "launch/CPU-bound", "compute-bound")


@pytest.fixture(scope="module")
def dit_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dit_profile")
    run_train(
        [
            *FAST_DIT,
            f"run.dir={run_dir}",
            "trainer.micro_batch_size=16",
            "trainer.eval=false",
            "checkpoint.final=false",
            *PROFILE,
        ]
    )
    return run_dir


@pytest.fixture(scope="module")
def llm_tp2_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("llm_tp2_profile")
    run_train(
        [
            "recipe=llm_tiny",
            "parallel.tp=2",
            "trainer.micro_batch_size=4",
            "trainer.log_every=1",
            "trainer.progress_bar=false",
            "checkpoint.final=false",
            "data.num_workers=1",
            f"run.dir={run_dir}",
            *PROFILE,
        ],
        nproc=2,
    )
    return run_dir


def tracks(trace: dict) -> tuple[dict, dict]:
    """({pid: process name}, {(pid, tid): thread name}) from the metadata events."""
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    return processes, threads


def report(run_dir) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, REPORT, f"run.dir={run_dir}"], capture_output=True, text=True, cwd=REPO)


def check_report(out: str, columns: list[str]) -> str:
    lines = out.splitlines()
    header = next(line for line in lines if line.split() and line.split()[0] == "rank")
    assert header.split() == [w for c in columns for w in c.split()]
    shares = [
        [float(p) for p in re.findall(r"(\d+\.\d)%", next(line for line in lines if line.startswith(f"{row} ")))]
        for row in ROWS
    ]
    for column in zip(*shares):  # each rank and the overall column: rows partition the step
        assert sum(column) == pytest.approx(100, abs=0.5)
    verdict = next(line for line in lines if line.startswith("verdict: "))
    assert verdict.split(":")[1].strip() in VERDICTS
    return verdict


def test_single_rank_trace_and_report(dit_run):
    profile = dit_run / "profile"
    assert (profile / "rank0_step3.json").exists()  # per-rank traces are kept
    trace = json.loads((profile / "trace.json").read_text())
    processes, threads = tracks(trace)
    assert processes == {0: "rank 0"} and threads[(0, 0)] == "main thread"
    names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and (e["pid"], e["tid"]) == (0, 0)]
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == ["ProfilerStep#1", "ProfilerStep#2"]
    assert {"phase/data_wait", "phase/forward", "phase/backward", "phase/optimizer"} <= set(names)
    assert min(e["ts"] for e in trace["traceEvents"] if e["ph"] != "M") == 0

    summary = json.loads((profile / "summary.json").read_text())
    assert summary["overall"]["phases_found"] and summary["overall"]["percent"]["forward"] > 0
    proc = report(dit_run)
    assert proc.returncode == 0, proc.stderr
    print(proc.stdout)
    check_report(proc.stdout, ["rank 0", "overall"])


def test_two_rank_trace_and_report(llm_tp2_run):
    trace = json.loads((llm_tp2_run / "profile" / "trace.json").read_text())
    processes, threads = tracks(trace)
    assert processes == {0: "rank 0", 1: "rank 1"}
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        assert threads[(rank, 1)] == "communication"
        on_comm = [e["name"] for e in events if (e["pid"], e["tid"]) == (rank, 1)]
        on_main = [e["name"] for e in events if (e["pid"], e["tid"]) == (rank, 0)]
        # TP's collectives (DTensor functional all-gather/reduce-scatter, their waits) sit on the
        # communication track; the main thread keeps compute only.
        assert any(n.startswith("_c10d_functional::") for n in on_comm)
        assert not any(COMM_PATTERN.match(n) for n in on_main)
    # One clock: the same collective finishes at the same moment on both ranks (the later rank's
    # wait ends when the data arrives), so matching waits end within milliseconds of each other.
    waits = [
        sorted(e["ts"] + e["dur"] for e in events if e["pid"] == r and e["name"] == "_c10d_functional::wait_tensor")
        for r in (0, 1)
    ]
    assert len(waits[0]) == len(waits[1]) > 0
    assert statistics.median(abs(a - b) for a, b in zip(*waits)) < 2000  # µs

    summary = json.loads((llm_tp2_run / "profile" / "summary.json").read_text())
    assert all(summary["ranks"][r]["seconds"]["communication"] > 0 for r in ("0", "1"))
    proc = report(llm_tp2_run)
    assert proc.returncode == 0, proc.stderr
    print(proc.stdout)
    check_report(proc.stdout, ["rank 0", "rank 1", "overall"])


def _fake_trace(rank: int, base_ns: int, step_ts_us: float) -> dict:
    thread = {"pid": 1000 + rank, "tid": 1000 + rank}
    return {
        "baseTimeNanoseconds": base_ns,
        "traceEvents": [
            {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", **thread, "ts": step_ts_us, "dur": 100.0},
            {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", **thread, "ts": step_ts_us + 10, "dur": 5.0},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", **thread, "ts": step_ts_us + 20, "dur": 50.0},
        ],
    }


def test_merge_aligns_ranks_on_their_base_times(tmp_path):
    """Rank 1's file has another base time: its events land where the wall clock says."""
    (tmp_path / "rank0_step2.json").write_text(json.dumps(_fake_trace(0, 1_000_000_000_000, 500.0)))
    (tmp_path / "rank1_step2.json").write_text(json.dumps(_fake_trace(1, 1_000_000_200_000, 400.0)))  # +200 µs
    trace = json.loads(merge_traces(tmp_path).read_text())
    steps = {e["pid"]: e["ts"] for e in trace["traceEvents"] if e.get("name") == "ProfilerStep#1"}
    assert steps == {0: 0.0, 1: 100.0}  # rank 1 started at 200 + 400 = 600 µs, rank 0 at 500 µs
    comm = [e for e in trace["traceEvents"] if e.get("name") == "c10d::allreduce_"]
    assert {(e["pid"], e["tid"]) for e in comm} == {(0, 1), (1, 1)}


def test_breakdown_partitions_a_step(tmp_path):
    """Each instant of the step lands in one row: communication first, then data wait, idle, phases."""
    main, gloo = {"pid": 7, "tid": 7}, {"pid": 7, "tid": 8}

    def x(name, start, end, cat="cpu_op", thread=main):
        return {"ph": "X", "cat": cat, "name": name, **thread, "ts": float(start), "dur": float(end - start)}

    events = [
        x("ProfilerStep#3", 0, 100, "user_annotation"),
        x("phase/data_wait", 0, 10, "user_annotation"),
        x("phase/forward", 10, 50, "user_annotation"),
        x("aten::mm", 12, 30),
        x("c10d::allreduce_", 30, 40),
        x("phase/backward", 50, 90, "user_annotation"),
        x("aten::mm", 50, 85),
        x("gloo:all_reduce", 86, 89, "user_annotation", gloo),  # the main thread waits on it, idle
        x("aten::item", 92, 95),  # outside every phase
    ]
    path = tmp_path / "rank0_step4.json"
    path.write_text(json.dumps({"baseTimeNanoseconds": 0, "traceEvents": events}))
    b = rank_breakdown([RankTrace(path)])
    micros = {row: round(s * 1e6, 6) for row, s in b["seconds"].items()}
    assert micros == {
        "data_wait": 10,
        "forward": 18,
        "backward": 35,
        "optimizer": 0,
        "communication": 13,
        "other": 3,
        "idle": 21,
    }  # idle: 10-12, 40-50, 85-86, 89-92, 95-100
    assert b["step_s"] == pytest.approx(100e-6) and b["ops_per_step"] == 4


def test_report_refuses_runs_without_traces_or_metrics(tmp_path):
    proc = report(tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "has no profile/" in proc.stderr and "profile.enabled=true" in proc.stderr
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "rank0_step2.json").write_text(json.dumps(_fake_trace(0, 0, 0.0)))
    proc = report(tmp_path)
    assert proc.returncode == 2 and "no metrics.jsonl" in proc.stderr
