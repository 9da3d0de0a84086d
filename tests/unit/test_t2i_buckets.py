"""Aspect-ratio buckets (data/prepare_captions.py --buckets, data.buckets) and data.max_bad_samples: the bucket a
shape goes to, global batches of one bucket on any layout with an exact resume (common/data/webdataset.py's grouped
global stream), a short bucketed run, and the one-line refusals."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import webdataset as wds

from common.data.webdataset import build_webdataset_loader, global_train_loader

GROUPS = 2


def decode_id(sample: dict) -> dict:
    return {"id": int(sample["cls"]), "group": sample["grp"].decode()}


def group_of(sample: dict) -> bytes:
    return sample["grp"]


def collate(samples: list[dict]) -> dict:
    return {"id": [s["id"] for s in samples], "group": [s["group"] for s in samples]}


def write_grouped_shards(root, sizes=(9, 14, 6, 11)) -> list[str]:
    """Shard i holds ids i*100 + j; a sample's group is "a" or "b" by an arbitrary rule (about a third "b")."""
    urls = []
    for i, n in enumerate(sizes):
        url = str(root / f"g-{i:04d}.tar")
        with wds.TarWriter(url, mtime=0) as sink:
            for j in range(n):
                sink.write({"__key__": f"s{i}_{j}", "cls": i * 100 + j, "grp": "b" if (i * 7 + j) % 3 == 0 else "a"})
        urls.append(url)
    return urls


def grouped_loader(urls, *, rank, dp, micro, accum):
    cfg = SimpleNamespace(
        trainer=SimpleNamespace(micro_batch_size=micro, grad_accum=accum, seed=0),
        data=SimpleNamespace(num_workers=0, shuffle_buffer=16, max_corrupt_shards=0),
    )
    return global_train_loader(cfg, urls, decode=decode_id, rank=rank, dp=dp, collate=collate, group=group_of)


def reference_steps(urls, global_batch: int, n: int) -> list[list[int]]:
    """The independent reference: the plain loader's sample order (batch 1, the same seeds and shuffle), queued per
    group by hand; a group whose queue holds a global batch is the next step; epochs follow one another."""
    plain = iter(
        build_webdataset_loader(
            urls, decode=decode_id, collate=collate, batch_size=1, rank=0, world_size=1, seed=0, shuffle_buffer=16
        )
    )
    out, queues, epoch = [], {}, 0
    while len(out) < n:
        sample = next(plain)
        if plain_epoch(plain) != epoch:  # leftovers of an epoch are dropped
            queues, epoch = {}, plain_epoch(plain)
        queue = queues.setdefault(sample["group"][0], [])
        queue.append(sample["id"][0])
        if len(queue) == global_batch:
            out.append(queues.pop(sample["group"][0]))
    return out


def plain_epoch(it) -> int:
    return it.gi_frame.f_locals["self"].epoch


def run_steps(loader, n: int, accum: int) -> list[list[dict]]:
    it = iter(loader)
    return [[next(it) for _ in range(accum)] for _ in range(n)]


def test_grouped_global_batches_are_one_group_the_same_on_every_layout_and_resume(tmp_path):
    urls = write_grouped_shards(tmp_path)  # 40 samples: 3 steps of 4 per epoch at least, 2 groups
    n = 12  # crosses epoch boundaries
    reference = reference_steps(urls, 4, n)
    layouts = {"dp1": (1, 2, 2), "dp2": (2, 1, 2), "dp2_micro2": (2, 2, 1)}  # dp, micro, accum: 4 samples a step
    for name, (dp, micro, accum) in layouts.items():
        ranks = [run_steps(grouped_loader(urls, rank=r, dp=dp, micro=micro, accum=accum), n, accum) for r in range(dp)]
        for step in range(n):
            ids, groups = [], set()
            for i in range(accum):
                parts = [ranks[r][step][i] for r in range(dp)]
                for part in parts:
                    assert len(set(part["group"])) == 1, (name, step, i)  # every micro-batch: one bucket
                    groups |= set(part["group"])
                ids += [x for tup in zip(*(p["id"] for p in parts), strict=True) for x in tup]
            assert len(groups) == 1, (name, step)
            assert ids == reference[step], (name, step)
    # Resume mid-stream (3 steps at dp=2, queues part full) at dp=1: the same next steps.
    first = grouped_loader(urls, rank=1, dp=2, micro=1, accum=2)
    run_steps(first, 5, 2)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = grouped_loader(urls, rank=0, dp=1, micro=4, accum=1)
    resumed.load_state_dict(state)
    assert [s[0]["id"] for s in run_steps(resumed, n - 5, 1)] == reference[5:]
    # An ungrouped loader refuses a grouped position.
    cfg = SimpleNamespace(
        trainer=SimpleNamespace(micro_batch_size=4, grad_accum=1, seed=0),
        data=SimpleNamespace(num_workers=0, shuffle_buffer=16, max_corrupt_shards=0),
    )
    plain = global_train_loader(cfg, urls, decode=decode_id, rank=0, dp=1, collate=collate)
    with pytest.raises(Exception, match="grouped was True when saved"):
        plain.load_state_dict(state)
