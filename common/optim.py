"""What every recipe's optimizer shares: the AdamW kernel for the device, and the learning-rate schedule
(linear warmup, then constant/cosine/linear decay)."""

from __future__ import annotations

import math

import torch

from common.config import OptimConfig


def adamw_kernel(device: torch.device) -> dict[str, bool]:
    """torch AdamW's implementation keyword for the LLM: the fused kernel on CUDA (one launch for all
    parameters); foreach on CPU, as before (the DeepSpeed recipes ask for fused the same way,
    common/deepspeed.py)."""
    return {"fused": True} if device.type == "cuda" else {"foreach": True}


def lr_factor(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Multiplier of `cfg.lr` for optimizer step `step` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
    if cfg.schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # linear
        decay = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay
