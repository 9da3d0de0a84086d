"""Verified checkpoints on real tiny runs (the LLM's DCP, the DiT's DeepSpeed): a manifest written last lists
every file with its size and CRC32; a damaged checkpoint is set aside at resume and the previous one is used."""

from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from common.checkpoint import MANIFEST, CheckpointManager, verify
from common.distributed import DistInfo
from common.errors import ConfigError
from tests.conftest import FAST_DIT

pytestmark = pytest.mark.integration
SOLO = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))

# ---- verified checkpoints: a manifest written last, checked at resume ---------------------------------------
RUNS = {
    "llm": [
        "recipe=llm_tiny",
        "trainer.progress_bar=false",
        "trainer.log_every=1",
        "trainer.eval=false",
        "profile.count_flops=false",
    ],
    "dit": [*FAST_DIT, "trainer.eval=false", "diffusion.samples_per_class=1", "diffusion.sample_steps=2"],
}


@pytest.fixture(scope="module", params=sorted(RUNS))
def real_run(request, trained):
    """A real tiny run (LLM: DCP; DiT: DeepSpeed) with checkpoints at steps 2 and 4 (tests copy it before damaging
    it)."""
    return trained([*RUNS[request.param], "trainer.max_steps=4", "checkpoint.every=2", "checkpoint.keep=5"])


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
