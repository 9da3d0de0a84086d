"""vlm_tiny on 2 gloo ranks with ZeRO-2 and packing: trains, and matches its single-rank token accounting."""

from __future__ import annotations

import json

import pytest

from tests.conftest import losses
from tests.fixtures.runs import VLM_ZERO2

pytestmark = pytest.mark.distributed


def test_vlm_tiny_zero2_on_two_ranks_trains(trained):
    tmp_path = trained(VLM_ZERO2, 2)  # test_export_any exports its checkpoint
    ls = losses(tmp_path)
    assert sorted(ls) == list(range(1, 21))
    assert sum(ls[s] for s in range(16, 21)) < 0.5 * sum(ls[s] for s in range(1, 6))
    memory = json.loads((tmp_path / "memory.json").read_text())
    assert memory["zero_stage"] == 2 and memory["world_size"] == 2
    assert (tmp_path / "export" / "model.safetensors").exists()
