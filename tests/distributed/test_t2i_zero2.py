"""t2i_tiny on 2 gloo ranks at ZeRO-2 with activation checkpointing takes the steps of the 1-rank run: every random
draw (VAE posterior noise, flow noise, timestep, caption drop) comes from each sample's own generator, so the global
batch's loss is the same whatever rank computes which sample. The same for finetune=lora (the adapter alone in
ZeRO's partitions), whose checkpoint then exports, through scripts/export.py, the end of the run's export bit for bit
(the EMA's names under activation checkpointing's wrapper). And parallel.cp=2 takes the 1-rank run's steps too."""

from __future__ import annotations

import pytest

from tests.conftest import load_script, losses
from tests.fixtures.lora import assert_same_export
from tests.fixtures.t2i import t2i_lora_run_args, t2i_run_args

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_zero2_two_ranks_match_one_rank(trained, t2i_world, finetune, tmp_path, capsys):
    args = (t2i_run_args if finetune == "full" else t2i_lora_run_args)(t2i_world)
    one = losses(trained(args))  # the integration tests' runs (micro-batch 8 on one rank)
    split = [a for a in args if not a.startswith("trainer.micro_batch_size=")]
    run = trained(
        [
            *split,
            "trainer.micro_batch_size=4",
            "parallel.zero_stage=2",
            "toggles.activation_checkpointing=full",
            "trainer.eval=false",
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


def test_context_parallel_matches_one_rank(trained, t2i_world):
    """parallel.cp=2 (DeepSpeed-Ulysses over SD3's image tokens, the text stream whole on both ranks; ZeRO-2 over
    them) against the integration tests' one-rank run: the same global batch of 8 on both cp ranks. The losses, and
    the gradient norms (AdamW hides a gradient's scale from the losses: a cp-fold error would show only there)."""
    from common.metrics import read_metrics

    args = t2i_run_args(t2i_world)
    runs = [trained(args), trained([*args, "parallel.cp=2", "parallel.zero_stage=2", "trainer.eval=false"], nproc=2)]
    ref, got = ({r["step"]: r for r in read_metrics(run / "metrics.jsonl")} for run in runs)
    assert sorted(got) == sorted(ref)
    for key in ("loss", "grad_norm"):
        worst = max(abs(got[s][key] - ref[s][key]) / abs(ref[s][key]) for s in ref)
        print(f"t2i_tiny cp=2 vs one rank: max relative {key} difference over {len(ref)} steps {worst:.1e}")
        assert worst <= 1e-5, key
