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

Modules: ``shards`` (reading a shard, :func:`iter_samples`), ``shares`` (:class:`RankShare`, :class:`PackPlan`),
``stream`` (a worker's epochs: per-rank, global, grouped, planned), ``loader`` (:class:`ResumableLoader` and its
builders), ``global_stream`` (:class:`GlobalBatches`), ``workers`` (a loader worker's setup).
"""

from common.data.webdataset.global_stream import GlobalBatches, global_train_loader
from common.data.webdataset.loader import ResumableLoader, build_webdataset_loader, train_loader
from common.data.webdataset.shards import iter_samples
from common.data.webdataset.shares import PackPlan, RankShare
from common.data.webdataset.workers import INLINE_BYTES, _init_worker

__all__ = [
    "INLINE_BYTES",
    "GlobalBatches",
    "PackPlan",
    "RankShare",
    "ResumableLoader",
    "_init_worker",
    "build_webdataset_loader",
    "global_train_loader",
    "iter_samples",
    "train_loader",
]
