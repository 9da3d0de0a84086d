"""Atomic, verified checkpoints: write to a temp dir, seal it with a manifest, rename it into place, then move
the `latest` pointer; saves may finish in the background (async), and a resume verifies what it loads.

Layout under run.dir/checkpoints/:
    step_0000500/      a complete checkpoint (only ever created by a rename); its manifest.json, written last,
                       lists every file with its size and CRC-32
    latest             text file naming the newest complete step dir
    .tmp/              in-progress writes only (removed once a checkpoint is in place, and at start-up)
    corrupt_step_*/    a checkpoint that failed verification at resume, moved aside (kept: nothing is deleted)

Checkpoints written before Kiln wrote manifests (their meta.json lacks the `manifest` key) resume unverified.

What goes inside a step dir is up to the recipe's `write(dir)` callback, which every rank calls (DeepSpeed
and DCP write per-rank shards). It may return a Future: the write goes on in the background (DCP's async
save) and the checkpoint is sealed and committed -- renamed, `latest` moved -- only once every rank's write
is done and the ranks agree on it, at a later step boundary (`poll`), at the next save or at the end of the
run (`wait`). A crash at any point leaves `latest` naming the previous complete checkpoint.

Checksums are CRC-32 (zlib): on a 100 MB file it took 0.034 s here against 0.066 s for SHA-256 and 0.026 s
for xxh3 (xxhash is not a Kiln dependency); it is there to catch truncated and corrupted files, not tampering.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shutil
import time
import zlib
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as tdist

from common import faults
from common.distributed import DistInfo, barrier, broadcast_object
from common.errors import ConfigError

STEP_PREFIX = "step_"
MANIFEST = "manifest.json"
CORRUPT_PREFIX = "corrupt_"


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


# ---- the manifest -----------------------------------------------------------------------------------
def file_crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def write_manifest(ckpt: Path) -> None:
    """manifest.json: every file under `ckpt` (relative path -> size, CRC-32); written last."""
    files = {
        str(p.relative_to(ckpt)): {"size": p.stat().st_size, "crc32": file_crc32(p)}
        for p in sorted(ckpt.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    _atomic_write_text(ckpt / MANIFEST, json.dumps({"checksum": "crc32", "files": files}, indent=1))


def _predates_manifests(ckpt: Path) -> bool:
    """A checkpoint Kiln wrote before it wrote manifests: meta.json without the `manifest` key newer ones record."""
    try:
        return not (ckpt / MANIFEST).exists() and "manifest" not in read_meta(ckpt)
    except (OSError, ValueError):
        return False


def is_complete(ckpt: Path) -> bool:
    return (ckpt / MANIFEST).exists() or _predates_manifests(ckpt)


def verify(ckpt: Path) -> str | None:
    """None when every file the manifest lists is there with its size and CRC-32 (or the checkpoint predates
    manifests: nothing to check it against); else what is wrong, naming the file."""
    if _predates_manifests(ckpt):
        return None
    try:
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"{MANIFEST} is missing"
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    for name, want in files.items():
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{name} is truncated or overwritten ({size} bytes, the manifest says {want['size']})"
        if file_crc32(path) != want["crc32"]:
            return f"{name} is corrupted (its CRC-32 differs from the manifest's)"
    return None


def _newest_verified(root: Path, *, move_aside: bool) -> Path | None:
    """The newest checkpoint under `root`, from the one `latest` names back, whose files match its manifest; one
    line for each one that does not. `move_aside`: a bad one becomes corrupt_step_* (so that its step can be
    saved again) and `latest` names the one found."""
    pointer = root / "latest"
    if not pointer.exists():
        return None
    newest = pointer.read_text().strip()
    for ckpt in sorted((p for p in root.glob(f"{STEP_PREFIX}*") if p.is_dir() and p.name <= newest), reverse=True):
        problem = verify(ckpt)
        if problem is None:
            if move_aside and ckpt.name != newest:
                _atomic_write_text(pointer, ckpt.name)
            return ckpt
        moved = ""
        if move_aside:
            aside = ckpt.with_name(CORRUPT_PREFIX + ckpt.name)
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(ckpt, aside)
            moved = f" (moved to {aside.name})"
        print(
            f"kiln: checkpoint {ckpt.name} fails verification: {problem}{moved}; falling back to the previous "
            "checkpoint",
            flush=True,
        )
    return None


def latest_in(root: Path) -> Path | None:
    """The complete step dir (one holding its manifest) that `root/latest` names, else None."""
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    return path if is_complete(path) else None


def resolve_checkpoint(resume: str, own_root: Path) -> Path | None:
    """What run.resume names, verified: `auto` is the newest verified checkpoint in `own_root` (else None); a
    run dir or checkpoints dir, its newest verified one; a step dir, itself. ConfigError when there is none."""
    if resume == "auto":
        return _newest_verified(own_root, move_aside=True)
    path = Path(resume)
    for root in (path, path / "checkpoints"):
        if (root / "latest").exists():
            found = _newest_verified(root, move_aside=root.resolve() == own_root.resolve())
            if found is None:
                raise ConfigError(f"run.resume={resume}: no checkpoint there passes verification")
            return found
    if (path / MANIFEST).exists() or (path / "meta.json").exists():
        problem = verify(path)
        if problem:
            raise ConfigError(f"run.resume={resume}: the checkpoint fails verification: {problem}")
        return path
    raise ConfigError(
        f"run.resume={resume}: no complete checkpoint there (expected a run dir, its checkpoints dir or "
        f"a step_* dir with {MANIFEST})"
    )


@dataclasses.dataclass
class _Pending:
    """An async save: its files are being written to `tmp` in the background; `done` completes when this rank's
    share is on disk (and, on rank 0, the checkpoint is sealed)."""

    tmp: Path
    final: Path
    done: concurrent.futures.Future


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep: int, dist: DistInfo, *, async_save: bool = False):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep
        self.dist = dist
        self.async_save = async_save
        self._pending: _Pending | None = None
        self._groups = None  # (DCP's background writes, the ranks' agreement): gloo groups of their own
        self._sealer = (
            concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-ckpt") if async_save else None
        )
        if dist.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(self.root / ".tmp", ignore_errors=True)  # leftovers of a crashed save
        barrier()

    def latest(self) -> Path | None:
        return latest_in(self.root)

    def resolve_resume(self, resume: str) -> Path | None:
        """`auto`: the newest verified checkpoint here, else None. `never`: None. Else a path (ConfigError when it
        holds no verified checkpoint). Rank 0 verifies (and falls back, one line per bad checkpoint); every rank
        gets its verdict."""
        if resume == "never":
            return None
        verdict = None
        if self.dist.is_main:
            try:
                verdict = (resolve_checkpoint(resume, self.root), None)
            except ConfigError as exc:
                verdict = (None, str(exc))
        path, error = broadcast_object(verdict)
        if error:
            raise ConfigError(error)
        return path

    def async_group(self):
        """The process group DCP's background writes use (collective the first time: every rank calls it in `save`).
        Not the default group: training's collectives run on it meanwhile, from another thread."""
        if self._groups is None:
            self._groups = (tdist.new_group(backend="gloo"), tdist.new_group(backend="gloo"))
        return self._groups[0]

    def save(
        self, step: int, write: Callable[[Path], concurrent.futures.Future | None], meta: dict | None = None
    ) -> Path:
        """Collective: every rank calls it; `write(tmp_dir)` writes this rank's share, or starts writing it in the
        background and returns its Future (then the checkpoint is committed later: `poll`, `wait`)."""
        final = self.root / step_dir_name(step)
        if (
            self._pending is not None and self._pending.final == final
        ):  # e.g. the final save of a run, just after its last
            return final
        self.wait(f"step {step}'s save")
        if final.exists():  # e.g. the final save of a run resumed at its last step
            return final
        tmp = self.root / ".tmp" / final.name
        if self.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        written = write(tmp)
        info = {"step": step, "world_size": self.dist.world_size, **(meta or {})}
        if written is None:
            self._finish(None, tmp, step, info)
            self._commit(tmp, final)
        else:
            self._pending = _Pending(tmp, final, self._sealer.submit(self._finish, written, tmp, step, info))
        return final

    def _finish(self, written: concurrent.futures.Future | None, tmp: Path, step: int, info: dict) -> None:
        """This rank's write completed (`written`: the background one); rank 0 seals the checkpoint: meta.json, then
        the manifest, last. A background DCP save completes on every rank only once every rank's files and the
        metadata are on disk, so rank 0 sees them all (the recipe writes its other files before starting it)."""
        if written is not None:
            written.result()
        faults.during_checkpoint(step, in_background=written is not None)
        if written is None:
            barrier()  # every rank's shard is on disk before rank 0 seals it
        if self.dist.is_main:
            _atomic_write_text(
                tmp / "meta.json", json.dumps({**info, "time": time.time(), "manifest": MANIFEST}, indent=1)
            )
            write_manifest(tmp)

    def _commit(self, tmp: Path, final: Path) -> None:
        if self.dist.is_main:
            os.rename(tmp, final)
            # .tmp exists only while a checkpoint is being written (DeepSpeed also drops its
            # zero_to_fp32.py beside the step dir it writes: nothing of the checkpoint's).
            shutil.rmtree(tmp.parent, ignore_errors=True)
            _atomic_write_text(self.root / "latest", final.name)
            self._prune()
        barrier()

    def _agree(self, done: bool, ok: bool = True) -> tuple[bool, bool]:
        """(every rank's write is done, every rank's write succeeded): a tiny all-reduce on a gloo group of its own."""
        if self.dist.world_size == 1:
            return done, ok
        self.async_group()  # the groups exist (every rank that agrees has started an async save)
        flags = torch.tensor([float(done), float(ok)])
        tdist.all_reduce(flags, op=tdist.ReduceOp.MIN, group=self._groups[1])
        return bool(flags[0]), bool(flags[1])

    @property
    def writing(self) -> bool:
        """An async save is in flight (written in the background, not committed yet)."""
        return self._pending is not None

    def poll(self) -> None:
        """At a step boundary (collective): commit the async save in flight if every rank's write is done;
        never waits."""
        if self._pending is not None and self._agree(self._pending.done.done())[0]:
            self._commit_pending()

    def wait(self, waiter: str = "the end of the run") -> None:
        """Collective: block until the async save in flight (if any) is committed, with a line when it is still
        being written."""
        if self._pending is None:
            return
        if not self._agree(self._pending.done.done())[0] and self.dist.is_main:
            print(
                f"kiln: checkpoint {self._pending.final.name} is still being written; {waiter} waits for it", flush=True
            )
        faults.checkpoint_waited_for()
        concurrent.futures.wait([self._pending.done])
        self._commit_pending()

    def _commit_pending(self) -> None:
        pending, self._pending = self._pending, None
        error = pending.done.exception()
        if not self._agree(True, error is None)[1]:
            raise RuntimeError(
                f"checkpoint {pending.final.name} failed to write{f': {error}' if error else ' on another rank'}"
            ) from error
        self._commit(pending.tmp, pending.final)

    def _prune(self) -> None:
        """Keep the newest `keep` complete checkpoints (a manifest: async ones in flight are not in place yet);
        `latest`, the newest verified one, is never deleted, nor anything newer than the kept ones."""
        complete = sorted(p for p in self.root.glob(f"{STEP_PREFIX}*") if is_complete(p))
        if len(complete) <= self.keep:
            return
        oldest_kept, latest = complete[-self.keep], self.latest()
        for old in sorted(p for p in self.root.glob(f"{STEP_PREFIX}*") if p.is_dir()):
            if old < oldest_kept and old != latest:
                shutil.rmtree(old, ignore_errors=True)
