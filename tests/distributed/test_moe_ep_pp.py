"""An MoE under expert x pipeline parallelism (gloo, 4 ranks: parallel.ep=2 x parallel.pp=2, each stage's experts split
over an ep pair) against one process on the same global batch, fp32: per-step losses, the load-balancing loss (whose
routing counts cross the stages: recipes/llm/pipeline_parallel.py:_CarriedCounts) and the gradient norm (clipped across
the stages and the experts' mesh) and the held-out eval; its checkpoint resumes in one process (ep=1, pp=1) and
continues the same run.

Short documents (one packed row each at most) and one pipeline microbatch per step (gpipe, pp_microbatches=1): the
pipeline then sees the step's whole micro-batch at once, so its aux loss is the one-process step's, not a
per-microbatch one (recipes/llm/moe_losses.py:MoEAux)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import metrics, run_train
from tests.fixtures.llm import write_moe_folder, write_token_dataset

pytestmark = pytest.mark.distributed
STEPS = 4
GLOBAL_DOCS = 8


def base(data: Path) -> list[str]:
    return [
        "recipe=moe_tiny",
        "model.moe.num_experts=4",
        f"data.root={data}",
        "data.build=[]",
        "data.num_workers=0",
        "data.max_seq_len=128",
        f"trainer.max_steps={STEPS}",
        "trainer.log_every=1",
        "trainer.progress_bar=false",
        "checkpoint.every=2",
        "checkpoint.final=false",
        "profile.count_flops=false",
    ]


EP2_PP2 = ["parallel.ep=2", "parallel.pp=2", f"trainer.micro_batch_size={GLOBAL_DOCS // 2}"]
LAYOUTS = {
    "single": (1, [f"trainer.micro_batch_size={GLOBAL_DOCS}"]),
    "ep2_pp2": (4, [*EP2_PP2, "parallel.pp_schedule=gpipe", "parallel.pp_microbatches=1"]),
    # Two pipeline microbatches (rows cut at 64 tokens: both hold documents): the aux loss is per microbatch
    # (another objective than one process's), the same under GPipe (every forward before any backward) as
    # under 1F1B, whose first microbatch's backward runs before the second's forward on the last stage.
    "gpipe_m2": (4, [*EP2_PP2, "parallel.pp_schedule=gpipe", "parallel.pp_microbatches=2", "data.max_seq_len=64"]),
    "1f1b_m2": (4, [*EP2_PP2, "parallel.pp_schedule=1f1b", "parallel.pp_microbatches=2", "data.max_seq_len=64"]),
}


def steps(run_dir: Path) -> dict[int, tuple[float, float, float]]:
    return metrics(run_dir, "loss", "aux_loss", "grad_norm")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_ep_pp")
    tokenizer = write_moe_folder(root / "tokenizer", "qwen3_moe")
    data = write_token_dataset(root / "data", tokenizer, docs=96, max_chars=120)
    out = {"data": data}
    for name, (nproc, extra) in LAYOUTS.items():
        out[name] = root / name
        run_train([*base(data), *extra, f"run.dir={out[name]}"], nproc=nproc, timeout=900)
    return out


def test_losses_aux_loss_and_grad_norm_match_single_process(runs):
    ref, got = steps(runs["single"]), steps(runs["ep2_pp2"])
    assert sorted(got) == list(range(1, STEPS + 1))
    worst = max(abs(g - r) / abs(r) for s in ref for g, r in zip(got[s], ref[s]))
    print(f"ep2 x pp2: worst relative difference of loss, aux_loss or grad_norm over {STEPS} steps: {worst:.1e}")
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step


def test_per_microbatch_aux_loss_is_the_same_under_1f1b_as_under_gpipe(runs):
    ref, got = steps(runs["gpipe_m2"]), steps(runs["1f1b_m2"])
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step


def test_ep2_pp2_checkpoint_resumes_in_one_process(runs, tmp_path):
    resumed = tmp_path / "resumed"
    ckpt = runs["ep2_pp2"] / "checkpoints" / "step_0000002"
    run_train([*base(runs["data"]), *LAYOUTS["single"][1], f"run.dir={resumed}", f"run.resume={ckpt}"], timeout=900)
    ref, got = steps(runs["ep2_pp2"]), steps(resumed)
    assert sorted(got) == list(range(3, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step


def test_held_out_eval_under_ep2_pp2_matches_single_process(runs):
    """The end-of-run eval (recipes/llm/train.py:LLMTrainer.evaluate) runs the pipeline forward only (schedule.eval)."""
    ref, got = (json.loads((runs[name] / "eval.json").read_text()) for name in ("single", "ep2_pp2"))
    assert got["step"] == ref["step"] == STEPS and got["val_tokens"] == ref["val_tokens"] > 0
    assert got["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)
