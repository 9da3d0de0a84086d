"""The resumable per-rank loader (:class:`ResumableLoader`): round-robin over its workers, an exact position;
and the functions that build it."""

from __future__ import annotations

import collections
import functools
import hashlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate

from common.data.webdataset.shards import _is_local, _rng
from common.data.webdataset.shares import PackPlan, RankShare
from common.data.webdataset.stream import _EpochStream
from common.data.webdataset.workers import _init_worker
from common.errors import DataError

_STATE_VERSION = 1


class ResumableLoader:
    """Endless iterator of per-rank batches over epochs 0, 1, 2, ... with an exact, JSON-able position.

    Build with :func:`build_webdataset_loader`. The DataLoader's workers persist across epochs:
    restarting them cost a fork and a refilled pipeline, a data-wait spike at every epoch boundary.
    Each epoch is one iter() of the DataLoader (a fresh pass over the worker's shards with that
    epoch's seeds); workers are only started anew after ``close()`` or ``load_state_dict``.
    """

    def __init__(
        self,
        *,
        urls: list[str],
        decode: Callable[[dict], Any],
        batch_size: int,
        rank: int,
        world_size: int,
        num_workers: int,
        seed: int,
        shuffle_buffer: int,
        shuffle_shards: bool,
        collate: Callable | None,
        max_corrupt_shards: int,
        pin_memory: bool,
        share: RankShare | None = None,
        group: Callable[[dict], Any] | None = None,
        plan: PackPlan | None = None,
    ):
        self._cfg = dict(
            urls=list(urls),
            decode=decode,
            collate=collate or default_collate,
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
            num_workers=num_workers,
            seed=seed,
            shuffle_buffer=shuffle_buffer,
            shuffle_shards=shuffle_shards,
            share=share,
            group=group,
            plan=plan,
        )
        # Whose data this is, for messages: with a share the stream is rank 0 of 1 on every data-parallel rank.
        self._rank = rank if share is None else share.rank
        self._num_workers = num_workers
        self._num_slots = max(1, num_workers)
        self._max_corrupt = max_corrupt_shards
        self._pin_memory = pin_memory
        self._corrupt: dict[str, str] = {}  # distinct shards skipped on this rank, all epochs
        self._loader: DataLoader | None = None  # built lazily, kept across epochs
        # Layout key -> what sets it in the config, said when a resume finds it changed ({saved}: the saved value).
        self.resume_hints: dict[str, str] = {}
        # What sets batch_size in the config (train_loader, global_train_loader), said when no batch can be made.
        self.batch_hint = ""
        self._reset_epoch(0, next_worker=0, positions=None)

    # -- position -------------------------------------------------------------------------------

    def _reset_epoch(self, epoch: int, *, next_worker: int, positions: list[dict] | None) -> None:
        self._epoch = epoch
        self._next_worker = next_worker
        self._positions = positions or [{"drawn": 0, "batches": 0, "bad": {}} for _ in range(self._num_slots)]
        self._finished = [False] * self._num_slots
        self._queues: list[collections.deque] = [collections.deque() for _ in range(self._num_slots)]
        self._epoch_iter: Iterator[dict] | None = None  # this epoch's pass, started lazily

    def _layout(self) -> dict:
        c = self._cfg
        # Shard basenames, not full paths: a run may resume on a machine that mounts the data elsewhere.
        names = hashlib.sha1("\n".join(os.path.basename(u) for u in c["urls"]).encode()).hexdigest()[:16]
        return {
            k: c[k]
            for k in ("rank", "world_size", "num_workers", "batch_size", "seed", "shuffle_buffer", "shuffle_shards")
        } | {
            "num_urls": len(c["urls"]),
            "url_names_sha1": names,
            "grouped": c["group"] is not None,
            "pack_buffer": c["plan"].steps if c["plan"] is not None else 0,
        }

    def state_dict(self) -> dict:
        """Position after the last batch handed out. Small and JSON-able; one per rank."""
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "next_worker": self._next_worker,
            "workers": [dict(p, bad=dict(p["bad"])) for p in self._positions],
            "corrupt_shards": dict(self._corrupt),
            "layout": self._layout(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where the run that saved ``state`` stopped (same urls, seed, ranks, workers)."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r} is not {_STATE_VERSION}")
        # An exact resume replays the same shuffles over the same shard split; refuse otherwise
        # rather than silently repeating or skipping data.
        mine = self._layout()
        for key, value in state["layout"].items():
            if mine.get(key) != value:
                hint = f" ({self.resume_hints[key].format(saved=value)})" if key in self.resume_hints else ""
                raise DataError(
                    f"cannot resume the data loader: {key} was {value} when saved, now {mine.get(key)}" + hint
                )
        workers = [dict(w, bad=dict(w["bad"])) for w in state["workers"]]
        self.close()
        self._corrupt = dict(state["corrupt_shards"])
        self._reset_epoch(int(state["epoch"]), next_worker=int(state["next_worker"]), positions=workers)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def corrupt_shards(self) -> int:
        """Distinct shards on this rank skipped so far (a shard bad in every epoch counts once)."""
        return len(self._corrupt)

    # -- iteration --------------------------------------------------------------------------------

    def _start_epoch(self) -> Iterator[dict]:
        if self._loader is None:  # (re)start workers at the current position, within its epoch
            resumed = any(p["drawn"] or p["batches"] or p["bad"] for p in self._positions)
            dataset = _EpochStream(
                **self._cfg,
                epoch=self._epoch,
                resume=self._positions if resumed else None,
                known_bad=frozenset(self._corrupt),
            )
            # A dedicated generator: DataLoader draws its worker base seed from it instead of the
            # global torch RNG, so building/iterating the loader leaves the caller's RNG untouched.
            gen = torch.Generator().manual_seed(
                _rng(self._cfg["seed"], self._epoch, self._cfg["rank"], -1).getrandbits(63)
            )
            self._loader = DataLoader(
                dataset,
                batch_size=None,
                num_workers=self._num_workers,
                generator=gen,
                pin_memory=self._pin_memory,
                persistent_workers=self._num_workers > 0,
                worker_init_fn=functools.partial(_init_worker, trainer=os.getpid()),
            )
        return iter(self._loader)  # with persistent workers: their next pass, i.e. the next epoch

    def _absorb_bad(self, bad: dict[str, str]) -> None:
        new = {u: r for u, r in bad.items() if u not in self._corrupt}
        if not new:
            return
        self._corrupt.update(new)
        if len(self._corrupt) > self._max_corrupt:
            listing = "; ".join(f"{u} ({r})" for u, r in self._corrupt.items())
            raise DataError(
                f"{len(self._corrupt)} corrupt shard(s) skipped on rank {self._rank}, "
                f"more than max_corrupt_shards={self._max_corrupt}: {listing}"
            )

    def _next_batch(self) -> Any | None:
        """Next batch of this epoch in round-robin worker order, or None when every worker is done."""
        while not all(self._finished):
            w = self._next_worker
            if self._finished[w]:
                self._next_worker = (w + 1) % self._num_slots
                continue
            while not self._queues[w]:
                # Pull until worker w's next item arrives; others' items wait in their queues
                # (at most about prefetch_factor * num_workers of them).
                if self._epoch_iter is None:
                    self._epoch_iter = self._start_epoch()
                item = next(self._epoch_iter)  # cannot run dry: w has not sent its end marker
                self._queues[item["worker"]].append(item)
            item = self._queues[w].popleft()
            if item["epoch"] != self._epoch:  # a pass per iter() is DataLoader's contract; never guess
                raise RuntimeError(f"data loader worker {w} sent epoch {item['epoch']} during epoch {self._epoch}")
            self._absorb_bad(item["bad"] | item["failed"])
            self._next_worker = (w + 1) % self._num_slots
            if item.get("end"):
                self._finished[w] = True
                continue
            self._positions[w] = {"drawn": item["drawn"], "batches": item["batches"], "bad": item["bad"]}
            if item.get("planned"):  # mid-window (planned batches): the steps of the window handed out
                self._positions[w]["planned"] = item["planned"]
            return item["batch"]
        return None

    def __iter__(self) -> Iterator[Any]:
        # State lives on self, so a second iter() continues where the first one stopped.
        while True:
            batch = self._next_batch()
            if batch is not None:
                yield batch
                continue
            if sum(p["batches"] for p in self._positions) == 0:
                fix = "lower the batch or the workers"  # a recipe's loader names the keys (batch_hint)
                if self.batch_hint:
                    fix = f"lower those or data.num_workers={self._num_workers}, or add training samples to data.root"
                raise DataError(
                    f"rank {self._rank} produced no full batch of {self._cfg['batch_size']} in epoch {self._epoch}"
                    + (f" ({self.batch_hint})" if self.batch_hint else "")
                    + f": each of its {self._num_slots} loader worker(s) reads its own shards, and each one's hold "
                    f"fewer samples than one batch; {fix}"
                )
            # Every worker sent its end marker: nothing of this epoch is in flight. The workers stay;
            # the next iter() of the DataLoader starts their pass over the next epoch.
            self._reset_epoch(self._epoch + 1, next_worker=0, positions=None)

    def close(self) -> None:
        """Stop the workers; the next batch request starts new ones at the position handed out so far."""
        loader, self._loader = self._loader, None
        workers = getattr(loader, "_iterator", None)  # where DataLoader keeps persistent workers
        if workers is None:
            workers = self._epoch_iter
        if workers is not None and hasattr(workers, "_shutdown_workers"):
            workers._shutdown_workers()  # deterministic teardown instead of waiting for garbage collection
        # Batches received but not handed out are dropped: the new workers produce them again.
        self._reset_epoch(self._epoch, next_worker=self._next_worker, positions=self._positions)


def build_webdataset_loader(
    urls: list[str],
    *,
    decode: Callable[[dict], Any],
    batch_size: int,
    rank: int,
    world_size: int,
    num_workers: int = 0,
    seed: int = 0,
    shuffle_buffer: int = 256,
    collate: Callable | None = None,
    max_corrupt_shards: int = 0,
    shuffle_shards: bool = True,
    pin_memory: bool = False,
    share: RankShare | None = None,
    group: Callable[[dict], Any] | None = None,
    plan: PackPlan | None = None,
) -> ResumableLoader:
    """Resumable loader over WebDataset tar shards for one rank; see the module docstring.

    ``decode`` maps a raw sample (``"__key__"``, ``"__url__"``, and one bytes value per file
    extension) to what ``collate`` batches; it must be picklable (module-level function or
    functools.partial) and deterministic -- resumed workers skip samples without decoding
    them, so any randomness in decode should come from the sample (e.g. its key), not a
    global RNG. Corrupt shards are skipped (logged, counted) until more than
    ``max_corrupt_shards`` distinct ones were seen on this rank, then DataError.

    With ``share`` (rank 0 of 1, ``batch_size`` its global batch) the loader yields that data-parallel
    rank's part of each global batch, decoded and collated in the workers: see the module docstring. With a
    ``share``, ``group`` (picklable, of the raw sample) makes each global batch one group's samples (idem), and
    ``plan`` lays each window of global batches out by the samples' sizes (idem).
    """
    urls = [str(u) for u in urls]
    if not urls:
        raise ValueError("no shard urls given (empty url list)")
    _check_args(
        batch_size=batch_size,
        rank=rank,
        world_size=world_size,
        num_workers=num_workers,
        shuffle_buffer=shuffle_buffer,
        max_corrupt_shards=max_corrupt_shards,
        share=share,
        group=group,
        plan=plan,
    )
    _check_shards(urls, world_size=world_size, num_workers=num_workers)
    return ResumableLoader(
        urls=urls,
        decode=decode,
        batch_size=batch_size,
        rank=rank,
        world_size=world_size,
        num_workers=num_workers,
        seed=seed,
        shuffle_buffer=shuffle_buffer,
        shuffle_shards=shuffle_shards,
        collate=collate,
        max_corrupt_shards=max_corrupt_shards,
        pin_memory=pin_memory,
        share=share,
        group=group,
        plan=plan,
    )


def _check_args(
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    num_workers: int,
    shuffle_buffer: int,
    max_corrupt_shards: int,
    share: RankShare | None,
    group: Callable[[dict], Any] | None,
    plan: PackPlan | None,
) -> None:
    """`build_webdataset_loader`'s numbers and layout, ValueError for the first one that does not fit."""
    for name, value, low in (
        ("batch_size", batch_size, 1),
        ("world_size", world_size, 1),
        ("num_workers", num_workers, 0),
        ("shuffle_buffer", shuffle_buffer, 0),
        ("max_corrupt_shards", max_corrupt_shards, 0),
    ):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
    if share is not None and (world_size != 1 or batch_size != share.global_batch or not 0 <= share.rank < share.dp):
        raise ValueError(
            f"a share of the global stream needs rank 0 of 1 and its global batch: got rank {rank} of "
            f"{world_size}, batch_size {batch_size}, {share}"
        )
    if group is not None and share is None:
        raise ValueError("grouped batches are made of the global stream: a group needs a share")
    if plan is not None and (share is None or group is not None or plan.steps < 1):
        raise ValueError("a plan lays out the global batches of an ungrouped stream: a share, no group, steps >= 1")


def _check_shards(urls: list[str], *, world_size: int, num_workers: int) -> None:
    """Every local shard exists, and every (rank, worker) reads at least one."""
    missing = [u for u in urls if _is_local(u) and not os.path.isfile(u)]
    if missing:
        raise FileNotFoundError(f"{len(missing)} shard file(s) missing, first: {missing[0]}")
    readers = world_size * max(1, num_workers)
    if len(urls) < readers:
        # Every (rank, worker) must own at least one shard, or it would yield nothing.
        raise DataError(
            f"{len(urls)} shards cannot feed {world_size} ranks x {max(1, num_workers)} workers; "
            f"write more shards or lower data.num_workers"
        )


def train_loader(
    cfg,
    urls: list[str],
    *,
    decode: Callable[[dict], Any],
    rank: int,
    world_size: int,
    batch_size: int | None = None,
    collate: Callable | None = None,
    share: RankShare | None = None,
    group: Callable[[dict], Any] | None = None,
    plan: PackPlan | None = None,
) -> ResumableLoader:
    """A recipe's training loader: `build_webdataset_loader` with what the config says of every recipe's
    (``data.num_workers``, ``data.shuffle_buffer``, ``data.max_corrupt_shards``, ``trainer.seed``;
    ``trainer.micro_batch_size`` unless the recipe batches otherwise)."""
    micro = cfg.trainer.micro_batch_size
    loader = build_webdataset_loader(
        urls,
        decode=decode,
        collate=collate,
        batch_size=micro if batch_size is None else batch_size,
        rank=rank,
        world_size=world_size,
        num_workers=cfg.data.num_workers,
        seed=cfg.trainer.seed,
        shuffle_buffer=cfg.data.shuffle_buffer,
        max_corrupt_shards=cfg.data.max_corrupt_shards,
        share=share,
        group=group,
        plan=plan,
    )
    ranks = 1 if batch_size is None else batch_size // micro  # a recipe's global micro-batch: micro x dp ranks
    loader.batch_hint = f"trainer.micro_batch_size={micro}" + (f" x {ranks} data-parallel ranks" if ranks > 1 else "")
    return loader
