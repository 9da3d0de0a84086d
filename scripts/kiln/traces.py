"""Profiler traces after the run: the per-rank traces common/profiling.py writes, merged into one
multi-rank Perfetto timeline, and the step breakdown (scripts/profile_report.py) built from them.

What the traces contain (torch 2.13; checked on CPU/gloo traces of dit_tiny under DeepSpeed and
llm_tiny under tp=2; the GPU rules follow kineto's documented categories, unchecked here for want
of a GPU) and the rules this module follows:

* Time: every event's ``ts`` (µs) is relative to the file's ``baseTimeNanoseconds`` (Unix ns),
  so ``baseTimeNanoseconds + 1000 * ts`` is wall-clock time. Ranks are aligned on it: exact on
  one host, within NTP skew across hosts.
* The main thread is the one holding the ``ProfilerStep#N`` ranges (one per profiled step).
  ``StepTimer`` (common/profiling.py) adds ``phase/<name>`` ranges (data_wait, forward, backward,
  optimizer) inside them.
* Communication is any event whose name matches ``COMM_PATTERN``: the c10d ops the main thread
  issues (``c10d::allreduce_``, DTensor's ``_c10d_functional::all_gather_into_tensor`` and
  ``wait_tensor``), the ``gloo:*`` / ``nccl:*`` ranges of the backend's own threads, and NCCL
  kernels (``ncclDevKernel_*``) on the GPU. Names like ``aten::broadcast_tensors`` are not
  collectives, hence prefixes rather than substrings.
"""

from __future__ import annotations

import bisect
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

PHASES = ("data_wait", "forward", "backward", "optimizer")
ROWS = (*PHASES, "communication", "other", "idle")
COMM_PATTERN = re.compile(r"^(c10d::|_?c10d_functional(_autograd)?::|gloo:|nccl|record_param_comms)")
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
TRACE_FILE = re.compile(r"rank(\d+)_step(\d+)\.json")


# ---- intervals: sorted lists of disjoint (start_ns, end_ns) ---------------------------------


def union(spans) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        elif e > s:
            out.append([s, e])
    return [(s, e) for s, e in out]


def intersect(a, b) -> list[tuple[int, int]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b) -> list[tuple[int, int]]:
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > s:
                out.append((s, b[k][0]))
            s = max(s, b[k][1])
            k += 1
        if s < e:
            out.append((s, e))
    return out


def measure(spans) -> int:
    return sum(e - s for s, e in spans)


def _inside(t: int, spans, starts) -> bool:
    i = bisect.bisect_right(starts, t) - 1
    return i >= 0 and t < spans[i][1]


# ---- loading ------------------------------------------------------------------------------


class RankTrace:
    """One trace file: its events with absolute times (`_ns`, `_end` in Unix ns) and its main thread."""

    def __init__(self, path: Path):
        data = json.loads(path.read_text())
        self.path = path
        self.rank = int(TRACE_FILE.fullmatch(path.name).group(1))
        base = int(data.get("baseTimeNanoseconds", 0))
        self.events = []
        self.thread_names: dict[tuple, str] = {}
        for e in data["traceEvents"]:
            if e.get("ph") == "M":
                if e.get("name") == "thread_name":
                    self.thread_names[(e["pid"], e["tid"])] = e["args"]["name"]
                continue
            if not isinstance(e.get("pid"), int) or "ts" not in e:
                continue  # the profiler's own "Spans"/"Traces" bookkeeping
            e["_ns"] = base + round(float(e["ts"]) * 1000)
            e["_end"] = e["_ns"] + round(float(e.get("dur", 0)) * 1000)
            self.events.append(e)
        steps = [e for e in self.events if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")]
        if not steps:
            raise ValueError(f"{path} has no ProfilerStep# ranges")
        self.pid, self.tid = steps[0]["pid"], steps[0]["tid"]
        self.steps = sorted((e["_ns"], e["_end"]) for e in steps)

    def on_gpu(self, e: dict) -> bool:
        return e["pid"] != self.pid

    def comm_spans(self) -> dict[tuple, list[tuple[int, int]]]:
        """Per original (pid, tid): the union of its communication events."""
        spans = defaultdict(list)
        for e in self.events:
            if e.get("ph") == "X" and COMM_PATTERN.match(e["name"]):
                spans[(e["pid"], e["tid"])].append((e["_ns"], e["_end"]))
        return {k: union(v) for k, v in spans.items()}


def load_traces(profile_dir: str | Path) -> dict[int, list[RankTrace]]:
    files = sorted(p for p in Path(profile_dir).glob("rank*_step*.json") if TRACE_FILE.fullmatch(p.name))
    ranks: dict[int, list[RankTrace]] = defaultdict(list)
    for path in files:
        trace = RankTrace(path)
        ranks[trace.rank].append(trace)
    return dict(sorted(ranks.items()))


# ---- the merged timeline ------------------------------------------------------------------


def merge_traces(profile_dir: str | Path) -> Path:
    """`profile/trace.json`: one process per rank (pid = rank), communication on its own tracks.

    Tracks (threads) of rank R: "main thread" (compute ops, ProfilerStep and phase ranges),
    "communication" (the main thread's collectives and everything nested in them), then the
    backend's threads ("communication: <thread>" for their collectives) and GPU streams ("GPU d
    stream s", NCCL kernels on "communication: GPU d stream s"). Times start at 0 at the earliest
    event of any rank. Flow ids (forward→backward links) are made unique per rank.
    """
    profile_dir = Path(profile_dir)
    ranks = load_traces(profile_dir)
    if not ranks:
        raise FileNotFoundError(f"no rank*_step*.json traces in {profile_dir}")
    origin = min(e["_ns"] for traces in ranks.values() for t in traces for e in t.events)
    events: list[dict] = []
    for rank, traces in ranks.items():
        tids: dict[tuple, int] = {}
        names: dict[int, str] = {}

        def track(trace: RankTrace, e: dict, comm: bool) -> int:
            gpu = trace.on_gpu(e)
            main = not gpu and e["tid"] == trace.tid
            key = ("gpu" if gpu else "cpu", "main" if main else e["pid"], "main" if main else e["tid"], comm)
            if key not in tids:
                if main:
                    name = "communication" if comm else "main thread"
                else:
                    name = (
                        f"GPU {e['pid']} stream {e['tid']}"
                        if gpu
                        else trace.thread_names.get((e["pid"], e["tid"]), f"thread {e['tid']}")
                    )
                    name = f"communication: {name}" if comm else name
                # The two main tracks first, so a rank reads top to bottom: compute, then its collectives.
                tids[key] = {"main thread": 0, "communication": 1}.get(name, 2 + sum(t > 1 for t in names))
                names[tids[key]] = name
            return tids[key]

        for trace in traces:
            comm = trace.comm_spans()
            starts = {k: [s for s, _ in v] for k, v in comm.items()}
            for e in trace.events:
                k = (e["pid"], e["tid"])
                out = {key: v for key, v in e.items() if key not in ("_ns", "_end")}
                out["tid"] = track(trace, e, k in comm and _inside(e["_ns"], comm[k], starts[k]))
                out["pid"] = rank
                out["ts"] = round((e["_ns"] - origin) / 1000, 3)
                if e.get("ph") in ("s", "t", "f") and isinstance(e.get("id"), int):
                    out["id"] = rank * 2**32 + e["id"]
                events.append(out)
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for tid, name in names.items():
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
            events.append(
                {"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}}
            )
    out = profile_dir / "trace.json"
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(
        json.dumps(
            {
                "traceEvents": events,
                "displayTimeUnit": "ms",
                "otherData": {
                    "kiln_origin_unix_ns": origin,
                    "ranks": list(ranks),
                    "alignment": "wall clock: baseTimeNanoseconds + ts of each rank's trace",
                },
            }
        )
    )
    tmp.replace(out)
    return out


# ---- the step breakdown -------------------------------------------------------------------


def rank_breakdown(traces: list[RankTrace]) -> dict:
    """Mean seconds per profiled step of one rank, split into ROWS that partition the step.

    Every instant of a ProfilerStep window counts once, in this order:
      communication  a collective is running and nothing else is: on CPU the main thread is in a
                     collective op, or is idle while a backend thread runs one (a blocking wait);
                     on GPU an NCCL kernel runs while no compute kernel does (exposed comm)
      data_wait      inside a phase/data_wait range
      idle           nothing runs: on CPU no op on the main thread (Python, framework overhead,
                     waits), on GPU no kernel on any stream
      forward, backward, optimizer   inside that phase range, with something running
      other          something runs outside every phase (loss.item(), EMA, logging collectives)
    """
    rows = defaultdict(int)
    n_steps, n_ops, op_durations, short_ops, gpu, phases_found = 0, 0, [], 0, False, False
    for t in traces:
        phase = {p: [] for p in PHASES}
        main_ops, main_comm, side_comm, kernels, comm_kernels = [], [], [], [], []
        for e in t.events:
            if e.get("ph") != "X":
                continue
            span, is_comm = (e["_ns"], e["_end"]), bool(COMM_PATTERN.match(e["name"]))
            if t.on_gpu(e):
                if e.get("cat") in GPU_CATEGORIES:
                    (comm_kernels if is_comm else kernels).append(span)
            elif e["tid"] == t.tid:
                if e["name"].startswith("phase/") and e["name"][6:] in phase:
                    phase[e["name"][6:]].append(span)
                elif is_comm:
                    main_comm.append(span)
                elif e.get("cat") == "cpu_op":
                    main_ops.append(span)
            elif is_comm:
                side_comm.append(span)
        phase = {p: union(v) for p, v in phase.items()}
        phases_found = phases_found or any(phase.values())
        if kernels or comm_kernels:
            gpu = True
            busy = union(kernels)
            comm = subtract(union(comm_kernels), busy)
            ops = kernels
        else:
            busy = subtract(union(main_ops), union(main_comm))
            comm = union(main_comm + subtract(union(side_comm), busy))
            ops = _top_level(main_ops + main_comm)
        for window in t.steps:
            w = [window]
            n_steps += 1
            rows["communication"] += measure(intersect(comm, w))
            rest = subtract(w, comm)
            rows["data_wait"] += measure(intersect(rest, phase["data_wait"]))
            rest = subtract(rest, phase["data_wait"])
            rows["idle"] += measure(subtract(rest, busy))
            running = intersect(rest, busy)
            for p in ("forward", "backward", "optimizer"):
                running_in_p = intersect(running, phase[p])
                rows[p] += measure(running_in_p)
                running = subtract(running, running_in_p)
            rows["other"] += measure(running)
            in_window = [e - s for s, e in ops if window[0] <= s < window[1]]
            n_ops += len(in_window)
            op_durations += in_window
            short_ops += sum(d for d in in_window if d < TINY_OP_US * 1e3)
    step = sum(rows.values()) / n_steps / 1e9
    seconds = {r: rows[r] / n_steps / 1e9 for r in ROWS}
    return {
        "steps": n_steps,
        "step_s": step,
        "seconds": seconds,
        "percent": {r: 100 * s / step if step else 0.0 for r, s in seconds.items()},
        "device": "cuda" if gpu else "cpu",
        "ops_per_step": n_ops / n_steps,
        "median_op_us": statistics.median(op_durations) / 1e3 if op_durations else 0.0,
        "short_op_s": short_ops / n_steps / 1e9,
        "phases_found": phases_found,
    }


def _top_level(spans) -> list[tuple[int, int]]:
    """Ops not nested in another op of the same thread (what Python dispatches one by one)."""
    out, end = [], -1
    for s, e in sorted(spans):
        if s >= end:
            out.append((s, e))
            end = e
    return out


def metrics_breakdown(path: Path) -> dict | None:
    """Mean phase seconds from metrics.jsonl (rank 0's timer) over the logged steps, skipping the
    first (it pays one-time costs: allocation, kernel selection, loader start-up)."""
    from common.metrics import read_metrics

    if not path.exists():
        return None
    records = [r for r in read_metrics(path) if "step_time_s" in r]
    if len(records) > 1:
        records = records[1:]
    if not records:
        return None
    mean = {k: statistics.fmean(r.get(f"{k}_s", 0.0) for r in records) for k in ("step_time", *PHASES)}
    step = mean.pop("step_time")
    seconds = {**mean, "other": step - sum(mean.values())}
    return {
        "steps": [records[0]["step"], records[-1]["step"]],
        "step_s": step,
        "seconds": seconds,
        "percent": {k: 100 * v / step for k, v in seconds.items()},
    }


# Decision tree, in order. Thresholds are shares of the step: waiting on input or on peers is
# lost time whatever the model, so 10% / 20% already pay for fixing. Overhead is the time the
# device does no math for the framework's sake: on GPU the gaps between kernels (idle); on CPU
# the main thread's gaps (idle) plus its top-level ops shorter than TINY_OP_US, whose time is
# mostly dispatch. 20% of it means Python/launch cost rivals the math.
INPUT_BOUND_PCT = 10.0
COMM_BOUND_PCT = 20.0
OVERHEAD_BOUND_PCT = 20.0
TINY_OP_US = 20.0


def overhead_percent(b: dict) -> float:
    short = 0.0 if b["device"] == "cuda" else 100 * b["short_op_s"] / b["step_s"]
    return b["percent"]["idle"] + short


def verdict(overall: dict) -> dict:
    p, overhead = overall["percent"], overhead_percent(overall)
    unit = "kernels" if overall["device"] == "cuda" else "top-level ops"
    evidence = (
        f"data_wait {p['data_wait']:.1f}%, communication {p['communication']:.1f}%, idle {p['idle']:.1f}%, "
        f"overhead {overhead:.1f}%, {overall['ops_per_step']:.0f} {unit}/step "
        f"(median {overall['median_op_us']:.1f} µs)"
    )
    if p["data_wait"] >= INPUT_BOUND_PCT:
        label, why = "input-bound", f"data wait {p['data_wait']:.1f}% of the step (>= {INPUT_BOUND_PCT:.0f}%)"
    elif p["communication"] >= COMM_BOUND_PCT:
        label, why = (
            "communication-bound",
            f"exposed communication {p['communication']:.1f}% of the step (>= {COMM_BOUND_PCT:.0f}%)",
        )
    elif overhead >= OVERHEAD_BOUND_PCT:
        what = (
            "the GPU idles between kernels"
            if overall["device"] == "cuda"
            else f"the main thread runs no op or ops under {TINY_OP_US:.0f} µs"
        )
        label, why = "launch/CPU-bound", f"{what} {overhead:.1f}% of the step (>= {OVERHEAD_BOUND_PCT:.0f}%)"
    else:
        label, why = "compute-bound", "input wait, communication and overhead are all below their thresholds"
    return {"label": label, "reason": why, "evidence": evidence}


def step_breakdown(run_dir: str | Path) -> dict:
    """The step breakdown of a profiled run: per rank and overall (mean of ranks) from the traces,
    the whole run's phase means from metrics.jsonl, and a verdict. This is `profile/summary.json`."""
    run_dir = Path(run_dir)
    ranks = load_traces(run_dir / "profile")
    if not ranks:
        raise FileNotFoundError(f"no rank*_step*.json traces in {run_dir / 'profile'}")
    per_rank = {r: rank_breakdown(t) for r, t in ranks.items()}
    n = len(per_rank)
    seconds = {row: sum(b["seconds"][row] for b in per_rank.values()) / n for row in ROWS}
    step = sum(seconds.values())
    overall = {
        "steps": sum(b["steps"] for b in per_rank.values()),
        "step_s": step,
        "seconds": seconds,
        "percent": {r: 100 * s / step if step else 0.0 for r, s in seconds.items()},
        "device": per_rank[min(per_rank)]["device"],
        "ops_per_step": sum(b["ops_per_step"] for b in per_rank.values()) / n,
        "median_op_us": statistics.median(b["median_op_us"] for b in per_rank.values()),
        "short_op_s": sum(b["short_op_s"] for b in per_rank.values()) / n,
        "phases_found": all(b["phases_found"] for b in per_rank.values()),
    }
    return {
        "ranks": {str(r): b for r, b in per_rank.items()},
        "overall": overall,
        "metrics": metrics_breakdown(run_dir / "metrics.jsonl"),
        "verdict": verdict(overall),
        "communication_pattern": COMM_PATTERN.pattern,
    }


def write_summary(run_dir: str | Path) -> dict:
    """Compute `step_breakdown` and write it to `profile/summary.json`."""
    summary = step_breakdown(run_dir)
    (Path(run_dir) / "profile" / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
