"""Expert parallelism for the LLM's MoE layers (torchtitan's layout): experts split over the "ep" mesh dim, tokens
exchanged by all-to-all.

ep of the dp ranks (of dp x cp under context parallelism) split each MoE layer's experts (``GroupedExperts.w1/w2/w3``
become DTensors ``Shard(0)`` on the "ep" mesh dim, ``num_experts/ep`` experts per rank) while everything else stays data
parallel: every dp rank reads its own documents (a cp rank its chunks of its dp rank's rows) and routes its own tokens.
Between ``permute_tokens`` and the grouped GEMM an all-to-all sends each expert's rows to the rank holding it and a
second one brings the outputs back (:class:`ExpertParallel`, hooks on the experts module: the model's ``MoE.forward`` is
unchanged). recipes/llm/parallelize.py applies it after tensor parallelism and shards the experts with FSDP2 over the
remaining "edp" = dp * cp / ep ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as tdist
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from recipes.llm.model import MoE, Transformer


class ExpertParallel:
    """One MoE layer's token exchange around its ``GroupedExperts`` (a forward pre-hook and a forward hook).

    ``dispatch``: the experts' input, rows sorted by global expert with ``tokens_per_expert`` ``[E]`` (what
    ``permute_tokens`` gives), becomes this rank's experts' rows from every ep rank, regrouped by local
    expert, with their counts ``[E / ep]`` (the grouped GEMM's offsets). ``combine`` undoes both steps.
    The rows travel by ``all_to_all_single`` with uneven splits; its autograd version sends the gradients
    back the same way. The split sizes must be host integers: the one device-to-host read per layer and
    forward (torchtitan's too). State lives between the two hooks of one forward (an activation
    checkpoint's recompute repeats both, with the same routing)."""

    def __init__(self, ep_mesh: DeviceMesh):
        self.ep, self.group, self.rank = ep_mesh.size(), ep_mesh.get_group(), ep_mesh.get_local_rank()
        self.splits: tuple[list[int], list[int]] | None = None  # rows sent to / received from each ep rank
        self.order: Tensor | None = None  # received rows in local-expert order: row j is received row order[j]
        # What the forwards' two all-to-alls moved, counted on the host from their split sizes (read by
        # LLMTrainer.step_metrics; each backward sends the same again): rows dispatched, bytes sent to other ranks.
        self.rows_dispatched = self.bytes_sent = 0

    @staticmethod
    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for key, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

    def dispatch(self, module: nn.Module, inputs: tuple[Tensor, Tensor], mesh: DeviceMesh) -> tuple[Tensor, Tensor]:
        x, tokens_per_expert = inputs
        with torch.no_grad():
            # received[r, l]: how many rows ep rank r sends to this rank's local expert l.
            received = torch.empty_like(tokens_per_expert)
            tdist.all_to_all_single(received, tokens_per_expert, group=self.group)
            received = received.view(self.ep, -1)
            sent, got = torch.stack([tokens_per_expert.view(self.ep, -1).sum(1), received.sum(1)]).tolist()
            self.order = expert_major_order(received, sum(got))
        self.splits = sent, got
        self.rows_dispatched += x.shape[0]
        self.bytes_sent += (x.shape[0] - sent[self.rank]) * x.shape[1] * x.element_size()
        x = all_to_all_single_autograd(x.contiguous(), got, sent, self.group)
        return x[self.order], received.sum(0)

    def combine(self, module: nn.Module, y: Tensor, mesh: DeviceMesh) -> Tensor:
        sent, got = self.splits
        y = torch.empty_like(y).index_copy_(0, self.order, y)  # back to (source rank, local expert) order
        self.bytes_sent += (y.shape[0] - got[self.rank]) * y.shape[1] * y.element_size()
        return all_to_all_single_autograd(y, sent, got, self.group)


def expert_major_order(counts: Tensor, total: int) -> Tensor:
    """Rows arrive as segments (source rank r, local expert l) of ``counts[r, l]`` rows, r-major: the row
    indices that list them l-major instead (each expert's rows contiguous, in source-rank order)."""
    ep, local = counts.shape
    starts = (counts.flatten().cumsum(0) - counts.flatten()).view(ep, local).t().flatten()  # where (r, l) begins
    lengths = counts.t().flatten()  # segments in (l, r) order
    segment = torch.repeat_interleave(torch.arange(ep * local, device=counts.device), lengths, output_size=total)
    offset = torch.arange(total, device=counts.device) - (lengths.cumsum(0) - lengths)[segment]
    return starts[segment] + offset


def apply_ep(model: Transformer, ep_mesh: DeviceMesh) -> None:
    """Each MoE layer's experts split over ``ep_mesh`` (Shard(0): this rank's ``num_experts / ep``), with the
    token exchange around them."""
    for module in model.modules():
        if isinstance(module, MoE):
            ep = ExpertParallel(ep_mesh)
            distribute_module(module.experts, ep_mesh, ep.partition, input_fn=ep.dispatch, output_fn=ep.combine)
            module.token_exchange = ep  # its counters, for the step's metrics
