"""t2i_tiny on 2 gloo ranks takes the steps of the 1-rank run: every random draw (VAE posterior noise, flow noise,
timestep, caption drop) comes from each sample's own generator, so the global batch's loss is the same whatever rank
computes which sample. Full fine-tuning at ZeRO-3 with activation checkpointing, whose step-6 checkpoint then resumes
in one process (ZeRO-0: converted to a universal checkpoint) and continues the same steps; finetune=lora at ZeRO-2
(the adapter alone in ZeRO's partitions), whose checkpoint then exports, through scripts/export.py, the end of the
run's export bit for bit (the EMA's names under activation checkpointing's wrapper)."""

from __future__ import annotations

import pytest

from tests.conftest import load_script, losses, run_train
from tests.fixtures.lora import assert_same_export
from tests.fixtures.t2i import t2i_lora_run_args, t2i_run_args

pytestmark = pytest.mark.distributed

SAVED = 6  # the 2-rank full run's checkpoint that the 1-rank resume starts from


@pytest.mark.parametrize("finetune, zero_stage", [("full", 3), ("lora", 2)])
def test_two_ranks_match_one_rank(trained, t2i_world, finetune, zero_stage, tmp_path, capsys):
    args = (t2i_run_args if finetune == "full" else t2i_lora_run_args)(t2i_world)
    one = losses(trained(args))  # the integration tests' runs (micro-batch 8 on one rank)
    split = [a for a in args if not a.startswith(("trainer.micro_batch_size=", "checkpoint.every="))]
    every = SAVED if finetune == "full" else 0
    run = trained(
        [
            *split,
            "trainer.micro_batch_size=4",
            f"parallel.zero_stage={zero_stage}",
            "toggles.activation_checkpointing=full",
            "trainer.eval=false",
            f"checkpoint.every={every}",
        ],
        nproc=2,
    )
    two = losses(run)
    assert sorted(two) == sorted(one)
    for step, loss in one.items():
        assert two[step] == pytest.approx(loss, rel=1e-4), step
    if finetune == "lora":
        assert load_script("export").main([str(run), "--out", str(tmp_path / "again")]) == 0, capsys.readouterr().err
        assert_same_export(run / "export", tmp_path / "again")
    else:  # any-layout resume: the ZeRO-3 checkpoint of 2 ranks in one process at ZeRO-0
        ckpt = run / "checkpoints" / f"step_{SAVED:07d}"
        resumed_dir = tmp_path / "resumed"
        proc = run_train(
            [*args, "trainer.eval=false", f"run.dir={resumed_dir}", f"run.resume={ckpt}"], nproc=1, timeout=900
        )
        assert f"resumed from {ckpt} at step {SAVED}" in proc.stdout, proc.stdout[-2000:]
        resumed = losses(resumed_dir)
        assert sorted(resumed) == [s for s in sorted(one) if s > SAVED]
        for step, loss in resumed.items():
            assert loss == pytest.approx(two[step], rel=1e-4), step
