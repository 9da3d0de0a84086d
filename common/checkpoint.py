"""Atomic checkpoints: write to a temp dir, rename into place, then move the `latest` pointer.

Layout under run.dir/checkpoints/:
    step_0000500/      a complete checkpoint (only ever created by a rename)
    latest             text file naming the newest complete step dir
    .tmp/              in-progress writes only (removed once a checkpoint is in place, and at start-up)

What goes inside a step dir is up to the recipe's `write(dir)` callback, which every rank
calls (DeepSpeed and DCP write per-rank shards). A crash at any point leaves `latest`
naming the previous complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from common import faults
from common.errors import ConfigError
from common.distributed import DistInfo, barrier

STEP_PREFIX = "step_"


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:07d}"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_meta(ckpt: Path) -> dict:
    return json.loads((ckpt / "meta.json").read_text())


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep: int, dist: DistInfo):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep
        self.dist = dist
        if dist.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(self.root / ".tmp", ignore_errors=True)  # leftovers of a crashed save
        barrier()

    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / "meta.json").exists() else None

    def resolve_resume(self, resume: str) -> Path | None:
        """`auto`: newest complete checkpoint here, else None. `never`: None. Else a path."""
        if resume == "never":
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume)
        for candidate in (path, path / "checkpoints"):
            if (candidate / "latest").exists():
                found = CheckpointManager.__new__(CheckpointManager)
                found.root = candidate
                latest = found.latest()
                if latest is not None:
                    return latest
        if (path / "meta.json").exists():
            return path
        raise ConfigError(f"run.resume={resume}: no complete checkpoint there (expected a step_* dir with meta.json)")

    def save(self, step: int, write: Callable[[Path], None], meta: dict | None = None) -> Path:
        """Collective: every rank calls it; `write(tmp_dir)` writes this rank's share."""
        final = self.root / step_dir_name(step)
        if final.exists():  # e.g. the final save of a run resumed at its last step
            return final
        tmp = self.root / ".tmp" / final.name
        if self.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        write(tmp)
        faults.during_checkpoint(step)
        barrier()  # every rank's shard is on disk before the rename makes it visible
        if self.dist.is_main:
            info = {"step": step, "world_size": self.dist.world_size, "time": time.time(), **(meta or {})}
            _atomic_write_text(tmp / "meta.json", json.dumps(info, indent=1))
            os.rename(tmp, final)
            # .tmp exists only while a checkpoint is being written (DeepSpeed also drops its
            # zero_to_fp32.py beside the step dir it writes: nothing of the checkpoint's).
            shutil.rmtree(tmp.parent, ignore_errors=True)
            _atomic_write_text(self.root / "latest", final.name)
            self._prune()
        barrier()
        return final

    def _prune(self) -> None:
        steps = sorted(p for p in self.root.glob(f"{STEP_PREFIX}*") if p.is_dir())
        latest = self.latest()
        for old in steps[: max(0, len(steps) - self.keep)]:
            if old != latest:
                shutil.rmtree(old, ignore_errors=True)
