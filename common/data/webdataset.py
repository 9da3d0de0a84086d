"""WebDataset shards in: a resumable per-rank loader (seeded shuffles, exact mid-epoch resume) and an in-order reader.

The loader (:func:`build_webdataset_loader`) is for training; :func:`iter_samples` reads every
sample of a list of shards in order, for what each rank reads whole (evaluation).

Layout. Rank ``r`` of ``W`` reads ``urls[r::W]``; DataLoader worker ``w`` of ``N`` inside that
rank reads ``urls[r::W][w::N]`` (explicit slicing rather than webdataset's split_by_node /
split_by_worker, so the assignment does not depend on torch.distributed being initialised
and is visible in one line). Each (epoch, rank, worker) gets its own ``random.Random``
seeded from (seed, epoch, rank, worker): it orders the worker's shards and drives
webdataset's shuffle buffer. Nothing reads the process-global RNGs.

Position. Workers batch (full batches only) and attach a small header to every batch:
worker id, how many raw samples it has drawn from its shuffled stream so far, and which of
its shards turned out corrupt. The main process does not trust the DataLoader's worker
interleaving; it merges the workers' batches itself in a fixed round-robin order (worker
0, 1, ..., skipping workers that have finished the epoch). The resumable position is
therefore: epoch, the worker whose turn is next, and per worker the header of the last
batch the caller received. ``load_state_dict`` hands those to fresh workers, which replay
the same shuffled raw stream, drop the first ``drawn`` samples without decoding them
(cheap) and continue -- the round-robin resumes at the saved turn, so the batch sequence
continues exactly where it stopped.

One global stream, decoded in shares (:func:`global_train_loader`, :class:`GlobalBatches`). The
DeepSpeed recipes train on one sample stream whatever the layout: the loader above with rank 0 of 1,
whose batch is one optimizer step's global batch of ``micro x accum x dp`` samples. Every rank reads
that stream alike -- tar headers and payload bytes, the shuffle -- but decodes only its own share: of
each global batch's usable samples (in stream order, ``j`` = 0 .. G-1) rank ``r`` owns those with
``j % dp == r``, and micro-batch ``i`` of the step is ``j`` in ``[i*micro*dp, (i+1)*micro*dp)``. The
grouping into global batches is by raw stream position, made before anything is decoded, so it is the
same on every rank and for every layout with that global batch. Decoding, augmentation and the recipe's
collate (the VLM packs its rows there) run in the DataLoader workers, prefetched; another rank's
sample costs reading its tar record (a shard is streamed in order), never a decode. Each micro-batch
carries ``sample_ids``, its samples' ordinals in the global stream (common/seed.py: ``sample_rngs``).

Corrupt data in the global stream. Only what every rank sees alike may change which samples a step
holds. An unreadable tar (truncated, not a tar, a bad gzip) is found while reading, which every rank
does for every shard: the rest of that shard is skipped at the same stream position on every rank,
as in the per-rank loader. A sample that fails to decode is known only to the rank that owns it: it
is dropped from that rank's micro-batch alone -- a counted skip (``corrupt_shards``, logged once per
shard) that shifts nothing, so every rank's step boundaries stay where the stream put them and the
step holds one sample fewer (the loss is normalised by the global count, common/trainer.py). The
shard's other samples are still used: the ranks that own them cannot know of the failure, and
skipping only this rank's would lose more data for nothing. A micro-batch whose samples all failed
is kept if the recipe's collate takes an empty list (the VLM's: a blank, unlabelled image) and is a
DataError otherwise (the DiT's). ``max_corrupt_shards`` bounds the distinct corrupt shards each rank
has met; a checkpoint records those of every rank (a union, gathered when it is saved).

Grouped global batches (``group``: e.g. the text-to-image recipe's aspect-ratio buckets). With a ``group``
function of the raw sample (cheap: it reads a small field, decodes nothing) each global batch is made of one
group's samples: the stream's samples queue per group, in stream order, and a group whose queue reaches a
global batch is emitted as the next global batch (positions ``j`` in queue order, then cut into ranks' shares
and micro-batches as above). So every micro-batch of every rank holds one group, and the global batches are a
function of the stream and the global batch size alone, the same for any layout. What waits in the queues is
a function of the position too: a resumed worker replays its stream from the epoch's start, refilling the
queues without decoding anything, up to the saved ``drawn`` -- the state stays the same small position. A
shard found unreadable is re-found at the same stream position during the replay. At an epoch's end the
samples still queued (fewer than a global batch per group) are dropped, as the final partial batch is.

Planned global batches (``plan``, a :class:`PackPlan`: the VLM's ``data.pack_buffer``). Which rank and micro-batch
takes which sample of a step can follow the samples' sizes instead of their positions: every rank measures every
sample of a window of ``plan.steps`` global batches (``plan.measure`` of the raw sample: its language-model tokens
and vision-tower patches, cheap -- no pixel is decoded) and `common.data.packing.plan_window` lays the window out
as steps of exactly one global batch, each cut into ``accum x dp`` micro-batches whose rows and tower sequences
are well filled; each rank then decodes its own micro-batches only. The plan is a function of the window's raw
samples, the same on every rank. ``j`` is then a sample's place in its step's stream order. A window of one step
keeps each step's samples (a step's gradient is the same sum); a longer one also chooses which samples share a
step. The position stays small: a step handed out from the middle of a window records the raw position where
the window started (``drawn``) and how many of its steps were handed out (``planned``); a resumed worker skips to
that position without decoding, measures the window again, plans it again and skips those steps. At an epoch's
end the window holds fewer samples: it is planned as the whole global batches it holds (the rest is dropped, as
the final partial batch is).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import random
import signal
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as tdist
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info
from webdataset.tariterators import group_by_keys, tar_file_expander

from common.errors import ConfigError, DataError

log = logging.getLogger(__name__)

_STATE_VERSION = 1


def _rng(seed: int, epoch: int, rank: int, worker: int) -> random.Random:
    # A str seed is hashed with SHA-512 by `random` (independent of PYTHONHASHSEED), so
    # nearby integer tuples still give unrelated streams.
    return random.Random(f"kiln.webdataset/{seed}/{epoch}/{rank}/{worker}")


def _is_local(url: str) -> bool:
    return "://" not in url and not url.startswith("pipe:")


def _brief(exc: BaseException) -> str:
    # webdataset appends the stream and url to exception args; the url is logged separately.
    message = str(exc.args[0]) if exc.args else str(exc)
    return f"{type(exc).__name__}: {message.split(' @ ')[0]}"


def _read_shard(url: str) -> Iterator[dict]:
    """Raw samples of one shard, using webdataset's own tar parsing and key grouping."""
    stream = wds.gopen(url)
    with contextlib.closing(stream):
        # reraise handler: the caller decides what a broken shard means (skip + count).
        yield from group_by_keys(tar_file_expander([{"url": url, "stream": stream}]))


def iter_samples(urls: Iterable[str]) -> Iterator[dict]:
    """Every raw sample of ``urls``, shard after shard in file order, read in this process.

    For reads that every rank makes in full, e.g. evaluation on the held-out split (generation
    under ZeRO-3 is collective: all ranks must run the same batches). ``wds.WebDataset`` does not
    fit there: once torch.distributed is initialised with more than one rank it refuses to run
    without a nodesplitter, i.e. it insists on giving each rank a part of the shards.
    """
    for url in urls:
        yield from _read_shard(str(url))


@dataclasses.dataclass(frozen=True)
class RankShare:
    """Which samples of each global batch (``micro x accum x dp`` usable samples, in stream order) a
    data-parallel rank decodes: position ``j`` is rank ``j % dp``'s, in micro-batch ``j // (micro x dp)``."""

    rank: int
    dp: int
    micro: int
    accum: int

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.dp

    def owns(self, position: int) -> bool:
        return position % self.dp == self.rank

    def micro_batch(self, position: int) -> int:
        return position // (self.micro * self.dp)


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Global batches laid out by the samples' sizes (the module docstring; `common.data.packing.plan_window`)."""

    measure: Callable[[dict], tuple[int, int]]  # raw sample -> (language-model tokens, tower patches); picklable
    steps: int  # global batches planned together (data.pack_buffer)
    max_seq_len: int  # the language rows' length
    packing: bool = True  # the collate packs rows (data.packing) rather than padding one sample per row


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
        info = get_worker_info()
        worker = 0 if info is None else info.id
        shards = self.urls[self.rank :: self.world_size][worker :: self.num_slots]
        rng = _rng(self.seed, epoch, self.rank, worker)
        if self.shuffle_shards:
            rng.shuffle(shards)
        start = resume[worker] if resume else {"drawn": 0, "batches": 0, "bad": {}}
        planned_done = start.get("planned", 0)  # steps of the resumed window already handed out
        # url -> reason. Seeded from the saved position: those shards were found corrupt
        # (perhaps by decoding a sample we now skip without decoding) before the stop point.
        # Grouped: re-found while the replay reads to the saved position (the module docstring).
        bad: dict[str, str] = {} if self.group is not None else dict(start["bad"])

        def raw_samples() -> Iterator[dict]:
            # Reads every shard to its end (or first tar error) whatever `bad` holds, so the raw
            # stream -- and hence the shuffle -- is a function of the data and the seed only.
            for url in shards:
                try:
                    yield from _read_shard(url)
                except Exception as exc:  # tarfile.ReadError, truncated member, gzip error, ...
                    mark_bad(url, f"unreadable tar: {_brief(exc)}")

        def mark_bad(url: str, reason: str) -> None:
            if url not in bad:
                bad[url] = reason
                level = logging.DEBUG if url in self.known_bad else logging.WARNING
                log.log(
                    level, "skipping rest of corrupt shard %s (rank %d, worker %d): %s", url, self.rank, worker, reason
                )

        failed: dict[str, str] = {}  # with a share: url -> first reason, this rank's decode failures

        def decode(sample: dict) -> Any | None:
            """The decoded sample, or None for a failure: counted, logged once per shard, and (without a
            share) the rest of its shard skipped."""
            try:
                return self.decode(sample)
            except Exception as exc:
                url, reason = sample.get("__url__"), f"sample {sample.get('__key__')!r} failed to decode: {_brief(exc)}"
                if self.share is None:
                    mark_bad(url, reason)
                elif url not in failed:
                    failed[url] = reason
                    level = logging.DEBUG if url in self.known_bad else logging.WARNING
                    log.log(
                        level,
                        "skipping samples of shard %s that fail to decode (rank %d of %d): %s",
                        url,
                        self.share.rank,
                        self.share.dp,
                        reason,
                    )
                return None

        stream: Iterator[dict] = raw_samples()
        if self.shuffle_buffer > 0:
            stream = wds.shuffle(bufsize=self.shuffle_buffer, initial=self.shuffle_buffer, rng=rng)(stream)

        drawn, batches, batch, usable = 0, start["batches"], [], 0
        queues: dict[Any, list[tuple[int, dict | None]]] = {}  # grouped: group -> its queued (position, sample)
        window: list[dict] = []  # planned: the raw samples of the window being filled
        window_start = start["drawn"]  # planned: the raw position the window starts after
        # planned: the corrupt shards known when the window started -- the position of a step handed out mid-window
        # (a resume replays the window from its start: a shard found corrupt inside it is found again there)
        window_bad = dict(bad)

        def planned() -> Iterator[dict]:
            """The window's steps as batch items, each this rank's share; those handed out before a resume skipped."""
            nonlocal batches, planned_done
            steps = len(window) // self.batch_size
            layout = self._plan_window(window[: steps * self.batch_size], steps)
            for k, slots in enumerate(layout):
                if k < planned_done:
                    continue  # handed out before the resume; not decoded
                batches += 1
                last = k == steps - 1
                yield {
                    "worker": worker,
                    "epoch": epoch,
                    "drawn": drawn if last else window_start,
                    "planned": 0 if last else k + 1,
                    "batches": batches,
                    "bad": dict(bad if last else window_bad),
                    "failed": dict(failed),
                    "batch": self._rank_share(slots, decode),
                }
            planned_done = 0

        for sample in stream:
            drawn += 1
            if self.group is not None:
                if sample.get("__url__") in bad:
                    continue
                key = self.group(sample)
                queue = queues.setdefault(key, [])
                j = len(queue)  # another rank's sample is counted, not kept
                queue.append((j, sample if self.share.owns(j) else None))
                if len(queue) < self.batch_size:
                    continue
                del queues[key]
                if drawn <= start["drawn"]:
                    continue  # replayed: handed out before the resume; not decoded
                out = self._rank_share(self._slots([(j, s) for j, s in queue if s is not None]), decode)
            elif drawn <= start["drawn"]:
                continue  # fast-forward: already consumed by the caller before the resume; not decoded
            elif sample.get("__url__") in bad:
                continue  # "skip the rest of a corrupt shard", also for samples still in the shuffle buffer
            elif self.plan is not None:
                window.append(sample)
                if len(window) == self.plan.steps * self.batch_size:
                    yield from planned()
                    window, window_start, window_bad = [], drawn, dict(bad)
                continue
            elif self.share is not None:
                # Grouped by stream position, undecoded: another rank's sample is counted and dropped.
                if self.share.owns(usable):
                    batch.append((usable, sample))
                usable += 1
                if usable < self.batch_size:
                    continue
                out, batch, usable = self._rank_share(self._slots(batch), decode), [], 0
            else:
                decoded = decode(sample)
                if decoded is None:
                    continue
                batch.append(decoded)
                if len(batch) < self.batch_size:
                    continue
                out, batch = self.collate(batch), []
            batches += 1
            yield {
                "worker": worker,
                "epoch": epoch,
                "drawn": drawn,
                "batches": batches,
                "bad": dict(bad),
                "failed": dict(failed),
                "batch": out,
            }
        if window and len(window) >= self.batch_size:  # planned: the epoch's last window, shorter
            yield from planned()
        # A worker always reads the same shards, so what it found corrupt is known in its later epochs.
        self.known_bad = self.known_bad | frozenset(bad) | frozenset(failed)
        # The final partial batch is dropped: every batch has exactly batch_size samples.
        yield {"worker": worker, "epoch": epoch, "end": True, "bad": dict(bad), "failed": dict(failed)}

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


def _init_worker(worker_id: int, trainer: int | None = None) -> None:
    """SLURM signals every process of a job: workers leave SIGTERM/SIGUSR1 to the trainer, which
    checkpoints and exits (common/trainer.py); the workers go when their parent does."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if trainer is not None:
        _die_with_the_trainer(trainer)
    _send_small_tensors_inline()


def _die_with_the_trainer(trainer: int) -> None:
    """A worker whose trainer was killed (SIGKILL, the OOM killer) must not outlive it: its queue's feeder thread
    can block for ever on a full pipe that the worker itself keeps open, and the worker then holds the job's
    stdout. Linux sends it SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG); elsewhere DataLoader's own
    watchdog remains."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != trainer:  # the trainer died before the call
        os._exit(0)


# A loader worker hands each tensor to the trainer through shared memory by default: a segment and a file
# descriptor passed over a socket per tensor, about 0.5 ms each on 2 cores. A packed VLM micro-batch is five
# small tensors (ids, labels, positions, boundaries, images), and those handovers were most of its data wait.
# A worker's tensors up to INLINE_BYTES travel inside the pickled message instead: one copy through the pipe.
INLINE_BYTES = 1 << 20


def _send_small_tensors_inline() -> None:
    """In a loader worker: pickle small CPU tensors by value (the queue's ForkingPickler, this process only)."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing.reductions import reduce_tensor

    def reduce(t: torch.Tensor):
        if t.device.type == "cpu" and not t.requires_grad and t.numel() * t.element_size() <= INLINE_BYTES:
            return _tensor_from_bytes, (
                t.detach().contiguous().view(-1).view(torch.uint8).numpy(),
                t.dtype,
                tuple(t.shape),
            )
        return reduce_tensor(t)

    ForkingPickler.register(torch.Tensor, reduce)


def _tensor_from_bytes(data, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(data).view(dtype).view(shape)


class GlobalBatches:
    """This data-parallel rank's micro-batches, cut from one global sample stream that every rank reads alike.

    The inner loader (rank 0 of 1, with this rank's :class:`RankShare`) walks one optimizer step's global batch,
    ``micro x accum x dp`` samples, at a time. Micro-batch ``i`` of the step is the global batch's ``i``-th run of
    ``micro x dp`` samples, and rank ``r`` takes its samples ``r, r+dp, ...`` (recipes/llm/data.py cuts its
    documents the same way). So the samples of a step, and their order in the stream, depend on the global batch
    only, not on how many ranks share it, and the saved position (the inner loader's, the same on every rank)
    resumes any layout with that global batch. Each micro-batch carries ``sample_ids``: its samples' ordinals in
    the global stream, from which a recipe derives per-sample random draws (common/seed.py: `sample_rngs`).

    Only this rank's samples are decoded and collated, in the inner loader's workers (the module docstring says
    what a sample that fails to decode does to a step).
    """

    def __init__(self, loader: ResumableLoader, *, rank: int, dp: int, micro: int, accum: int):
        self.loader, self.rank, self.dp, self.micro, self.accum = loader, rank, dp, micro, accum
        self.served = 0  # global batches handed out: the next one's first sample is served * global_batch

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.dp

    def __iter__(self) -> Iterator[Any]:
        for parts in self.loader:
            first = self.served * self.global_batch
            self.served += 1
            for i, part in enumerate(parts):
                if part["batch"] is None:
                    raise DataError(
                        f"every sample of rank {self.rank}'s micro-batch {i} of step {self.served} failed "
                        f"to decode (corrupt shards so far: {self.loader.corrupt_shards}); a micro-batch "
                        f"cannot be empty: fix or remove the shards, or raise trainer.micro_batch_size"
                    )
                # host ints: drawing per-sample numbers reads no tensor
                yield {**part["batch"], "sample_ids": [first + j for j in part["positions"]]}

    def state_dict(self) -> dict:
        """The position, the same on every rank. Collective when torch.distributed is up (the trainer saves on
        every rank): the corrupt shards recorded are those any rank has met, as ranks decode different samples."""
        loader = self.loader.state_dict()
        if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
            found: list[dict] = [{} for _ in range(tdist.get_world_size())]
            tdist.all_gather_object(found, loader["corrupt_shards"])
            loader["corrupt_shards"] = {u: r for part in found for u, r in sorted(part.items())}
        return {"global_batches": self.served, "global_batch": self.global_batch, "loader": loader}

    def load_state_dict(self, state: dict) -> None:
        if state.get("global_batch") != self.global_batch:
            raise ConfigError(
                f"run.resume: the checkpoint's run took {state.get('global_batch')} samples per step; this run takes "
                f"{self.global_batch} (trainer.micro_batch_size={self.micro} x trainer.grad_accum={self.accum} x "
                f"{self.dp} ranks): set them so that their product is {state.get('global_batch')}"
            )
        self.loader.load_state_dict(state["loader"])
        self.served = int(state["global_batches"])

    @property
    def epoch(self) -> int:
        return self.loader.epoch

    @property
    def corrupt_shards(self) -> int:
        return self.loader.corrupt_shards

    def close(self) -> None:
        self.loader.close()


def global_train_loader(
    cfg,
    urls: list[str],
    *,
    decode: Callable[[dict], Any],
    rank: int,
    dp: int,
    collate: Callable[[list], Any] = default_collate,
    group: Callable[[dict], Any] | None = None,
    plan: PackPlan | None = None,
) -> GlobalBatches:
    """A recipe's training loader over one global stream (:class:`GlobalBatches`): ``decode`` and ``collate`` run in
    the loader's workers, on this rank's samples only (both picklable: module-level functions or partials); with
    ``group`` (of the raw sample, picklable) each global batch holds one group, with ``plan`` each window of global
    batches is laid out by the samples' sizes (the module docstring)."""
    t = cfg.trainer
    share = RankShare(rank=rank, dp=dp, micro=t.micro_batch_size, accum=t.grad_accum)
    inner = train_loader(
        cfg,
        urls,
        decode=decode,
        collate=collate,
        rank=0,
        world_size=1,
        batch_size=share.global_batch,
        share=share,
        group=group,
        plan=plan,
    )
    inner.resume_hints["pack_buffer"] = "the run laid its steps out with data.pack_buffer={saved}: set it so"
    inner.batch_hint = (
        f"the global batch: trainer.micro_batch_size={t.micro_batch_size} x trainer.grad_accum={t.grad_accum} x "
        f"{dp} data-parallel rank(s)"
    )
    return GlobalBatches(inner, rank=rank, dp=dp, micro=t.micro_batch_size, accum=t.grad_accum)
