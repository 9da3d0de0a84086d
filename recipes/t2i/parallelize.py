"""Apply the toggles to an SD3-class transformer, in the fixed order: fp8 → AC → compile (ZeRO comes last, when
common/engine.py:DeepSpeedEngine wraps the model). Attention is diffusers' own joint attention (SDPA)."""

from __future__ import annotations

from diffusers.models.attention import JointTransformerBlock

from common.config import TrainConfig
from common.toggles import apply_toggles


def parallelize(model, cfg: TrainConfig):
    """`model` with activation checkpointing (per JointTransformerBlock) and the toggles applied, ready for the
    engine (DeepSpeed ZeRO over every weight: a full fine-tune)."""
    apply_toggles(model, cfg.toggles, block_types=(JointTransformerBlock,), recompute_widening=True)
    return model
