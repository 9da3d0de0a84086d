"""Freeze per training stage (finetune=lora: adapters on the language model), then the toggles: kernels → fp8 →
AC → compile (ZeRO comes last, when common/engine.py:DeepSpeedEngine wraps the model). The attention kernels
are recipes/vlm/attention.py's."""

from __future__ import annotations

import torch
from transformers import LlavaForConditionalGeneration
from transformers.modeling_layers import GradientCheckpointingLayer

from common.config import TrainConfig
from common.lora import apply_lora
from common.parallel_dims import CPGroups
from common.toggles import apply_toggles
from recipes.vlm.context_parallel import split_language_model


def vlm_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """(vision tower, projector, language model) of a LlavaForConditionalGeneration, a
    Qwen2_5_VLForConditionalGeneration or a Qwen3VLForConditionalGeneration. Qwen's projector is its merger (2x2
    patches -> one token, then an MLP), a module of the tower: what its own fine-tuning calls the `mm_mlp`, as
    LLaVA's projector is. Qwen3-VL's DeepStack mergers (intermediate blocks' features -> the first language layers)
    project too, and train with it (as ms-swift's aligner and Qwen's fine-tuning scripts have them): its projector
    is a ModuleList view of [merger, *deepstack_merger_list] (the modules stay where the model holds them)."""
    inner = model.model
    if hasattr(inner, "visual"):  # Qwen2.5-VL, Qwen3-VL
        deepstack = getattr(inner.visual, "deepstack_merger_list", None)
        merger = torch.nn.ModuleList([inner.visual.merger, *deepstack]) if deepstack else inner.visual.merger
        return inner.visual, merger, inner.language_model
    return inner.vision_tower, inner.multi_modal_projector, inner.language_model


def unused_tower_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Tower modules LLaVA's features never reach: the encoder layers after `vision_feature_layer` and
    the post-encoder norm/head (features are hidden states). Frozen even under `vlm.train_vision`: they
    would get no gradient, which ZeRO's gradient buckets do not expect. A Qwen-VL's merger reads the tower's
    last block: none."""
    if not hasattr(model.config, "vision_feature_layer"):
        return []
    tower, layer = model.model.vision_tower, model.config.vision_feature_layer
    deepest = max(layer) if isinstance(layer, (list, tuple)) else layer
    layers = tower.encoder.layers
    used = len(layers) + 1 + deepest if deepest < 0 else deepest  # hidden_states[i] = output of i layers
    tail = [getattr(tower, name, None) for name in ("post_layernorm", "head")]
    return list(layers[used:]) + [m for m in tail if m is not None]


def freeze_for_stage(
    model: torch.nn.Module, stage: str, train_vision: bool = False, train_projector: bool = True
) -> None:
    """align: only the projector learns (LLaVA stage 1; a Qwen-VL's merger(s)). finetune: projector + language
    model (LLaVA stage 2), plus the vision tower with `vlm.train_vision`, less the projector (all of Qwen3-VL's
    mergers) with `vlm.train_projector=false`. Frozen = requires_grad False, so it never reaches the optimizer
    (common/deepspeed.py passes only trainable parameters)."""
    tower, projector, language_model = vlm_parts(model)
    model.requires_grad_(False)
    projector.requires_grad_(train_projector)
    if stage == "finetune":
        language_model.requires_grad_(True)
        model.lm_head.requires_grad_(True)
        if train_vision:
            tower.requires_grad_(True)
            for module in unused_tower_modules(model):
                module.requires_grad_(False)


def trainable_parts(model: LlavaForConditionalGeneration, cfg: TrainConfig) -> None:
    """What trains: `freeze_for_stage`'s parts, or under finetune=lora (vlm.stage=finetune) the projector in full
    (unless vlm.train_projector=false) and LoRA adapters on the language model's linears (common/lora.py),
    everything else frozen."""
    if cfg.finetune != "lora":
        freeze_for_stage(model, cfg.vlm.stage, cfg.vlm.train_vision, cfg.vlm.train_projector)
        return
    freeze_for_stage(model, "align", train_projector=cfg.vlm.train_projector)  # the projector only, or nothing
    apply_lora(vlm_parts(model)[2], cfg.lora)


def parallelize(
    model: LlavaForConditionalGeneration, cfg: TrainConfig, cp: CPGroups | None = None
) -> LlavaForConditionalGeneration:
    """`model` frozen for its stage (`trainable_parts`), its language model split over `cp` (parallel.cp > 1), with
    its toggles applied, ready for the engine (DeepSpeed ZeRO over the trainable parameters; the attention kernel
    was chosen when the model was built: `toggles.attention` → attn_implementation)."""
    trainable_parts(model, cfg)
    if cp is not None:
        split_language_model(model, cp)
    # Blocks: every decoder and vision encoder layer (the layers transformers itself checkpoints);
    # fp8 only in the language model (the tower's widths are often not multiples of 16).
    apply_toggles(model, cfg.toggles, block_types=(GradientCheckpointingLayer,), fp8_module=model.model.language_model)
    return model
