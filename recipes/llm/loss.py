"""The LLM's loss, written once: what the training step, the pipeline schedule's last stage and evaluation call."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from common.config import TrainConfig
from common.data.packing import IGNORE_INDEX
from common.parallel_dims import ParallelDims


def ce_sum(logits: torch.Tensor, labels: torch.Tensor, shifted: bool = False) -> torch.Tensor:
    """Next-token cross-entropy summed over the labelled positions (``labels`` unshifted, -100 where unlabelled;
    ``shifted``: already each position's next-token target, as a context-parallel shard's are)."""
    if not shifted:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


class NextTokenLoss:
    """Next-token cross-entropy summed over the labelled tokens (the step divides by its global count of them:
    common/trainer.py), with what every forward feeding it needs:

    - ``forward()``: the context the model's forward and this loss run in. bf16 autocast where toggles.precision
      asks for it and nothing else casts (under dp > 1 FSDP2's mixed-precision policy does:
      recipes/llm/parallelize.py); torch's ``loss_parallel`` where the logits stay sharded over the vocabulary
      (model.loss_parallel with tp > 1: the cross-entropy runs on the shards, no all-gather of ``[B, S, V]``).
    - ``backward()``: the context the loss's backward runs in (loss parallel's backward ops on the shards).
    - calling it: the token sum of a micro-batch's (or pipeline microbatch's) logits, a plain tensor (under loss
      parallel the sum is a replicated DTensor scalar).

    The training step (LLMTrainer.loss), the pipeline schedule's loss (recipes/llm/pipeline_parallel.py) and evaluation
    (LLMTrainer.evaluate) all call it, so the three compute the same number for the same logits."""

    def __init__(self, cfg: TrainConfig, dims: ParallelDims, device: torch.device):
        self.device = device
        self.autocast_bf16 = cfg.toggles.precision in ("bf16", "fp8") and dims.dp * dims.cp == 1
        self.loss_parallel = cfg.model.loss_parallel and dims.tp > 1
        # Under context parallelism the logits are a rank's chunks of each row: the targets come shifted (on the
        # whole row, before the split: recipes/llm/context_parallel.py).
        self.shifted = dims.cp > 1

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        cast = torch.autocast(self.device.type, torch.bfloat16) if self.autocast_bf16 else contextlib.nullcontext()
        with cast, self.backward():
            yield

    def backward(self) -> contextlib.AbstractContextManager:
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = ce_sum(logits, labels, self.shifted)
        return loss.full_tensor() if hasattr(loss, "full_tensor") else loss
