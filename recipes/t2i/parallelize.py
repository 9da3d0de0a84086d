"""Apply LoRA and the toggles to an SD3 or Flux transformer, in the fixed order: LoRA → fp8 → AC → compile (ZeRO comes
last, when common/engine.py:DeepSpeedEngine wraps the model). Attention is diffusers' own joint attention (SDPA)."""

from __future__ import annotations

from common.config import TrainConfig
from common.lora import apply_lora
from common.toggles import apply_toggles


def parallelize(model, cfg: TrainConfig):
    """`model` with its adapters (finetune=lora: the joint attention's linears, the rest frozen), activation
    checkpointing (per transformer block: SD3's JointTransformerBlock; Flux's double- and single-stream blocks) and
    the toggles applied, ready for the engine (DeepSpeed ZeRO over what
    trains: every weight in a full fine-tune)."""
    if cfg.finetune == "lora":
        apply_lora(model, cfg.lora)
    blocks = [*model.transformer_blocks, *getattr(model, "single_transformer_blocks", ())]
    apply_toggles(model, cfg.toggles, block_types=tuple({type(b) for b in blocks}), recompute_widening=True)
    return model
