"""Atomic checkpoints: latest only names complete ones, keep-k pruning, resume resolution."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.checkpoint import CheckpointManager
from common.errors import ConfigError
from common.distributed import DistInfo

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
