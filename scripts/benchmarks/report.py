"""The one report helper of the benchmarks: sections with tables, targets and notes, rendered as markdown + json."""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Target:
    what: str
    value: str
    met: bool


@dataclass
class Section:
    name: str
    title: str
    tables: list[str] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    error: str = ""

    def markdown(self) -> str:
        lines = [f"## {self.title}", ""]
        for table in self.tables:
            lines += [table.strip(), ""]
        lines += [f"- target: {t.what}: {t.value} -> **{'met' if t.met else 'NOT met'}**" for t in self.targets]
        lines += [f"- {note}" for note in self.notes]
        if self.error:
            lines.append(f"- **failed**: {self.error}")
        return "\n".join(lines).rstrip() + "\n"


def md_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def say(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def ratio(times, base) -> float:
    """Median of per-step ratios: step i of both ran the same batch (whose sizes may differ from step to step)."""
    return median(t / b for t, b in zip(times, base))


def render(sections: list[Section], *, quick: bool, seconds: float) -> str:
    """The whole report: the machine, a summary of every target (and failed section), then each section."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    head = [
        f"# Kiln benchmarks{' (--quick)' if quick else ''}",
        "",
        f"{device}, torch {torch.__version__}, {torch.get_num_threads()} torch threads, "
        f"load average {os.getloadavg()[0]:.1f} at the end; {seconds / 60:.1f} min. "
        "Medians of interleaved repeats (the machine is shared: absolute times are noisy, ratios less so).",
        "",
    ]
    summary = [[s.name, t.what, t.value, "met" if t.met else "**NOT met**"] for s in sections for t in s.targets]
    summary += [[s.name, "(section failed)", s.error, "**failed**"] for s in sections if s.error]
    if summary:
        head += [md_table(["section", "target", "measured", ""], summary), ""]
    return "\n".join(head) + "\n" + "\n".join(s.markdown() for s in sections)


def write(out: Path, markdown: str, sections: list[Section]) -> list[Path]:
    """bench.md (the rendered report) and bench.json (every section's raw numbers) in `out`; returns both paths."""
    md, raw = out / "bench.md", out / "bench.json"
    md.write_text(markdown)
    raw.write_text(
        json.dumps(
            {
                s.name: {
                    "title": s.title,
                    "targets": [vars(t) for t in s.targets],
                    "notes": s.notes,
                    "error": s.error,
                    "data": s.data,
                }
                for s in sections
            },
            indent=1,
            default=str,
        )
    )
    return [md, raw]
