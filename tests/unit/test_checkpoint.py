"""Atomic, verified checkpoints: latest only names complete ones, keep-k pruning, resume resolution; the manifest
of real LLM (DCP) and DiT (DeepSpeed) checkpoints, and the fall-back from a damaged one."""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import threading
import zlib
from pathlib import Path

import pytest
import torch

from common.checkpoint import MANIFEST, CheckpointManager, verify
from common.errors import ConfigError
from common.distributed import DistInfo
from tests.conftest import FAST_DIT, run_train

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


# ---- verified checkpoints: a manifest written last, checked at resume ---------------------------------------
RUNS = {
    "llm": ["recipe=llm_tiny", "trainer.progress_bar=false", "trainer.log_every=1", "trainer.eval=false",
            "profile.count_flops=false"],
    "dit": [*FAST_DIT, "trainer.eval=false", "diffusion.samples_per_class=1", "diffusion.sample_steps=2"],
}


@pytest.fixture(scope="module", params=sorted(RUNS))
def real_run(request, tmp_path_factory):
    """A real tiny run (LLM: DCP; DiT: DeepSpeed) with checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp(request.param)
    run_train([*RUNS[request.param], "trainer.max_steps=4", "checkpoint.every=2", "checkpoint.keep=5", f"run.dir={run_dir}"])
    return run_dir


def biggest_file(ckpt: Path) -> Path:
    """The model shard: DCP's __0_0.distcp, DeepSpeed's model/optimizer states."""
    return max((p for p in ckpt.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_with_size_and_crc32(real_run):
    ckpt = real_run / "checkpoints" / "step_0000004"
    manifest = json.loads((ckpt / MANIFEST).read_text())
    files = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST)
    assert sorted(manifest["files"]) == files and "meta.json" in files
    for name, entry in manifest["files"].items():
        data = (ckpt / name).read_bytes()
        assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name
    assert verify(ckpt) is None


@pytest.mark.parametrize("damage", ["truncate", "flip_a_byte", "delete"])
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(real_run, tmp_path, capsys, damage):
    run_dir = tmp_path / "run"
    shutil.copytree(real_run, run_dir)
    ckpts = run_dir / "checkpoints"
    shard = biggest_file(ckpts / "step_0000004")
    name = str(shard.relative_to(ckpts / "step_0000004"))
    {"truncate": truncate, "flip_a_byte": flip_a_byte, "delete": Path.unlink}[damage](shard)

    mgr = CheckpointManager(run_dir, keep=5, dist=SOLO)
    capsys.readouterr()
    assert mgr.resolve_resume("auto") == ckpts / "step_0000002"
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "step_0000004" in lines[0] and name in lines[0], lines
    assert {"truncate": "truncated", "flip_a_byte": "corrupted", "delete": "missing"}[damage] in lines[0]
    # Nothing is deleted: the bad one is set aside, and its step can be saved again.
    assert (ckpts / "corrupt_step_0000004").is_dir() and not (ckpts / "step_0000004").exists()
    assert mgr.latest() == ckpts / "step_0000002"
    # Named explicitly, the damaged checkpoint is refused with one line naming the file.
    with pytest.raises(ConfigError, match=re.escape(name)):
        mgr.resolve_resume(str(ckpts / "corrupt_step_0000004"))


def test_no_verified_checkpoint_left_starts_fresh_under_auto_and_refuses_an_explicit_run(real_run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(real_run, run_dir)
    for step in (2, 4):
        flip_a_byte(biggest_file(run_dir / "checkpoints" / f"step_{step:07d}"))
    with pytest.raises(ConfigError, match="no checkpoint there passes verification"):
        CheckpointManager(tmp_path / "other", keep=5, dist=SOLO).resolve_resume(str(run_dir))
    assert CheckpointManager(run_dir, keep=5, dist=SOLO).resolve_resume("auto") is None
    assert len(capsys.readouterr().out.splitlines()) == 4  # one line per bad checkpoint, each time


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
