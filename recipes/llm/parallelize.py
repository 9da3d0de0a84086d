"""Apply parallelism to the Llama in the fixed order TP/SP → AC → compile → FSDP2 (torchtitan style).

Megatron-style tensor parallelism with DTensor: attention q/k/v and MLP w1/w3 split by
columns, wo and w2 by rows; the norms run sequence-parallel (activations sharded along the
sequence between the TP regions). FSDP2 then shards every block (and the root) over `dp`.
"""

from __future__ import annotations

import functools

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
from recipes.llm.model import Transformer


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


def _save_matmuls(ctx, op, *args, **kwargs):
    """Selective AC policy: keep matmul and attention outputs, recompute the cheap ops
    (norms, activations, rope, adds) — most of the memory for little recompute."""
    from torch.utils.checkpoint import CheckpointPolicy

    keep = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: Transformer, mode: str) -> None:
    """Wrap each block: `full` recomputes the whole block in backward, `selective` only its cheap ops."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    for name, block in list(model.layers.items()):
        kwargs = {"preserve_rng_state": False}
        if mode == "selective":
            kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
        model.layers[name] = checkpoint_wrapper(block, **kwargs)


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, precision: str, pipeline: bool = False) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype_for(precision), reduce_dtype=torch.float32)
    for block in model.layers.values():
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
    dp, tp = mesh["dp"].size(), mesh["tp"].size()
    if tp > 1:
        apply_tp(model, mesh["tp"], cfg.model.loss_parallel)
    if cfg.toggles.activation_checkpointing != "none":
        apply_ac(model, cfg.toggles.activation_checkpointing)
    if cfg.toggles.compile:
        for block in model.layers.values():
            block.compile()
    if dp > 1:
        apply_fsdp(model, mesh["dp"], cfg.toggles.precision, pipeline=mesh["pp"].size() > 1)
    return model

