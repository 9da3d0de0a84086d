"""The global sample stream on 2 gloo ranks: each rank decodes its own share, so each meets its own decode failures;
the loader state a checkpoint stores is the same on every rank and names the shards any rank found corrupt."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.test_webdataset import _corrupt_set, collate_ids, global_loader, steps

pytestmark = pytest.mark.distributed


def _save_on_rank(rank: int, urls: list[str], out: str) -> None:
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
    try:
        loader = global_loader(urls, rank=rank, dp=2, micro=2, accum=2, collate=collate_ids)
        steps(loader, 6, accum=2)  # epoch 0
        own = loader.loader.state_dict()["corrupt_shards"]
        with open(f"{out}/{rank}.json", "w") as f:
            json.dump({"own": own, "saved": loader.state_dict()}, f)  # state_dict: collective
    finally:
        tdist.destroy_process_group()


def test_a_checkpoint_records_every_ranks_corrupt_shards(tmp_path):
    """Ranks decode different samples, so each meets its own failures; the state a checkpoint stores (rank 0's)
    is the same on every rank and names the shards any rank found corrupt."""
    urls, _ = _corrupt_set(tmp_path)
    torch.multiprocessing.spawn(_save_on_rank, args=(urls, str(tmp_path)), nprocs=2)
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert got[0]["own"] != got[1]["own"]  # one rank owned the sample that fails to decode
    assert got[0]["saved"] == got[1]["saved"]
    union = got[0]["own"] | got[1]["own"]
    assert set(got[0]["saved"]["loader"]["corrupt_shards"]) == set(union) == {urls[2], urls[5], urls[6]}
