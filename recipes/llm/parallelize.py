"""Apply parallelism to the Llama in the fixed order TP/SP → EP → LoRA → fp8 → AC → compile → FSDP2 (torchtitan style).

Megatron-style tensor parallelism with DTensor: attention q/k/v and MLP w1/w3 split by
columns, wo and w2 by rows; the norms run sequence-parallel (activations sharded along the
sequence between the TP regions). FSDP2 then shards every block (and the root) over `dp`.

Context parallelism (``parallel.cp``) changes no module (the attention gathers keys/values when the trainer hands
it a ``ContextParallelMask``: recipes/llm/context_parallel.py); FSDP2 then shards over dp x cp flattened
(torchtitan's dp_shard_cp), since the cp ranks hold the same weights and their gradients sum their tokens'.

Expert parallelism (``parallel.ep``): each MoE layer's experts split over ep of the dp (x cp) ranks, with the token
exchange around them (recipes/llm/expert_parallel.py). FSDP2 shards the experts over the remaining
"edp" = dp * cp / ep ranks, the rest of the model over all dp * cp ranks.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from common.config import TrainConfig
from common.lora import apply_lora
from common.parallel_dims import batch_mesh, expert_mesh
from common.toggles import apply_toggles
from recipes.llm.expert_parallel import apply_ep
from recipes.llm.model import MoE, Transformer, TransformerBlock


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # Loss parallel keeps the logits sharded over the vocabulary (no all-gather of [B,S,V]).
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    # Pipeline stages lack some ends; between stages the hidden state is the local sequence shard.
    parallelize_module(model, tp_mesh, {k: v for k, v in plan.items() if getattr(model, k) is not None})
    if model.args.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        # Each style distributed its own copy of the shared weight; both are Shard(0) over the
        # vocabulary (embedding rows, output features), so one DTensor serves both: tie them again.
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                # (x, cos, sin, attn_mask): gather the sequence shards of x; rope and mask are plain tensors.
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )


def apply_fsdp(
    model: Transformer, dp_mesh: DeviceMesh, precision: str, pipeline: bool = False, edp_mesh: DeviceMesh | None = None
) -> None:
    """``edp_mesh`` (expert parallelism): the experts, already split over ep, are sharded over these ranks."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype_for(precision), reduce_dtype=torch.float32)
    for block in model.layers.values():
        if edp_mesh is not None:
            for moe in (m for m in block.modules() if isinstance(m, MoE)):
                fully_shard(moe.experts, mesh=edp_mesh, mp_policy=mp)
                # An expert's gradient already sums the tokens of all its ep ranks (the all-to-all's backward):
                # reduced over edp it covers every dp (x cp) rank's tokens, so divide by dp (x cp) like every other
                # gradient.
                moe.experts.set_gradient_divide_factor(dp_mesh.size())
                # A plain sum, then a division: gloo has no pre-multiplied sum. Not on one rank, where FSDP
                # (torch 2.13) skips the collective and divides itself, and would then divide again.
                moe.experts.set_force_sum_reduction_for_comms(edp_mesh.size() > 1)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp)
    if not pipeline:
        fully_shard(model, mesh=dp_mesh, mp_policy=mp)
        return
    # Under PP the stages run views of this module (recipes/llm/pipeline_parallel.py), never its own
    # forward, so a root FSDP unit would never unshard: shard the ends as units of their own.
    for name in ("tok_embeddings", "norm", "output"):
        if getattr(model, name) is not None:
            fully_shard(getattr(model, name), mesh=dp_mesh, mp_policy=mp)


def param_dtype_for(precision: str) -> torch.dtype:
    return torch.float32 if precision == "fp32" else torch.bfloat16


def parallelize(model: Transformer, mesh: DeviceMesh, cfg: TrainConfig) -> Transformer:
    dp, tp, ep = batch_mesh(mesh).size(), mesh["tp"].size(), cfg.parallel.ep  # dp: x cp
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
        apply_fsdp(model, batch_mesh(mesh), cfg.toggles.precision, pipeline=mesh["pp"].size() > 1, edp_mesh=edp_mesh)
    return model
