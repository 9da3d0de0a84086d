"""Unit tests for common.data.webdataset: rank/worker coverage, determinism, exact resume, corrupt shards, in-order reads."""

from __future__ import annotations

import json
import logging
import random
import re
import tarfile

import numpy as np
import pytest
import torch
import webdataset as wds

from common.data.webdataset import build_webdataset_loader, iter_samples
from common.errors import DataError

# Uneven shard sizes so that workers (and ranks) produce different numbers of batches and
# drop partial batches of different sizes.
SIZES = [7, 13, 5, 11, 15, 6, 12, 4]
BATCH = 3


def decode_id(sample: dict) -> dict:
    """Module-level so DataLoader workers can run it. Fails on non-numeric ids (corrupt samples)."""
    return {"id": int(sample["cls"])}


def write_shards(root, sizes=SIZES) -> tuple[list[str], dict[str, list[int]]]:
    """Shard i holds ids i*100 .. i*100+size-1. Returns urls and url -> ids."""
    urls, ids = [], {}
    for i, n in enumerate(sizes):
        url = str(root / f"shard-{i:04d}.tar")
        with wds.TarWriter(url, mtime=0) as sink:
            for j in range(n):
                sink.write({"__key__": f"s{i:04d}_{j:04d}", "cls": i * 100 + j})
        urls.append(url)
        ids[url] = [i * 100 + j for j in range(n)]
    return urls, ids


def make(urls, **kw):
    args = dict(decode=decode_id, batch_size=BATCH, rank=0, world_size=1, num_workers=0, seed=0, shuffle_buffer=16)
    args.update(kw)
    return build_webdataset_loader(urls, **args)


def take(loader, n: int) -> list[list[int]]:
    it = iter(loader)
    return [next(it)["id"].tolist() for _ in range(n)]


@pytest.fixture
def shards(tmp_path):
    return write_shards(tmp_path)


@pytest.mark.parametrize("rank", [0, 1])
def test_one_epoch_covers_each_sample_once_across_2_ranks_x_2_workers(shards, rank):
    urls, ids = shards
    world, workers = 2, 2
    # The layout the loader promises: rank r -> urls[r::2], worker w -> that[w::2].
    per_worker = [urls[rank::world][w::workers] for w in range(workers)]
    worker_ids = [[i for u in shard_list for i in ids[u]] for shard_list in per_worker]
    full_batches = [len(x) // BATCH for x in worker_ids]
    assert full_batches[0] != full_batches[1], "test data should give workers unequal batch counts"

    loader = make(urls, rank=rank, world_size=world, num_workers=workers)
    epoch0 = take(loader, sum(full_batches))
    assert loader.epoch == 0
    seen = [i for b in epoch0 for i in b]
    assert all(len(b) == BATCH for b in epoch0)
    assert len(seen) == len(set(seen)), "a sample repeated within an epoch"
    for w in range(workers):
        mine = set(worker_ids[w])
        got = mine & set(seen)
        # Each worker drops exactly its final partial batch, nothing else.
        assert len(mine) - len(got) == len(worker_ids[w]) % BATCH
    assert set(seen) <= set(worker_ids[0]) | set(worker_ids[1])  # nothing from the other rank

    # The next batch belongs to epoch 1.
    nxt = take(loader, 1)
    assert loader.epoch == 1 and set(nxt[0]) <= set(worker_ids[0]) | set(worker_ids[1])


def test_ranks_partition_the_dataset(shards):
    urls, ids = shards
    seen = {}
    for rank in range(2):
        loader = make(urls, rank=rank, world_size=2, num_workers=0, shuffle_buffer=0)
        n = sum(len(ids[u]) for u in urls[rank::2]) // BATCH
        seen[rank] = {i for b in take(loader, n) for i in b}
    assert not seen[0] & seen[1]
    everything = {i for v in ids.values() for i in v}
    # rank r has one worker: it drops (its sample count % BATCH) samples.
    dropped = sum(sum(len(ids[u]) for u in urls[r::2]) % BATCH for r in range(2))
    assert len(everything) - len(seen[0] | seen[1]) == dropped


@pytest.mark.parametrize("num_workers", [0, 2])
def test_same_seed_same_batches_other_seed_differs(shards, num_workers):
    urls, _ = shards
    n = 40  # several epochs
    a = take(make(urls, num_workers=num_workers, seed=3), n)
    b = take(make(urls, num_workers=num_workers, seed=3), n)
    c = take(make(urls, num_workers=num_workers, seed=4), n)
    assert a == b
    assert a != c


def test_epochs_reshuffle(shards):
    urls, ids = shards
    loader = make(urls, num_workers=0)
    per_epoch = sum(SIZES) // BATCH
    batches = take(loader, 2 * per_epoch)
    e0, e1 = batches[:per_epoch], batches[per_epoch:]
    assert loader.epoch == 1
    assert e0 != e1
    # With no shuffle at all the order is the shard order, the same every epoch.
    plain = take(make(urls, num_workers=0, shuffle_buffer=0, shuffle_shards=False), 2 * per_epoch)
    flat = [i for b in plain[:per_epoch] for i in b]
    assert flat == [i for u in urls for i in ids[u]][: per_epoch * BATCH]
    assert plain[:per_epoch] == plain[per_epoch:]


def _resume_matches(urls, k: int, total: int, **kw) -> None:
    reference = take(make(urls, **kw), total)
    first = make(urls, **kw)
    head = take(first, k)
    state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON checkpoint
    second = make(urls, **kw)
    second.load_state_dict(state)
    tail = take(second, total - k)
    assert head + tail == reference, f"resume after {k} batches diverged"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_is_exact(shards, num_workers):
    urls, _ = shards
    per_epoch = sum(SIZES) // BATCH  # upper bound; exact count differs per worker split
    total = 2 * per_epoch + 5
    # Stops: first batch, mid-epoch (odd and even so the next worker differs), near and past
    # the epoch boundary, and inside epoch 1.
    loader = make(urls, num_workers=num_workers)
    it = iter(loader)
    boundary = None
    for i in range(total):
        next(it)
        if loader.epoch == 1 and boundary is None:
            boundary = i  # batches 0..i-1 were epoch 0
    assert boundary is not None
    for k in sorted({1, 4, 7, boundary - 1, boundary, boundary + 1, boundary + 6}):
        _resume_matches(urls, k, total, num_workers=num_workers)


@pytest.mark.parametrize("rank", [0, 1])
def test_resume_is_exact_for_each_of_2_ranks(shards, rank):
    urls, _ = shards
    for k in (2, 5, 9):
        _resume_matches(urls, k, 20, rank=rank, world_size=2, num_workers=2)


def test_resume_rejects_other_layout(shards):
    urls, _ = shards
    loader = make(urls, num_workers=0)
    take(loader, 3)
    other = make(urls, num_workers=2)
    with pytest.raises(DataError, match="num_workers"):
        other.load_state_dict(loader.state_dict())
    with pytest.raises(DataError, match="url_names"):
        make(list(reversed(urls)), num_workers=0).load_state_dict(loader.state_dict())


def test_the_llm_loader_names_the_keys_behind_its_batch(shards):
    """The LLM reads one stream of micro_batch_size x dp documents per micro-batch: a resume that changes that
    product names both keys (as the DiT's and VLM's global batch does), not the loader's batch_size alone."""
    from common.launch import compose
    from recipes.llm.data import build_train_loader

    urls, _ = shards
    cfg = compose(["recipe=llm_tiny", "trainer.micro_batch_size=8"])
    saved = build_train_loader(cfg, urls, dp=2).state_dict()
    with pytest.raises(DataError, match=re.escape(
            "batch_size was 16 when saved, now 8 (documents per micro-batch: trainer.micro_batch_size=8 x dp=1 "
            "data-parallel ranks; set them so that their product is 16)")):
        build_train_loader(cfg, urls, dp=1).load_state_dict(saved)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_global_rng_untouched(shards, num_workers):
    urls, _ = shards
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    loader = make(urls, num_workers=num_workers)
    take(loader, 30)  # crosses an epoch boundary, so several DataLoader iterators were created
    loader.load_state_dict(loader.state_dict())
    take(loader, 2)
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])


def test_build_time_errors(shards, tmp_path):
    urls, _ = shards
    with pytest.raises(DataError, match=r"4 shards cannot feed 2 ranks x 4 workers; write more shards or lower data.num_workers"):
        make(urls[:4], world_size=2, num_workers=4)
    make(urls[:4], world_size=2, num_workers=2)  # exactly enough is fine
    with pytest.raises(ValueError, match="empty"):
        make([])
    missing = str(tmp_path / "nope-000000.tar")
    with pytest.raises(FileNotFoundError, match="nope-000000.tar"):
        make(urls + [missing])
    with pytest.raises(ValueError, match="rank"):
        make(urls, rank=2, world_size=2)


def test_too_few_samples_for_a_batch_is_an_error(tmp_path):
    urls, _ = write_shards(tmp_path, sizes=[1, 1])
    with pytest.raises(DataError, match="no full batch"):
        take(make(urls), 1)


def _corrupt_set(tmp_path):
    """8 shards: #2 truncated inside a sample, #5 garbage bytes, #6 has a sample that fails to decode."""
    urls, ids = write_shards(tmp_path)
    # Shard 2 rewritten with a 2 KiB payload per sample, then cut in the middle of the 4th
    # sample's payload (a cut at a member boundary would read as a shorter, valid tar).
    with wds.TarWriter(urls[2], mtime=0) as sink:
        for j in range(SIZES[2]):
            sink.write({"__key__": f"s0002_{j:04d}", "cls": 200 + j, "bin": bytes(2048)})
    with tarfile.open(urls[2]) as tf:
        cut = next(m for m in tf.getmembers() if m.name == "s0002_0003.bin").offset_data + 1000
    data = open(urls[2], "rb").read()
    open(urls[2], "wb").write(data[:cut])
    open(urls[5], "wb").write(b"this is not a tar file" * 50)
    with wds.TarWriter(urls[6], mtime=0) as sink:
        for j in range(SIZES[6]):
            sink.write({"__key__": f"s0006_{j:04d}", "cls": "garbage" if j == 4 else str(600 + j)})
    return urls, ids


def test_corrupt_shards_are_skipped_and_counted(tmp_path, caplog):
    urls, ids = _corrupt_set(tmp_path)
    good = {i for u in urls if u not in (urls[2], urls[5], urls[6]) for i in ids[u]}
    loader = make(urls, num_workers=0, shuffle_buffer=0, shuffle_shards=False, max_corrupt_shards=3)
    before_cut = {200, 201, 202, 600, 601, 602, 603}  # samples ahead of each corruption point
    it = iter(loader)
    epoch0 = []
    with caplog.at_level(logging.WARNING, logger="common.data.webdataset"):
        while True:
            batch = next(it)["id"].tolist()
            if loader.epoch == 1:
                break
            epoch0.append(batch)
    seen = {i for b in epoch0 for i in b}
    assert sum(map(len, epoch0)) == len(seen), "a sample repeated"
    assert seen <= good | before_cut  # nothing after a corruption point
    assert {600, 601, 602, 603} <= seen  # decode error: the shard's earlier samples are kept
    # Truncated tar: earlier samples are kept, except that the sample just before the cut can be
    # lost (webdataset only emits a sample once the next key starts).
    assert {200, 201} <= seen
    # Only the epoch's final partial batch is dropped (one worker).
    available = len(good) + len(seen & before_cut)
    assert len(seen) == available - available % BATCH
    assert loader.corrupt_shards == 3
    for bad in (urls[2], urls[5], urls[6]):
        assert bad in caplog.text
    # A corrupt shard counts once, not once per epoch.
    take(loader, 40)
    assert loader.epoch >= 2 and loader.corrupt_shards == 3
    assert loader.state_dict()["corrupt_shards"].keys() == {urls[2], urls[5], urls[6]}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_too_many_corrupt_shards_raise(tmp_path, num_workers):
    urls, _ = _corrupt_set(tmp_path)
    loader = make(urls, num_workers=num_workers, max_corrupt_shards=2)
    with pytest.raises(DataError, match=r"3 corrupt shard\(s\) skipped on rank 0, more than max_corrupt_shards=2"):
        take(loader, 40)
    assert loader.corrupt_shards == 3


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_is_exact_with_corrupt_shards(tmp_path, num_workers):
    urls, _ = _corrupt_set(tmp_path)
    for k in (1, 3, 6, 11, 17):
        _resume_matches(urls, k, 24, num_workers=num_workers, max_corrupt_shards=3)


def test_tar_reader_agrees_with_webdataset(shards):
    """Sanity: what the loader reads from shards is what webdataset.WebDataset reads."""
    urls, ids = shards
    via_wds = sorted(int(s["cls"]) for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False))
    via_loader = sorted(i for b in take(make(urls, shuffle_buffer=0, batch_size=1), sum(SIZES)) for i in b)
    assert via_wds == via_loader == sorted(i for v in ids.values() for i in v)


def test_iter_samples_reads_every_sample_in_shard_order_on_every_rank(shards, monkeypatch):
    """Evaluation reads the whole val split on each rank. Under torchrun (RANK/WORLD_SIZE set, as
    here) a bare wds.WebDataset refuses to (the crash this reader replaces); iter_samples does not."""
    urls, ids = shards
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="nodesplitter"):
        next(iter(wds.WebDataset(urls, shardshuffle=False, empty_check=False)))
    got = list(iter_samples(urls))
    assert [int(s["cls"]) for s in got] == [i for u in urls for i in ids[u]]  # shard after shard, file order
    assert [s["__url__"] for s in got] == [u for u in urls for _ in ids[u]]
    assert [s["__key__"] for s in got[:2]] == ["s0000_0000", "s0000_0001"]
    assert [int(s["cls"]) for s in iter_samples(urls[::-1])] == [i for u in urls[::-1] for i in ids[u]]
