"""Freeze per training stage, then apply toggles and DeepSpeed ZeRO: kernels → fp8 → AC → compile → ZeRO."""

from __future__ import annotations

from transformers import LlavaForConditionalGeneration
from transformers.modeling_layers import GradientCheckpointingLayer

from common import deepspeed as ds
from common.config import TrainConfig
from common.toggles import apply_toggles


def freeze_for_stage(model: LlavaForConditionalGeneration, stage: str) -> None:
    """align: only the projector learns (LLaVA stage 1). finetune: projector + language model
    (LLaVA stage 2). The vision tower stays frozen in both."""
    model.requires_grad_(False)
    model.model.multi_modal_projector.requires_grad_(True)
    if stage == "finetune":
        model.model.language_model.requires_grad_(True)
        model.lm_head.requires_grad_(True)


def parallelize(model: LlavaForConditionalGeneration, cfg: TrainConfig, dp: int):
    """Returns the DeepSpeed engine over the trainable parameters (attention kernel already chosen
    when the model was built: `toggles.attention` → attn_implementation)."""
    freeze_for_stage(model, cfg.vlm.stage)
    # Blocks: every decoder and vision encoder layer (the layers transformers itself checkpoints);
    # fp8 only in the language model (the tower's widths are often not multiples of 16).
    apply_toggles(model, cfg.toggles, block_types=(GradientCheckpointingLayer,), fp8_module=model.model.language_model)
    return ds.initialize(model, cfg, dp)
