"""One global sample stream cut into this rank's micro-batches (:class:`GlobalBatches`), and its builder."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as tdist
from torch.utils.data import default_collate

from common.data.webdataset.loader import ResumableLoader, train_loader
from common.data.webdataset.shares import PackPlan, RankShare
from common.errors import ConfigError, DataError


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
