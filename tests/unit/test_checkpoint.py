"""Atomic, verified checkpoints: latest only names complete ones, keep-k pruning, resume resolution, manifests
(on real runs' checkpoints: tests/integration/test_checkpoint_verify.py)."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from pathlib import Path

import pytest
import torch

from common.checkpoint import MANIFEST, CheckpointManager, verify
from common.distributed import DistInfo
from common.errors import ConfigError

SOLO = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def writer(value):
    def write(d: Path) -> None:
        torch.save({"value": value}, d / "state.pt")

    return write


def test_save_then_latest_and_prune(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2, dist=SOLO)
    assert mgr.latest() is None and mgr.resolve_resume("auto") is None
    for step in (10, 20, 30):
        mgr.save(step, writer(step))
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert names == ["step_0000020", "step_0000030"]
    assert mgr.latest().name == "step_0000030"
    assert torch.load(mgr.latest() / "state.pt")["value"] == 30
    assert mgr.resolve_resume("never") is None
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", *names]  # no empty .tmp/


def test_crash_during_write_keeps_previous_latest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=3, dist=SOLO)
    mgr.save(10, writer(10))

    def crashing(d: Path) -> None:
        (d / "half.pt").write_bytes(b"partial")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        mgr.save(20, crashing)
    assert mgr.latest().name == "step_0000010"
    assert not (tmp_path / "checkpoints" / "step_0000020").exists()
    # A restarted run clears the debris and can save step 20 properly.
    mgr2 = CheckpointManager(tmp_path, keep=3, dist=SOLO)
    assert not (tmp_path / "checkpoints" / ".tmp").exists()
    mgr2.save(20, writer(20))
    assert mgr2.resolve_resume("auto").name == "step_0000020"


def test_resume_from_explicit_paths(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2, dist=SOLO)
    mgr.save(5, writer(5))
    step_dir = tmp_path / "checkpoints" / "step_0000005"
    assert mgr.resolve_resume(str(step_dir)) == step_dir
    assert mgr.resolve_resume(str(tmp_path)) == step_dir  # a run dir follows its latest
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        mgr.resolve_resume(str(tmp_path / "empty"))


def test_keep_never_deletes_the_newest_verified_checkpoint(tmp_path):
    """keep=1: the previous checkpoint goes only once the next one is in place with its manifest -- not while it
    is written in the background, not when its write fails."""
    mgr = CheckpointManager(tmp_path, keep=1, dist=SOLO, async_save=True)
    ckpts = tmp_path / "checkpoints"
    mgr.save(10, writer(10))
    release = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:

        def background(value, fail=False):
            def write(d: Path):
                def finish():
                    release.wait()
                    torch.save({"value": value}, d / "state.pt")
                    if fail:
                        raise OSError("disk full")

                return pool.submit(finish)

            return write

        mgr.save(20, background(20))
        mgr.poll()  # not done: nothing moves
        assert mgr.latest() == ckpts / "step_0000010" and not (ckpts / "step_0000020").exists()
        release.set()
        mgr.wait()
        assert mgr.latest() == ckpts / "step_0000020" and not (ckpts / "step_0000010").exists()

        release.clear()
        mgr.save(30, background(30, fail=True))
        release.set()
        with pytest.raises(RuntimeError, match="step_0000030 failed to write: disk full"):
            mgr.wait()
    assert mgr.latest() == ckpts / "step_0000020" and verify(mgr.latest()) is None
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_0000020"]


def test_a_lost_manifest_fails_but_a_checkpoint_from_before_manifests_resumes(tmp_path, capsys):
    lost, old = tmp_path / "lost", tmp_path / "old"
    for run_dir in (lost, old):
        CheckpointManager(run_dir, keep=2, dist=SOLO).save(10, writer(10))
        (run_dir / "checkpoints" / "step_0000010" / MANIFEST).unlink()
    capsys.readouterr()
    assert CheckpointManager(lost, keep=2, dist=SOLO).resolve_resume("auto") is None
    assert f"{MANIFEST} is missing" in capsys.readouterr().out
    meta = old / "checkpoints" / "step_0000010" / "meta.json"
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "manifest"}))
    assert CheckpointManager(old, keep=2, dist=SOLO).resolve_resume("auto") == old / "checkpoints" / "step_0000010"
