"""llm_tiny in one process: activation checkpointing (full, selective) recomputes exactly, so the
losses equal the run without it; the loss is the global token mean however the batch is accumulated."""

from __future__ import annotations

import pytest

from tests.conftest import losses, run_train

pytestmark = pytest.mark.integration
BASE = [
    "recipe=llm_tiny",
    "trainer.max_steps=5",
    "trainer.log_every=1",
    "trainer.progress_bar=false",
    "checkpoint.final=false",
]


def test_activation_checkpointing_changes_memory_not_math(tmp_path):
    runs = {}
    for mode in ("none", "full", "selective"):
        runs[mode] = tmp_path / mode
        run_train([*BASE, f"toggles.activation_checkpointing={mode}", f"run.dir={runs[mode]}"])
    ref = losses(runs["none"])
    assert sorted(ref) == [1, 2, 3, 4, 5] and ref[5] < ref[1]
    for mode in ("full", "selective"):
        got = losses(runs[mode])
        for step in ref:
            assert got[step] == pytest.approx(ref[step], rel=1e-6), f"{mode} step {step}"


def test_the_loss_is_the_global_token_mean_however_the_batch_is_accumulated(tmp_path):
    """One definition of the loss (common/trainer.py): the sum over the global batch divided by its labelled
    tokens, and the gradient of exactly that. The same 8 documents per step as one micro-batch or as two of 4
    (packed into other rows: document masking keeps the math) give the same losses step after step, the
    later steps through the first steps' gradients. A mean of per-micro-batch means would not: their token
    counts differ."""
    one, two = tmp_path / "one", tmp_path / "two"
    run_train([*BASE, "trainer.max_steps=3", "trainer.micro_batch_size=8", f"run.dir={one}"])
    run_train([*BASE, "trainer.max_steps=3", "trainer.micro_batch_size=4", "trainer.grad_accum=2", f"run.dir={two}"])
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step


def _rows_and_saved_bytes(run_dir: str) -> list[tuple]:
    from pathlib import Path

    from common.activations import kept_for_backward
    from common.distributed import init_distributed
    from common.memory import configured_layout, estimate
    from recipes.llm.sizing import memory_spec
    from recipes.llm.train import LLMTrainer
    from scripts.kiln.launch import compose

    cfg = compose([*BASE, "data.max_seq_len=128", "trainer.micro_batch_size=4", "data.num_workers=0"])
    trainer = LLMTrainer(cfg, init_distributed(), Path(run_dir))
    spec = memory_spec(cfg)
    planned = estimate(spec, configured_layout(spec, dp=1, tp=1, pp=1, zero_stage=0, ac="none"))["activations"]
    weights = [*trainer.model.parameters(), *trainer.model.buffers()]
    out, batches = [], iter(trainer.state.loader)
    for _ in range(4):
        global_rows = next(batches)
        batch = trainer.prepare(global_rows)
        p = batch.packed
        kept, loss = kept_for_backward(lambda: trainer.loss(batch), iter([*weights, p.input_ids, p.labels]))
        longest = max(len(piece["input_ids"]) for row in global_rows for piece in row)
        out.append((tuple(p.input_ids.shape), p.num_real_tokens, kept / planned, longest))
    trainer.state.loader.close()
    return out


def test_a_micro_batch_is_micro_batch_size_rows_and_the_planner_prices_it(tmp_path):
    """trainer.micro_batch_size counts rows of data.max_seq_len tokens, on documents longer than a row too (pydoc's
    run to ~1,000 tokens): each micro-batch is 4 x 128 token slots, all filled (text is cut at row ends), and what
    its forward + loss keeps for backward is what the memory planner (run.dry_run, scripts/plan.py) prices for
    "micro batch 4 x 128 tokens". When a micro-batch counted documents, the same config laid 10-16 rows per step
    and kept 2.5-4.0x the planned bytes."""
    from tests.support.launcher import spawn_ranks

    steps = spawn_ranks(_rows_and_saved_bytes, (str(tmp_path / "run"),), 1, tmp_path)[0]
    print("shape, tokens, kept / planned, longest piece:", steps)
    for shape, tokens, ratio, longest in steps:
        assert tuple(shape) == (4, 128) and tokens == 4 * 128 and longest <= 128
        assert ratio == pytest.approx(1.0, abs=0.05)
