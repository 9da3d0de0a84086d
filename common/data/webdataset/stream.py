"""The worker side of the loader: one rank's epochs as batch items with their positions, per-rank, in global
batches, grouped (buckets) or planned (the package docstring)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info

from common.data.webdataset.shards import _brief, _read_shard, _rng
from common.data.webdataset.shares import PackPlan, RankShare

# The package's one logger: its records keep the name they had when this package was one module.
log = logging.getLogger("common.data.webdataset")


class _EpochStream(IterableDataset):
    """The epochs of one rank, one pass per epoch. Runs inside each DataLoader worker (or in-process
    if num_workers=0).

    Workers persist across epochs, and DataLoader starts one pass of a worker's copy of this
    dataset per iter() of the loader: pass n is epoch ``epoch + n``, and only the first pass
    continues from ``resume``. When DataLoader asks for more after a pass's end marker (it
    prefetches), the worker starts the next epoch and keeps its first item for the next pass, so
    refilling the shuffle buffer overlaps the end of this epoch.

    Each pass yields ``{"worker", "epoch", "drawn", "batches", "bad", "failed", "batch"}`` per full
    batch, then one ``{"worker", "epoch", "end": True, "bad", "failed"}`` marker so the main process
    knows the worker is done and learns about corrupt shards found after its last batch. ``bad``: the
    shards whose rest is skipped (part of the position); ``failed``: with a ``share``, this rank's decode
    failures (they skip nothing, see the module docstring). With a ``share`` a batch is this rank's
    part of a global batch: ``accum`` micro-batches ``{"positions", "batch"}``, collated here.
    """

    def __init__(
        self,
        *,
        urls: list[str],
        decode: Callable[[dict], Any],
        collate: Callable,
        batch_size: int,
        rank: int,
        world_size: int,
        num_workers: int,
        seed: int,
        shuffle_buffer: int,
        shuffle_shards: bool,
        share: RankShare | None,
        epoch: int,
        resume: list[dict] | None,
        known_bad: frozenset[str] = frozenset(),
        group: Callable[[dict], Any] | None = None,
        plan: PackPlan | None = None,
    ):
        super().__init__()
        self.urls, self.decode, self.collate, self.share, self.group = urls, decode, collate, share, group
        self.plan = plan
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.num_slots = max(1, num_workers)
        self.seed, self.shuffle_buffer, self.shuffle_shards = seed, shuffle_buffer, shuffle_shards
        self.epoch, self.resume = epoch, resume
        self.known_bad = known_bad  # found in earlier epochs: only used to not repeat the warning
        self.passes = 0
        self.ahead: tuple[int, Iterator[dict], dict] | None = None  # (epoch, its stream, its first item)

    def __iter__(self) -> Iterator[dict]:
        epoch, resume = self.epoch + self.passes, self.resume if self.passes == 0 else None
        self.passes += 1
        return self._pass(epoch, resume)

    def _pass(self, epoch: int, resume: list[dict] | None) -> Iterator[dict]:
        if self.ahead is not None and self.ahead[0] == epoch:
            _, items, first = self.ahead
            yield first
        else:
            items = self._one_epoch(epoch, resume)
        self.ahead = None
        yield from items
        # Only reached when DataLoader prefetches past the end marker, i.e. while the main process
        # still works through this epoch's last batches.
        items = self._one_epoch(epoch + 1, None)
        self.ahead = (epoch + 1, items, next(items))

    def _one_epoch(self, epoch: int, resume: list[dict] | None) -> Iterator[dict]:
        run = _EpochRun(self, epoch, resume)
        if self.group is not None:
            items = run.grouped()
        elif self.plan is not None:
            items = run.planned()
        elif self.share is not None:
            items = run.shared()
        else:
            items = run.per_rank()
        yield from items
        # A worker always reads the same shards, so what it found corrupt is known in its later epochs.
        self.known_bad = self.known_bad | frozenset(run.bad) | frozenset(run.failed)
        # The final partial batch is dropped: every batch has exactly batch_size samples.
        yield {"worker": run.worker, "epoch": epoch, "end": True, "bad": dict(run.bad), "failed": dict(run.failed)}

    def _slots(self, owned: list[tuple[int, dict]]) -> list[list[tuple[int, dict]]]:
        """A step's slots (`_rank_share`) by stream position: ``j`` is rank ``j % dp``'s, in micro-batch
        ``j // (micro x dp)`` (the slots of other ranks' samples stay empty: they were never kept)."""
        slots: list[list[tuple[int, dict]]] = [[] for _ in range(self.share.accum * self.share.dp)]
        for position, sample in owned:
            slot = self.share.micro_batch(position) * self.share.dp + position % self.share.dp
            slots[slot].append((position, sample))
        return slots

    def _plan_window(self, window: list[dict], steps: int) -> list[list[list[tuple[int, dict]]]]:
        """The window's steps, each as its ``accum x dp`` slots (micro-batch i of rank r: slot ``i * dp + r``) of
        ``(position in the step, raw sample)``: `plan_window` on every sample's measured size."""
        from common.data.packing import plan_window

        slots = self.share.accum * self.share.dp
        if steps == 1 and slots == 1:  # nothing to choose: the step is one micro-batch (no sample measured)
            return [[list(enumerate(window))]]
        sizes = [self.plan.measure(sample) for sample in window]
        layout = plan_window(
            sizes,
            steps=steps,
            slots=slots,
            max_seq_len=self.plan.max_seq_len,
            packing=self.plan.packing,
        )
        out = []
        for slots in layout:
            order = sorted(i for slot in slots for i in slot)  # the step's samples in stream order: positions j
            place = {i: j for j, i in enumerate(order)}
            out.append([[(place[i], window[i]) for i in slot] for slot in slots])
        return out

    def _rank_share(self, slots: list[list[tuple[int, dict]]], decode: Callable[[dict], Any | None]) -> list[dict]:
        """This rank's micro-batches of one global batch, from the step's ``accum x dp`` slots of ``(position, raw
        sample)`` (micro-batch i of rank r: slot ``i * dp + r``): decoded and collated, each with the stream positions
        of the samples it holds (a failed one is left out)."""
        dp, rank = self.share.dp, self.share.rank
        parts = [{"positions": [], "samples": []} for _ in range(self.share.accum)]
        for i, part in enumerate(parts):
            for position, sample in slots[i * dp + rank]:
                decoded = decode(sample)
                if decoded is not None:
                    part["positions"].append(position)
                    part["samples"].append(decoded)
        out = []
        for part in parts:
            try:
                batch = self.collate(part["samples"])
            except Exception:
                if part["samples"]:
                    raise
                batch = None  # every sample failed and this collate takes no empty list: GlobalBatches says so
            out.append({"positions": part["positions"], "batch": batch})
        return out


class _EpochRun:
    """One worker's pass over its shards in one epoch (:meth:`_EpochStream._one_epoch`): its shuffled raw stream,
    its position (``drawn``, ``batches``), the corrupt shards it found (``bad``, ``failed``), and its batch items in
    each of the four ways (per rank, a share of the global stream, grouped, planned)."""

    def __init__(self, ds: _EpochStream, epoch: int, resume: list[dict] | None):
        info = get_worker_info()
        self.ds, self.epoch = ds, epoch
        self.worker = 0 if info is None else info.id
        self.shards = ds.urls[ds.rank :: ds.world_size][self.worker :: ds.num_slots]
        self.rng = _rng(ds.seed, epoch, ds.rank, self.worker)
        if ds.shuffle_shards:
            self.rng.shuffle(self.shards)
        self.start = resume[self.worker] if resume else {"drawn": 0, "batches": 0, "bad": {}}
        self.planned_done = self.start.get("planned", 0)  # steps of the resumed window already handed out
        # url -> reason. Seeded from the saved position: those shards were found corrupt
        # (perhaps by decoding a sample we now skip without decoding) before the stop point.
        # Grouped: re-found while the replay reads to the saved position (the module docstring).
        self.bad: dict[str, str] = {} if ds.group is not None else dict(self.start["bad"])
        self.failed: dict[str, str] = {}  # with a share: url -> first reason, this rank's decode failures
        self.drawn, self.batches = 0, self.start["batches"]

    # -- reading --------------------------------------------------------------------------------

    def raw_samples(self) -> Iterator[dict]:
        # Reads every shard to its end (or first tar error) whatever `bad` holds, so the raw
        # stream -- and hence the shuffle -- is a function of the data and the seed only.
        for url in self.shards:
            try:
                yield from _read_shard(url)
            except Exception as exc:  # tarfile.ReadError, truncated member, gzip error, ...
                self.mark_bad(url, f"unreadable tar: {_brief(exc)}")

    def stream(self) -> Iterator[dict]:
        """The worker's raw samples, shuffled (the buffer driven by the epoch's rng)."""
        stream: Iterator[dict] = self.raw_samples()
        if self.ds.shuffle_buffer > 0:
            stream = wds.shuffle(bufsize=self.ds.shuffle_buffer, initial=self.ds.shuffle_buffer, rng=self.rng)(stream)
        return stream

    def fresh(self) -> Iterator[dict]:
        """The stream's samples past the resumed position, those of shards found corrupt left out; counts ``drawn``."""
        for sample in self.stream():
            self.drawn += 1
            if self.drawn <= self.start["drawn"]:
                continue  # fast-forward: already consumed by the caller before the resume; not decoded
            if sample.get("__url__") in self.bad:
                continue  # "skip the rest of a corrupt shard", also for samples still in the shuffle buffer
            yield sample

    def mark_bad(self, url: str, reason: str) -> None:
        if url not in self.bad:
            self.bad[url] = reason
            level = logging.DEBUG if url in self.ds.known_bad else logging.WARNING
            log.log(
                level,
                "skipping rest of corrupt shard %s (rank %d, worker %d): %s",
                url,
                self.ds.rank,
                self.worker,
                reason,
            )

    def decode(self, sample: dict) -> Any | None:
        """The decoded sample, or None for a failure: counted, logged once per shard, and (without a
        share) the rest of its shard skipped."""
        try:
            return self.ds.decode(sample)
        except Exception as exc:
            url, reason = sample.get("__url__"), f"sample {sample.get('__key__')!r} failed to decode: {_brief(exc)}"
            share = self.ds.share
            if share is None:
                self.mark_bad(url, reason)
            elif url not in self.failed:
                self.failed[url] = reason
                level = logging.DEBUG if url in self.ds.known_bad else logging.WARNING
                log.log(
                    level,
                    "skipping samples of shard %s that fail to decode (rank %d of %d): %s",
                    url,
                    share.rank,
                    share.dp,
                    reason,
                )
            return None

    def item(self, out: Any) -> dict:
        """The batch item of ``out``, the next batch, at the current position."""
        self.batches += 1
        return {
            "worker": self.worker,
            "epoch": self.epoch,
            "drawn": self.drawn,
            "batches": self.batches,
            "bad": dict(self.bad),
            "failed": dict(self.failed),
            "batch": out,
        }

    # -- the four ways to batch -----------------------------------------------------------------

    def per_rank(self) -> Iterator[dict]:
        """This rank's own batches: decoded samples, collated ``batch_size`` at a time."""
        batch: list = []
        for sample in self.fresh():
            decoded = self.decode(sample)
            if decoded is None:
                continue
            batch.append(decoded)
            if len(batch) < self.ds.batch_size:
                continue
            out, batch = self.ds.collate(batch), []
            yield self.item(out)

    def shared(self) -> Iterator[dict]:
        """This rank's share of each global batch, grouped by stream position."""
        share, batch, usable = self.ds.share, [], 0
        for sample in self.fresh():
            # Grouped by stream position, undecoded: another rank's sample is counted and dropped.
            if share.owns(usable):
                batch.append((usable, sample))
            usable += 1
            if usable < self.ds.batch_size:
                continue
            out, batch, usable = self.ds._rank_share(self.ds._slots(batch), self.decode), [], 0
            yield self.item(out)

    def grouped(self) -> Iterator[dict]:
        """Global batches of one group each: the samples queue per group, a full queue is the next global batch."""
        ds = self.ds
        queues: dict[Any, list[tuple[int, dict | None]]] = {}  # group -> its queued (position, sample)
        for sample in self.stream():
            self.drawn += 1
            if sample.get("__url__") in self.bad:
                continue
            key = ds.group(sample)
            queue = queues.setdefault(key, [])
            j = len(queue)  # another rank's sample is counted, not kept
            queue.append((j, sample if ds.share.owns(j) else None))
            if len(queue) < ds.batch_size:
                continue
            del queues[key]
            if self.drawn <= self.start["drawn"]:
                continue  # replayed: handed out before the resume; not decoded
            out = ds._rank_share(ds._slots([(j, s) for j, s in queue if s is not None]), self.decode)
            yield self.item(out)

    def planned(self) -> Iterator[dict]:
        """Windows of ``plan.steps`` global batches, each laid out by its samples' sizes."""
        window: list[dict] = []  # the raw samples of the window being filled
        window_start = self.start["drawn"]  # the raw position the window starts after
        # the corrupt shards known when the window started -- the position of a step handed out mid-window
        # (a resume replays the window from its start: a shard found corrupt inside it is found again there)
        window_bad = dict(self.bad)
        for sample in self.fresh():
            window.append(sample)
            if len(window) == self.ds.plan.steps * self.ds.batch_size:
                yield from self.window_steps(window, window_start, window_bad)
                window, window_start, window_bad = [], self.drawn, dict(self.bad)
        if window and len(window) >= self.ds.batch_size:  # the epoch's last window, shorter
            yield from self.window_steps(window, window_start, window_bad)

    def window_steps(self, window: list[dict], window_start: int, window_bad: dict[str, str]) -> Iterator[dict]:
        """The window's steps as batch items, each this rank's share; those handed out before a resume skipped."""
        ds = self.ds
        steps = len(window) // ds.batch_size
        layout = ds._plan_window(window[: steps * ds.batch_size], steps)
        for k, slots in enumerate(layout):
            if k < self.planned_done:
                continue  # handed out before the resume; not decoded
            self.batches += 1
            last = k == steps - 1
            yield {
                "worker": self.worker,
                "epoch": self.epoch,
                "drawn": self.drawn if last else window_start,
                "planned": 0 if last else k + 1,
                "batches": self.batches,
                "bad": dict(self.bad if last else window_bad),
                "failed": dict(self.failed),
                "batch": ds._rank_share(slots, self.decode),  # decoded after the corrupt shards above are copied
            }
        self.planned_done = 0
