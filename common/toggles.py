"""Optimization toggles shared by every recipe: precision, TF32, compile, attention backend.

`check_toggles` runs before anything is written, so an impossible toggle on this machine
(flash without CUDA, fp8 on a GPU without fp8 units) ends the run with one line.
Activation checkpointing is applied by each recipe's parallelize function, which knows its
block structure; the toggle's value is validated here.
"""

from __future__ import annotations

import importlib.util

import torch

from common.config import TogglesConfig
from common.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def _cuda_capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def check_toggles(t: TogglesConfig) -> None:
    cap = _cuda_capability()
    where = f"CUDA capability {cap[0]}.{cap[1]}" if cap else "no CUDA device"
    if t.precision == "fp16" and cap is None:
        raise ConfigError("toggles.precision=fp16 needs a CUDA GPU (loss-scaled fp16 is GPU-only); use bf16 or fp32 on CPU")
    if t.precision == "fp8":
        if cap is None or cap < (8, 9):
            raise ConfigError(f"toggles.precision=fp8 needs a GPU with fp8 tensor cores (capability >= 8.9); found {where}")
        if importlib.util.find_spec("torchao") is None:
            raise ConfigError("toggles.precision=fp8 needs the torchao package (pip install torchao)")
    if t.attention == "flash":
        if cap is None:
            raise ConfigError(f"toggles.attention=flash needs CUDA and the flash-attn package; found {where}: use sdpa")
        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError("toggles.attention=flash needs the flash-attn package (pip install -e .[gpu]); use sdpa")


def apply_global_toggles(t: TogglesConfig) -> None:
    """Process-wide switches: TF32 matmuls and convolutions on Ampere and newer GPUs."""
    torch.backends.cuda.matmul.allow_tf32 = t.tf32
    torch.backends.cudnn.allow_tf32 = t.tf32
    torch.set_float32_matmul_precision("high" if t.tf32 else "highest")


def param_dtype(t: TogglesConfig) -> torch.dtype:
    """Dtype of weights and activations in compute (fp8 keeps bf16 weights, fp8 matmuls)."""
    return DTYPES[t.precision]


def apply_fp8(model: torch.nn.Module) -> torch.nn.Module:
    """Swap nn.Linear layers for torchao's float8 training linears (dynamic scaling).

    Layers whose dimensions are not multiples of 16 stay in bf16: fp8 GEMMs need them.
    """
    from torchao.float8 import convert_to_float8_training

    def fits(module: torch.nn.Module, _fqn: str) -> bool:
        return isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0

    return convert_to_float8_training(model, module_filter_fn=fits)


def compile_blocks(blocks: torch.nn.ModuleList) -> None:
    """torch.compile each repeated block in place: one graph reused by every layer."""
    for block in blocks:
        block.compile()
