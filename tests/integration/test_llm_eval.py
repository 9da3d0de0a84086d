"""The LLM recipe's held-out eval (LLMTrainer.evaluate): loss and perplexity over the val split's documents, written to
RUN_DIR/eval.json. Trained a few steps, llm_tiny and moe_tiny score lower than the same trainer's untrained model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.support.launcher import spawn_ranks

pytestmark = pytest.mark.integration


def _eval_before_and_after(recipe: str, run_dir: str) -> dict:
    from common.distributed import init_distributed
    from recipes.llm.train import LLMTrainer
    from scripts.kiln.launch import compose

    dist = init_distributed()
    cfg = compose(
        [
            f"recipe={recipe}",
            "trainer.max_steps=12",
            "trainer.log_every=12",
            "trainer.progress_bar=false",
            "checkpoint.every=0",
            "checkpoint.final=false",
            "data.num_workers=0",
            "data.eval_docs=16",
            f"run.dir={run_dir}",
        ]
    )
    trainer = LLMTrainer(cfg, dist, Path(run_dir))
    before = trainer.evaluate()
    trainer.fit()
    after = trainer.evaluate()
    return {"before": before, "after": after, "written": json.loads((Path(run_dir) / "eval.json").read_text())}


@pytest.mark.parametrize("recipe", ["llm_tiny", "moe_tiny"])
def test_held_out_loss_falls_with_training_and_is_written(recipe, tmp_path):
    result = spawn_ranks(_eval_before_and_after, (recipe, str(tmp_path / "run")), 1, tmp_path)[0]
    before, after = result["before"], result["after"]
    print(f"{recipe}: held-out loss {before['val_loss']:.3f} untrained -> {after['val_loss']:.3f} after 12 steps")
    assert result["written"] == after and (before["step"], after["step"]) == (0, 12)
    assert before["num_samples"] == after["num_samples"] == 16 and after["val_tokens"] == before["val_tokens"] > 0
    assert after["val_loss"] < before["val_loss"] - 0.3
    assert after["val_perplexity"] == pytest.approx(math.exp(after["val_loss"]))
