"""checkpoint.async_save=true on 2 ranks (gloo): DCP's background write runs on a process group of its own while
training's collectives go on; the checkpoint it leaves resumes bitwise under the same layout (dp=2, FSDP2) and
under another (tp=2, to float tolerance as in test_llm_layouts)."""

from __future__ import annotations

import pytest

from tests.conftest import losses, run_train

pytestmark = pytest.mark.distributed
BASE = [
    "recipe=llm_tiny",
    "trainer.max_steps=6",
    "trainer.log_every=1",
    "trainer.progress_bar=false",
    "trainer.eval=false",
    "profile.count_flops=false",
    "checkpoint.every=2",
    "checkpoint.keep=5",
    "checkpoint.async_save=true",
]
LAYOUTS = {"dp2": ["trainer.micro_batch_size=4"], "tp2": ["parallel.tp=2", "trainer.micro_batch_size=8"]}


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dp2")
    run_train([*BASE, *LAYOUTS["dp2"], f"run.dir={run_dir}"], nproc=2, timeout=900)
    return run_dir


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_async_checkpoint_resumes(dp2_run, tmp_path, layout):
    resumed = tmp_path / "resumed"
    proc = run_train(
        [*BASE, *LAYOUTS[layout], f"run.dir={resumed}", f"run.resume={dp2_run}/checkpoints/step_0000002"],
        nproc=2,
        timeout=900,
    )
    assert "at step 2" in proc.stdout
    ref, got = losses(dp2_run), losses(resumed)
    assert sorted(got) == [3, 4, 5, 6]
    for step in got:
        if layout == "dp2":
            assert got[step] == ref[step], step
        else:
            assert got[step] == pytest.approx(ref[step], rel=1e-5), step
