"""Unit tests for common.data.webdataset: rank/worker coverage, determinism, exact resume, corrupt shards, in-order
reads, and the global stream that each data-parallel rank decodes only its share of."""

from __future__ import annotations

import functools
import json
import logging
import random
import re
import tarfile
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import webdataset as wds

from common.data.webdataset import PackPlan, build_webdataset_loader, global_train_loader, iter_samples
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
    """The LLM lays one stream into micro_batch_size x dp rows per micro-batch: a resume that changes that
    product names both keys (as the DiT's and VLM's global batch does), not the loader's batch_size alone."""
    from recipes.llm.data import build_train_loader
    from scripts.kiln.launch import compose

    urls, _ = shards
    cfg = compose(["recipe=llm_tiny", "trainer.micro_batch_size=8"])
    saved = build_train_loader(cfg, urls, dp=2, chat=False).state_dict()
    with pytest.raises(
        DataError,
        match=re.escape(
            "batch_size was 16 when saved, now 8 (rows per global micro-batch: trainer.micro_batch_size=8 x dp=1 "
            "data-parallel ranks; set them so that their product is 16)"
        ),
    ):
        build_train_loader(cfg, urls, dp=1, chat=False).load_state_dict(saved)


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
    with pytest.raises(
        DataError, match=r"4 shards cannot feed 2 ranks x 4 workers; write more shards or lower data.num_workers"
    ):
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


def test_too_few_samples_for_a_recipes_batch_names_the_keys_to_change(tmp_path):
    """A small set under a big batch (recipe=vlm_7b's 16 a rank, 4 workers): the line says what makes the batch."""
    urls, _ = write_shards(tmp_path, sizes=[3, 3, 3, 3])
    with pytest.raises(DataError) as err:
        next(iter(global_loader(urls, rank=0, dp=2, micro=4, accum=2)))
    said = str(err.value)
    assert (
        "no full batch of 16 in epoch 0 (the global batch: trainer.micro_batch_size=4 x trainer.grad_accum=2 x 2 "
        in said
    )
    assert "lower those or data.num_workers=0, or add training samples to data.root" in said and "\n" not in said


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


# ---- the global stream: each data-parallel rank decodes only its share ---------------------------------------------
GLOBAL = 8  # samples per optimizer step in every layout below


def decode_logged(sample: dict, log) -> dict:
    """decode_id that appends the sample's id to `log` (one file per rank, appended from any worker process)."""
    with open(log, "a") as f:
        f.write(f"{sample['cls'].decode()}\n")
    return decode_id(sample)


def decoded(log) -> list[int]:
    return [int(line) for line in open(log).read().split()] if log.exists() else []


def decode_id_or_none(sample: dict) -> dict:
    """decode_id that decodes everything: a corrupt sample reads as id None."""
    try:
        return decode_id(sample)
    except ValueError:
        return {"id": None}


def collate_ids(samples: list[dict]) -> dict:
    """A collate that takes an empty micro-batch (as the VLM's does, with its blank image)."""
    return {"id": [s["id"] for s in samples]}


def whole_stream(urls, batch_size: int, n: int) -> list[int | None]:
    """The ids of n batches of the plain loader, everything decoded (a corrupt sample as None, not skipped)."""
    it = iter(make(urls, decode=decode_id_or_none, collate=collate_ids, batch_size=batch_size, max_corrupt_shards=3))
    return [i for _ in range(n) for i in next(it)["id"]]


def global_loader(urls, *, rank, dp, micro, accum, num_workers=0, decode=decode_id, **kw):
    cfg = SimpleNamespace(
        trainer=SimpleNamespace(micro_batch_size=micro, grad_accum=accum, seed=0),
        data=SimpleNamespace(num_workers=num_workers, shuffle_buffer=16, max_corrupt_shards=3),
    )
    return global_train_loader(cfg, urls, decode=decode, rank=rank, dp=dp, **kw)


def steps(loader, n: int, accum: int) -> list[list[tuple[list, list[int]]]]:
    """n optimizer steps of (ids, sample_ids) per micro-batch."""
    it = iter(loader)
    out = []
    for _ in range(n):
        micro = [next(it) for _ in range(accum)]
        out.append(
            [
                (list(map(int, b["id"])) if isinstance(b["id"], torch.Tensor) else b["id"], b["sample_ids"])
                for b in micro
            ]
        )
    return out


def interleave(parts: list[list]) -> list:
    """Rank r's k-th sample is the (k*dp + r)-th of the micro-batch."""
    return [x for group in zip(*parts, strict=True) for x in group]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_rank_decodes_only_its_share_of_the_global_stream(shards, tmp_path, num_workers):
    urls, _ = shards
    # In-process: crosses an epoch boundary (73 samples: 9 global batches per epoch). With 2 workers (8 per epoch)
    # it stays in epoch 0, where a sample decoded ahead (prefetch) is told apart from another rank's by its id.
    n = 12 if num_workers == 0 else 5
    # The independent reference: the plain loader over the same stream, one global batch at a time, everything
    # decoded (what each rank read before).
    plain = take(make(urls, num_workers=num_workers, batch_size=GLOBAL), n)
    logs = {key: tmp_path / f"decoded_{key}" for key in ("dp1", 0, 1)}
    one = steps(
        global_loader(
            urls,
            rank=0,
            dp=1,
            micro=4,
            accum=2,
            num_workers=num_workers,
            decode=functools.partial(decode_logged, log=logs["dp1"]),
        ),
        n,
        accum=2,
    )
    two = {
        r: steps(
            global_loader(
                urls,
                rank=r,
                dp=2,
                micro=2,
                accum=2,
                num_workers=num_workers,
                decode=functools.partial(decode_logged, log=logs[r]),
            ),
            n,
            accum=2,
        )
        for r in (0, 1)
    }
    for step in range(n):
        assert [i for ids, _ in one[step] for i in ids] == plain[step]
        assert [j for _, ids in one[step] for j in ids] == list(range(step * GLOBAL, (step + 1) * GLOBAL))
        for m in range(2):  # micro-batch m of the step: rank r holds samples r, r+2 of its 4
            assert interleave([two[r][step][m][0] for r in (0, 1)]) == one[step][m][0]
            assert interleave([two[r][step][m][1] for r in (0, 1)]) == one[step][m][1]
    trained = {r: [i for step in two[r] for ids, _ in step for i in ids] for r in (0, 1)}
    if num_workers == 0:  # in-process: exactly what was handed out was decoded, each sample once
        assert decoded(logs[0]) == trained[0] and decoded(logs[1]) == trained[1]
        assert len(decoded(logs[0])) == len(decoded(logs[1])) == n * GLOBAL // 2
        assert decoded(logs["dp1"]) == [i for batch in plain for i in batch]  # not even an epoch's dropped tail
    else:  # the workers decode, some batches ahead, but never another rank's sample
        for r in (0, 1):
            assert len(set(decoded(logs[r]))) == len(decoded(logs[r]))  # each sample once
            assert set(trained[r]) <= set(decoded(logs[r]))
            assert not set(decoded(logs[r])) & set(trained[1 - r])


def test_a_sample_that_fails_to_decode_is_skipped_by_its_rank_alone(tmp_path):
    """The garbage sample of shard 6 is dropped from its owner's micro-batch; the other rank's batches, every step
    boundary and the shard's later samples stay; the unreadable shards 2 and 5 end alike on both ranks."""
    urls, _ = _corrupt_set(tmp_path)
    n = 12  # two epochs (6 global batches each of the ~55 readable samples)
    stream = whole_stream(urls, GLOBAL, n)
    garbage = [k for k, i in enumerate(stream) if i is None]
    assert len(garbage) == 2  # once per epoch
    loaders = {r: global_loader(urls, rank=r, dp=2, micro=2, accum=2, collate=collate_ids) for r in (0, 1)}
    got = {r: steps(loaders[r], n, accum=2) for r in (0, 1)}
    for r in (0, 1):
        ids_r = [i for step in got[r] for batch, _ in step for i in batch]
        sample_ids = [j for step in got[r] for _, batch in step for j in batch]
        owned = [k for k in range(n * GLOBAL) if k % 2 == r and k not in garbage]
        assert sample_ids == owned  # positions in the stream: nothing shifted
        assert ids_r == [stream[k] for k in owned]
    for r in (0, 1):  # the unreadable shards 2 and 5 on both, shard 6 on the rank(s) that owned its garbage
        assert loaders[r].corrupt_shards == 2 + any(k % 2 == r for k in garbage)
    seen = {i for r in (0, 1) for step in got[r] for batch, _ in step for i in batch}
    assert {i for i in seen if 604 < i < 700}  # shard 6's samples after the garbage one are still trained


def test_a_micro_batch_left_empty_is_an_error_unless_collate_takes_it(tmp_path):
    urls, _ = _corrupt_set(tmp_path)
    n = 14  # one epoch of ~55 readable samples
    stream = whole_stream(urls, 4, n)
    k = stream.index(None)
    owner, step = k % 4, k // 4
    got = steps(global_loader(urls, rank=owner, dp=4, micro=1, accum=1, collate=collate_ids), step + 1, accum=1)
    assert got[step] == [([], [])]  # an empty micro-batch at its place in the stream
    with pytest.raises(DataError, match=f"every sample of rank {owner}'s micro-batch 0 of step {step + 1} failed"):
        steps(global_loader(urls, rank=owner, dp=4, micro=1, accum=1), step + 1, accum=1)


# A GlobalBatches state written by the code before each rank decoded only its share (rank 0 of dp=2, micro 2,
# accum 2, 3 steps on write_shards' data): the format is unchanged, so it still resumes, in any layout.
OLD_STATE = {
    "global_batches": 3,
    "global_batch": 8,
    "loader": {
        "version": 1,
        "epoch": 0,
        "next_worker": 0,
        "workers": [{"drawn": 24, "batches": 3, "bad": {}}],
        "corrupt_shards": {},
        "layout": {
            "rank": 0,
            "world_size": 1,
            "num_workers": 0,
            "batch_size": 8,
            "seed": 0,
            "shuffle_buffer": 16,
            "shuffle_shards": True,
            "num_urls": 8,
            "url_names_sha1": "709dcbcc949c3ccc",
        },
    },
}


def test_global_stream_resumes_in_another_layout(shards):
    urls, _ = shards
    reference = steps(global_loader(urls, rank=0, dp=1, micro=2, accum=4), 10, accum=4)
    # What that code handed rank 0 in those 3 steps, recorded with the state: still the stream's samples.
    assert [i for step in reference[:3] for ids, _ in step for i in ids][0::2] == [
        1,
        0,
        202,
        201,
        200,
        402,
        503,
        406,
        404,
        413,
        411,
        501,
    ]
    for state in (OLD_STATE, None):
        if state is None:  # today's: 4 steps at dp=2, then resumed at dp=1 (micro 2, accum 4) and vice versa
            first = global_loader(urls, rank=1, dp=2, micro=2, accum=2)
            steps(first, 4, accum=2)
            state = json.loads(json.dumps(first.state_dict()))
        done = state["global_batches"]
        resumed = global_loader(urls, rank=0, dp=1, micro=2, accum=4)
        resumed.load_state_dict(state)
        assert steps(resumed, 10 - done, accum=4) == reference[done:]
        halves = {}
        for r in (0, 1):
            halves[r] = global_loader(urls, rank=r, dp=2, micro=4, accum=1)
            halves[r].load_state_dict(state)
        for step, (a, b) in enumerate(
            zip(steps(halves[0], 10 - done, accum=1), steps(halves[1], 10 - done, accum=1), strict=True)
        ):
            whole = reference[done + step]
            assert interleave([a[0][0], b[0][0]]) == [i for ids, _ in whole for i in ids]


def _wire_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "ids": torch.randint(0, 1000, (4, 33), generator=g),
        "bf16": torch.randn(3, 5, generator=g).bfloat16(),
        "mask": torch.rand(7, generator=g) > 0.5,
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "cu": torch.tensor([0, 3, 9], dtype=torch.int32),
        "strided": torch.arange(24.0).view(4, 6).t(),
        "big": torch.randn(300, 1000, generator=g),
    }  # 1.2 MB: over INLINE_BYTES, through shared memory


class _WireStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        from multiprocessing.reduction import ForkingPickler

        tensors = _wire_tensors()
        yield {"tensors": tensors, "pickled": {k: len(ForkingPickler.dumps(t)) for k, t in tensors.items()}}


def test_loader_workers_send_small_tensors_by_value_and_equal():
    """A worker's small tensors travel inside the pickled message (no shared-memory handover each), the big one
    through shared memory; every one arrives equal in dtype, shape and bits."""
    from common.data.webdataset import INLINE_BYTES, _init_worker

    loader = torch.utils.data.DataLoader(_WireStream(), batch_size=None, num_workers=1, worker_init_fn=_init_worker)
    (item,) = list(loader)
    for name, want in _wire_tensors().items():
        got = item["tensors"][name]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
        nbytes = want.numel() * want.element_size()
        inline = item["pickled"][name] >= nbytes
        assert inline == (nbytes <= INLINE_BYTES) or nbytes == 0, (name, item["pickled"][name], nbytes)


# ---- planned global batches: micro-batches laid out by the samples' sizes (data.pack_buffer) -----------------------


def measure_id(sample: dict) -> tuple[int, int]:
    """A sample's (tokens, patches), a function of its id (module-level: the workers run it)."""
    i = int(sample["cls"])
    return 1 + (i * 37) % 60, (i * 13) % 9 * 4


@pytest.mark.parametrize("window", [1, 3])
def test_planned_steps_resume_exactly_mid_window_and_keep_the_global_batch(shards, window):
    """Steps of exactly one global batch, each sample once per epoch; one-step windows keep each step's samples
    (only their micro-batches change); a resume after any step -- mid-window, across the epoch's end -- continues
    the same steps, in any layout with that global batch."""
    urls, _ = shards
    plan = PackPlan(measure_id, window, max_seq_len=64)
    per_epoch = sum(SIZES) // 8 // window * window + (sum(SIZES) - sum(SIZES) // 8 // window * window * 8) // 8
    kw = dict(collate=collate_ids, plan=plan)
    reference = steps(global_loader(urls, rank=0, dp=1, micro=4, accum=2, **kw), per_epoch + 3, accum=2)
    ids = [sorted(i for ids, _ in step for i in ids) for step in reference]
    assert all(len(step) == GLOBAL for step in ids)
    assert len({i for step in ids[:per_epoch] for i in step}) == per_epoch * GLOBAL  # none twice in an epoch
    unplanned = steps(global_loader(urls, rank=0, dp=1, micro=4, accum=2, collate=collate_ids), per_epoch, accum=2)
    same = [sorted(i for ids, _ in step for i in ids) for step in unplanned] == ids[:per_epoch]
    assert same == (window == 1)  # a window of one step keeps the step; three also choose who shares a step
    rank1 = steps(global_loader(urls, rank=1, dp=2, micro=2, accum=2, **kw), per_epoch + 3, accum=2)
    for done in (1, 2, per_epoch - 1, per_epoch + 1):
        first = global_loader(urls, rank=1, dp=2, micro=2, accum=2, **kw)
        steps(first, done, accum=2)
        state = json.loads(json.dumps(first.state_dict()))
        again = global_loader(urls, rank=1, dp=2, micro=2, accum=2, **kw)
        again.load_state_dict(state)
        assert steps(again, per_epoch + 3 - done, accum=2) == rank1[done:], f"resume after {done}"
        resumed = global_loader(urls, rank=0, dp=1, micro=4, accum=2, **kw)  # another layout, the same steps
        resumed.load_state_dict(state)
        got = steps(resumed, per_epoch + 3 - done, accum=2)
        assert [sorted(i for ids, _ in step for i in ids) for step in got] == ids[done:], f"resume after {done}"
    other = global_loader(urls, rank=0, dp=1, micro=4, accum=2, collate=collate_ids, plan=PackPlan(measure_id, 2, 64))
    with pytest.raises(DataError, match=f"pack_buffer was {window} when saved, now 2 .*data.pack_buffer={window}"):
        other.load_state_dict(state)
