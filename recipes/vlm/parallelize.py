"""Freeze per training stage, then apply toggles and DeepSpeed ZeRO: kernels → AC → compile → ZeRO."""

from __future__ import annotations

from transformers import LlavaForConditionalGeneration

from common import deepspeed as ds
from common.config import TrainConfig
from common.toggles import apply_fp8, compile_blocks


def freeze_for_stage(model: LlavaForConditionalGeneration, stage: str) -> None:
    """align: only the projector learns (LLaVA stage 1). finetune: projector + language model
    (LLaVA stage 2). The vision tower stays frozen in both."""
    model.requires_grad_(False)
    model.model.multi_modal_projector.requires_grad_(True)
    if stage == "finetune":
        model.model.language_model.requires_grad_(True)
        model.lm_head.requires_grad_(True)


def parallelize(model: LlavaForConditionalGeneration, cfg: TrainConfig, world_size: int):
    """Returns the DeepSpeed engine over the trainable parameters (attention kernel already chosen
    when the model was built: `toggles.attention` → attn_implementation)."""
    freeze_for_stage(model, cfg.vlm.stage)
    language_model = model.model.language_model
    if cfg.toggles.precision == "fp8":
        apply_fp8(language_model)
    if cfg.toggles.activation_checkpointing == "full":
        # Recompute every decoder and vision layer in backward (non-reentrant: works with frozen inputs).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.toggles.compile:
        compile_blocks(language_model.layers)
    return ds.initialize(model, cfg, world_size)
