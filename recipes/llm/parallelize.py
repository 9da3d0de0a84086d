"""Apply parallelism to the Llama in the fixed order TP/SP → EP → LoRA → fp8 → AC → compile → FSDP2 (torchtitan style).

Megatron-style tensor parallelism with DTensor: attention q/k/v and MLP w1/w3 split by
columns, wo and w2 by rows; the norms run sequence-parallel (activations sharded along the
sequence between the TP regions). FSDP2 then shards every block (and the root) over `dp`.

Expert parallelism (``parallel.ep``, torchtitan's layout): ep of the dp ranks split each MoE layer's
experts (``GroupedExperts.w1/w2/w3`` become DTensors ``Shard(0)`` on the "ep" mesh dim, ``num_experts/ep``
experts per rank) while everything else stays data parallel: every dp rank reads its own documents and
routes its own tokens. Between ``permute_tokens`` and the grouped GEMM an all-to-all sends each expert's
rows to the rank holding it and a second one brings the outputs back (:class:`ExpertParallel`, hooks on
the experts module: the model's ``MoE.forward`` is unchanged). FSDP2 shards the experts over the remaining
"edp" = dp / ep ranks, the rest of the model over all dp ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as tdist
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from common.config import TrainConfig
from common.lora import apply_lora
from common.parallel_dims import expert_mesh
from common.toggles import apply_toggles
from recipes.llm.model import MoE, Transformer, TransformerBlock


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # Loss parallel keeps the logits sharded over the vocabulary (no all-gather of [B,S,V]).
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    # Pipeline stages lack some ends; between stages the hidden state is the local sequence shard.
    parallelize_module(model, tp_mesh, {k: v for k, v in plan.items() if getattr(model, k) is not None})
    if model.args.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        # Each style distributed its own copy of the shared weight; both are Shard(0) over the
        # vocabulary (embedding rows, output features), so one DTensor serves both: tie them again.
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            # (x, cos, sin, attn_mask): gather the sequence shards of x; rope and mask are plain tensors.
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


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


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, precision: str, pipeline: bool = False,
               edp_mesh: DeviceMesh | None = None) -> None:
    """``edp_mesh`` (expert parallelism): the experts, already split over ep, are sharded over these ranks."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype_for(precision), reduce_dtype=torch.float32)
    for block in model.layers.values():
        if edp_mesh is not None:
            for moe in (m for m in block.modules() if isinstance(m, MoE)):
                fully_shard(moe.experts, mesh=edp_mesh, mp_policy=mp)
                # An expert's gradient already sums the tokens of all its ep ranks (the all-to-all's backward):
                # reduced over edp it covers every dp rank's tokens, so divide by dp like every other gradient.
                moe.experts.set_gradient_divide_factor(dp_mesh.size())
                # A plain sum, then a division: gloo has no pre-multiplied sum. Not on one rank, where FSDP
                # (torch 2.13) skips the collective and divides itself, and would then divide again.
                moe.experts.set_force_sum_reduction_for_comms(edp_mesh.size() > 1)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp)
    if not pipeline:
        fully_shard(model, mesh=dp_mesh, mp_policy=mp)
        return
    # Under PP the stages run views of this module (recipes/llm/pipeline.py), never its own
    # forward, so a root FSDP unit would never unshard: shard the ends as units of their own.
    for name in ("tok_embeddings", "norm", "output"):
        if getattr(model, name) is not None:
            fully_shard(getattr(model, name), mesh=dp_mesh, mp_policy=mp)


def param_dtype_for(precision: str) -> torch.dtype:
    return torch.float32 if precision == "fp32" else torch.bfloat16


def parallelize(model: Transformer, mesh: DeviceMesh, cfg: TrainConfig) -> Transformer:
    dp, tp, ep = mesh["dp"].size(), mesh["tp"].size(), cfg.parallel.ep
    if tp > 1:
        apply_tp(model, mesh["tp"], cfg.model.loss_parallel)
    edp_mesh = None
    if ep > 1:
        experts = expert_mesh(mesh, ep)
        apply_ep(model, experts["ep"])
        edp_mesh = experts["edp"]
    if cfg.finetune == "lora":  # adapters on the frozen base, sharded by FSDP2 with it (common/lora.py)
        apply_lora(model, cfg.lora)
    apply_toggles(model, cfg.toggles, block_types=(TransformerBlock,))  # fp8 (tp = 1 only), AC, compile
    if dp > 1:
        apply_fsdp(model, mesh["dp"], cfg.toggles.precision, pipeline=mesh["pp"].size() > 1, edp_mesh=edp_mesh)
    return model

