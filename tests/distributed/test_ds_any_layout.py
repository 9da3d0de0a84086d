"""A DeepSpeed recipe's checkpoint resumes under another number of ranks and ZeRO stage: the per-step losses of
steps 5-8 after the resume equal those of an uninterrupted run on the new layout with the same global batch (fp32,
1e-5 relative: only the reduction order differs), and a checkpoint that cannot resume is refused in one line."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from common.checkpoint import MANIFEST, file_crc32
from tests.conftest import FAST_DIT, losses, run_train

pytestmark = pytest.mark.distributed
STEPS, SAVED = 8, 4
GLOBAL_BATCH = 8
COMMON = ["trainer.eval=false", "checkpoint.final=false", f"trainer.max_steps={STEPS}", f"checkpoint.every={SAVED}",
          "data.num_workers=0", "trainer.log_every=1", "trainer.progress_bar=false"]
DIT = [*FAST_DIT, *COMMON, "diffusion.sample_steps=2", "diffusion.samples_per_class=1"]
VLM = ["recipe=vlm_tiny", *COMMON]
CRASH_AFTER_SAVE = {"KILN_FAULTS": f"crash@{SAVED + 1}"}  # the source run dies after its step-4 checkpoint


def layout(ranks: int, stage: int, accum: int = 1) -> tuple[int, list[str]]:
    """(ranks, overrides) of a layout with the global batch of GLOBAL_BATCH samples per step."""
    micro = GLOBAL_BATCH // (ranks * accum)
    return ranks, [f"parallel.zero_stage={stage}", f"trainer.micro_batch_size={micro}", f"trainer.grad_accum={accum}"]


class Runs:
    """Runs made once per module and shared by the tests: uninterrupted targets, interrupted sources."""

    def __init__(self, root):
        self.root, self.done = root, {}

    def full(self, recipe: list[str], ranks: int, args: list[str]):
        return self._run("full", recipe, ranks, args, env=None, check=True)

    def source(self, recipe: list[str], ranks: int, args: list[str]):
        run_dir = self._run("source", recipe, ranks, args, env=CRASH_AFTER_SAVE, check=False)
        ckpt = run_dir / "checkpoints" / f"step_{SAVED:07d}"
        assert (ckpt / "meta.json").exists() and not (run_dir / "checkpoints" / f"step_{STEPS:07d}").exists()
        return ckpt

    def _run(self, kind, recipe, ranks, args, env, check):
        key = (kind, recipe[0], ranks, *args)
        if key not in self.done:
            run_dir = self.root / f"{kind}{len(self.done)}"
            run_train([*recipe, *args, f"run.dir={run_dir}"], nproc=ranks, env=env, check=check, timeout=900)
            self.done[key] = run_dir
        return self.done[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("any_layout"))


def resume(recipe, ckpt, ranks, args, run_dir):
    proc = run_train([*recipe, *args, f"run.dir={run_dir}", f"run.resume={ckpt}"], nproc=ranks, timeout=900)
    assert "converting it to a DeepSpeed universal checkpoint" in proc.stdout, proc.stdout[-2000:]
    assert f"resumed from {ckpt} at step {SAVED}" in proc.stdout
    return losses(run_dir)


def assert_continues(resumed: dict, reference: dict) -> None:
    assert sorted(resumed) == list(range(SAVED + 1, STEPS + 1))
    for step in resumed:
        assert resumed[step] == pytest.approx(reference[step], rel=1e-5, abs=0), f"step {step}"


@pytest.mark.parametrize("source, target", [
    (layout(2, 2), layout(1, 0, accum=2)),  # 2 ranks ZeRO-2 -> 1 rank ZeRO-0 (accumulating the global batch)
    (layout(2, 2), layout(2, 3)),  # -> 2 ranks ZeRO-3
    (layout(2, 1), layout(4, 1)),  # 2 ranks ZeRO-1 -> 4 ranks ZeRO-1
], ids=["2r-zero2-to-1r-zero0", "2r-zero2-to-2r-zero3", "2r-zero1-to-4r-zero1"])
def test_dit_resumes_under_another_layout(runs, tmp_path, source, target):
    reference = losses(runs.full(DIT, *target))
    ckpt = runs.source(DIT, *source)
    # The global stream and every random draw are the layout's: the first steps agree across layouts already.
    saved = losses(ckpt.parent.parent)
    for step in range(1, SAVED + 1):
        assert saved[step] == pytest.approx(reference[step], rel=1e-5, abs=0), f"step {step} before the checkpoint"
    assert_continues(resume(DIT, ckpt, *target, tmp_path / "resumed"), reference)


def test_vlm_resumes_under_another_layout(runs, tmp_path):
    """1 rank ZeRO-0 (whole torch AdamW state) -> 2 ranks ZeRO-3, packed rows cut differently per rank."""
    target = layout(2, 3)
    reference = losses(runs.full(VLM, *target))
    ckpt = runs.source(VLM, *layout(1, 0))
    assert_continues(resume(VLM, ckpt, *target, tmp_path / "resumed"), reference)


# ---- refusals: one line, nothing lost ----------------------------------------------------------------
def refused(recipe: list[str], args: list[str], resume_from, run_dir) -> str:
    proc = run_train([*recipe, *args, f"run.dir={run_dir}", f"run.resume={resume_from}"], check=False, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kiln: error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return errors[0]


def tree_digest(folder) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_refusals(runs, tmp_path):
    ckpt = runs.source(DIT, *layout(2, 2))
    _, one_rank = layout(1, 0, accum=2)
    assert "is a checkpoint of recipe dit_tiny; this run is vlm_tiny" in refused(VLM, one_rank, ckpt, tmp_path / "a")
    line = refused(DIT, [*one_rank, "model.num_layers=2"], ckpt, tmp_path / "b")
    assert "holds another model" in line and "transformer_blocks.2" in line
    assert "no complete checkpoint there" in refused(DIT, one_rank, tmp_path, tmp_path / "c")
    half = ["parallel.zero_stage=0", "trainer.micro_batch_size=4", "trainer.grad_accum=1"]  # 4 samples per step, not 8
    line = refused(DIT, half, ckpt, tmp_path / "d")
    assert "took 8 samples per step; this run takes 4" in line

    broken = tmp_path / "broken" / ckpt.name
    shutil.copytree(ckpt, broken)
    shard = broken / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    # A shard written broken (its manifest agrees): verification passes, DeepSpeed's conversion fails.
    manifest = json.loads((broken / MANIFEST).read_text())
    manifest["files"][shard.name] = {"size": shard.stat().st_size, "crc32": file_crc32(shard)}
    (broken / MANIFEST).write_text(json.dumps(manifest))
    before = tree_digest(broken.parent)
    line = refused(DIT, one_rank, broken, tmp_path / "e")
    assert "converting" in line and "failed" in line and "left as it was" in line
    assert tree_digest(broken.parent) == before  # the original untouched
    assert not list((tmp_path / "e" / "checkpoints").glob(".tmp/universal_*"))  # no partial conversion left
