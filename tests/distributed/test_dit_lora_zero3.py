"""finetune=lora on the DiT under DeepSpeed ZeRO-3 on 2 gloo ranks (the frozen base partitioned too): it trains, its
checkpoints leave the frozen base out, its export is the adapter, and a resume continues bit for bit; scripts/export.py
on the last checkpoint writes the end-of-run export (the EMA adapter)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_script, losses, run_train
from tests.fixtures.lora import DIT_ADAPTED as ADAPTED
from tests.fixtures.lora import assert_same_export, checkpoint_bytes, tensors
from tests.fixtures.lora import dit_overrides as overrides

pytestmark = pytest.mark.distributed


def test_zero3_trains_the_adapter_and_resumes_bitwise(dit_lora_world, tmp_path, capsys):
    world = dit_lora_world  # test_dit_lora's
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    zero3 = ["parallel.zero_stage=3", "trainer.micro_batch_size=4", "trainer.max_steps=4"]
    run_train(overrides(world, first, *zero3, "checkpoint.every=2"), nproc=2)
    run_train(overrides(world, resumed, *zero3, f"run.resume={first / 'checkpoints' / 'step_0000002'}"), nproc=2)
    want, got = losses(first), losses(resumed)
    assert sorted(want) == [1, 2, 3, 4] and sorted(got) == [3, 4] and all(got[s] == want[s] for s in got), (want, got)
    adapter = tensors(first / "export")
    assert len(adapter) == ADAPTED and all(torch.equal(v, adapter[k]) for k, v in tensors(resumed / "export").items())
    size = sum(v.numel() * v.element_size() for v in adapter.values())
    # weights, Adam's two moments and the EMA of the adapter, split over the ranks: nothing of the base
    assert checkpoint_bytes(first / "checkpoints" / "step_0000002") <= 4 * size + 400_000
    # scripts/export.py from the last checkpoint (step 4): the EMA adapter of the TrainState, the end of the run's.
    assert load_script("export").main([str(first), "--out", str(tmp_path / "again")]) == 0, capsys.readouterr().err
    assert_same_export(first / "export", tmp_path / "again")
