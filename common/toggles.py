"""Optimization toggles, one meaning in every recipe: precision, TF32, compile, activation
checkpointing, attention backend.

`check_toggles` runs before anything is written, so a toggle this machine cannot honour (flash
without CUDA, fp8 on a GPU without fp8 units) ends the run with one line; a value a recipe cannot
honour is refused by the recipe's own `validate` at composition. `apply_toggles` is the one
function every recipe's `parallelize` calls to apply the model-level toggles, in torchtitan's
order (after tensor parallelism, before FSDP/ZeRO): fp8 linears -> activation checkpointing per
block -> torch.compile per block. Which modules are "blocks" is the only thing a recipe says.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from typing import TypeVar

import torch
import torch.nn.attention.varlen  # noqa: F401  (registers torch.ops.torch_attn._varlen_attn)
from torch import nn

from common.config import TogglesConfig
from common.errors import ConfigError


def _cuda_capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def check_toggles(t: TogglesConfig) -> None:
    cap = _cuda_capability()
    where = f"CUDA capability {cap[0]}.{cap[1]}" if cap else "no CUDA device"
    if t.precision == "fp16" and cap is None:
        raise ConfigError(
            "toggles.precision=fp16 needs a CUDA GPU (loss-scaled fp16 is GPU-only); use bf16 or fp32 on CPU"
        )
    if t.precision == "fp8":
        if cap is None or cap < (8, 9):
            raise ConfigError(
                f"toggles.precision=fp8 needs a GPU with fp8 tensor cores (capability >= 8.9); found {where}"
            )
        if importlib.util.find_spec("torchao") is None:
            raise ConfigError("toggles.precision=fp8 needs the torchao package (pip install torchao)")
    if t.attention == "flash" and (cap is None or cap < (8, 0)):
        # torch's own FlashAttention kernels (SDPA's flash backend, torch.nn.attention.varlen): Ampere or newer.
        raise ConfigError(
            f"toggles.attention=flash needs a CUDA GPU of capability >= 8.0 (torch's FlashAttention "
            f"kernels); found {where}: use sdpa"
        )


def apply_global_toggles(t: TogglesConfig) -> None:
    """Process-wide switches: TF32 matmuls and convolutions on Ampere and newer GPUs."""
    torch.backends.cuda.matmul.allow_tf32 = t.tf32
    torch.backends.cudnn.allow_tf32 = t.tf32
    torch.set_float32_matmul_precision("high" if t.tf32 else "highest")


def apply_fp8(model: torch.nn.Module) -> torch.nn.Module:
    """Swap nn.Linear layers for torchao's float8 training linears (dynamic scaling).

    Layers whose dimensions are not multiples of 16 stay in bf16: fp8 GEMMs need them. So does a
    language model's output projection (torchtitan's default too: its logits feed the loss).
    """
    from torchao.float8 import convert_to_float8_training

    def fits(module: torch.nn.Module, fqn: str) -> bool:
        return (
            isinstance(module, torch.nn.Linear)
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
            and fqn.rsplit(".", 1)[-1] not in ("output", "lm_head")
        )

    return convert_to_float8_training(model, module_filter_fn=fits)


_MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default})
_KEEP = _MATMULS | {
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.torch_attn._varlen_attn.default,
}  # packed rows on CUDA (toggles.attention=flash)


def _save_matmuls(ctx, op, *args, recompute_widening: bool = False, **kwargs):
    """Selective AC policy: keep the outputs of matmuls and of the attention kernel, recompute the
    cheap ops (norms, activations, rope, adds) -- most of the memory for little recompute. (Called
    for every op of a block, in forward and in its recompute: keep it cheap.)

    `recompute_widening` (a recipe's choice, see apply_toggles) also recomputes matmuls whose output
    is wider than their input, i.e. an MLP's up projection (h -> 4h): its output is the largest
    tensor a block keeps, for a third of the block's matmul FLOPs."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op not in _KEEP or (recompute_widening and op in _MATMULS and args[-1].shape[-1] > args[-2].shape[-1]):
        return CheckpointPolicy.PREFER_RECOMPUTE  # (..., mat1, mat2): mm, addmm and bmm alike
    return CheckpointPolicy.MUST_SAVE


T = TypeVar("T")
_WRAPPERS = re.compile(r"(_checkpoint_wrapped_module|_orig_mod)\.")  # AC's and compile's module prefixes


def unwrapped_name(name: str) -> str:
    """A parameter's name without activation checkpointing's and compile's wrapper prefixes: its name in the model
    as built, and in state dicts. Checkpoints, EMAs and exports key by it, so a run resumes and exports whatever
    toggles.activation_checkpointing / toggles.compile wrote it."""
    return _WRAPPERS.sub("", name)


def unwrapped_names(named: dict[str, T]) -> dict[str, T]:
    """`named` (tensors, shapes, ... by parameter name, as a checkpoint recorded them) keyed by `unwrapped_name`, in
    its order: the one rule for every name read back from a DeepSpeed checkpoint (its param_shapes,
    frozen_param_shapes and frozen fragments, shared_params, buffer_names, meta.json's trained_shapes, the EMA, a
    universal checkpoint's folders), whose names carry the writing run's wrapper prefixes, while its module state dict
    (checkpoint_wrapper's state-dict hooks) and the models the exports and resumes build do not."""
    out: dict[str, T] = {}
    for name, value in named.items():
        key = unwrapped_name(name)
        if key in out:  # two records of one parameter: refused, not one of them taken at random
            raise ValueError(f"{name} and another name both unwrap to {key}")
        out[key] = value
    return out


# Attention modules keep their dropout probability as a float (transformers: `attention_dropout`,
# torch's MultiheadAttention: `dropout`, diffusers' attention processors draw through nn.Dropout).
_DROPOUT_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout_p", "dropout")


def draws_random_numbers(module: nn.Module) -> bool:
    """Whether `module` can draw random numbers in training: a dropout layer with p > 0 in it, or a
    module with a dropout probability > 0 that its forward passes to an attention kernel."""
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if any(isinstance(getattr(m, name, None), float) and getattr(m, name) > 0 for name in _DROPOUT_ATTRIBUTES):
            return True
    return False


def apply_ac(
    model: nn.Module, mode: str, block_types: tuple[type[nn.Module], ...], *, recompute_widening: bool = False
) -> list[nn.Module]:
    """Wrap every block in place: `full` recomputes the whole block in backward, `selective` only its
    cheap ops (`_save_matmuls`, with `recompute_widening`); with the RNG state kept where a block has
    dropout, so the recomputation is exact. Returns the wrappers. checkpoint_wrapper's
    state-dict hooks drop its prefix, so checkpoints and exports keep the model's own parameter names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    # The recomputation must draw the dropout masks the forward drew: keep (and restore) the RNG state
    # whenever a block can draw random numbers. Without dropout there is nothing to replay, and saving
    # the state would cost a copy of the CUDA generator's state per block and step.
    kwargs = {"preserve_rng_state": any(draws_random_numbers(m) for m in model.modules() if isinstance(m, block_types))}
    if mode == "selective":
        policy = functools.partial(_save_matmuls, recompute_widening=recompute_widening)
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    wrapped: list[nn.Module] = []

    def wrap(block: nn.Module) -> nn.Module:
        wrapped.append(checkpoint_wrapper(block, **kwargs))
        return wrapped[-1]

    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrap, check_fn=lambda m: isinstance(m, block_types))
    return wrapped


def apply_toggles(
    model: nn.Module,
    t: TogglesConfig,
    *,
    block_types: tuple[type[nn.Module], ...],
    fp8_module: nn.Module | None = None,
    recompute_widening: bool = False,
) -> None:
    """fp8 (on `fp8_module`, default the whole model) -> activation checkpointing of every
    `block_types` module -> torch.compile of each block (its AC wrapper when there is one: compile
    traces the recompute too). `recompute_widening`: selective AC also recomputes up projections
    (the DiT's choice: without it selective keeps 57% of dit_tiny's activation bytes, with it 38%)."""
    if t.precision == "fp8":
        apply_fp8(model if fp8_module is None else fp8_module)
    blocks = [m for m in model.modules() if isinstance(m, block_types)]
    if t.activation_checkpointing != "none":
        blocks = apply_ac(model, t.activation_checkpointing, block_types, recompute_widening=recompute_widening)
    if t.compile:
        for block in blocks:  # one graph per block, reused by every layer of the same shape
            block.compile()
