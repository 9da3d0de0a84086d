"""The VLM's LoRA export: a PEFT adapter folder over the LLaVA (or Qwen2.5-VL) of model.init_from (what
`PeftModel.from_pretrained(LlavaForConditionalGeneration.from_pretrained(base), folder)` loads; a
Qwen2_5_VLForConditionalGeneration the same way), and with export.merge_lora the merged model in export/merged,
in llava-hf's layout (a Qwen2.5-VL's: its release's).

Kiln's VLM is transformers' LlavaForConditionalGeneration itself, so the adapter's names are the model's own
(`model.language_model.layers.0.self_attn.q_proj`): no name map. The targets are one regex over whole names,
so that a PeftModel adapts the language model only (the SigLIP/CLIP tower has q_proj/k_proj/v_proj too). The
projector (Qwen2.5-VL's: its merger), trained in full, travels in the adapter as peft's `modules_to_save`.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from common.config import TrainConfig
from common.lora import merge_into, peft_config, peft_state_dict, write_adapter_folder
from recipes.vlm.model import build_model
from recipes.vlm.parallelize import vlm_parts
from recipes.vlm.pretrained import llava_hf_state_dict

LANGUAGE_MODEL = "model.language_model"  # LLaVA's and Qwen2.5-VL's


def projector_name(model) -> str:
    """The projector's module name: `model.multi_modal_projector` (LLaVA), `model.visual.merger` (Qwen2.5-VL)."""
    projector = vlm_parts(model)[1]
    return next(name for name, module in model.named_modules() if module is projector)


def adapter_config(cfg: TrainConfig, base: str, projector: str = "model.multi_modal_projector"):
    """peft's LoraConfig of the export: the language model's targets as a regex, the projector saved whole when it
    trained (vlm.train_projector)."""
    targets = rf"{re.escape(LANGUAGE_MODEL)}\..*\.({'|'.join(sorted(cfg.lora.targets))})"
    saved = [projector.rpartition(".")[2]] if cfg.vlm.train_projector else None
    config = peft_config(cfg.lora, targets, base=base, modules_to_save=saved)
    config.inference_mode = True  # as PeftModel.save_pretrained writes it
    return config


def adapter_state_dict(
    state: dict[str, torch.Tensor], projector: str | None = "model.multi_modal_projector"
) -> dict[str, torch.Tensor]:
    """The adapter and the projector (None: a frozen one, not saved) of a LoRA-wrapped VLM's state dict under peft's
    saved names (`base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight`,
    `base_model.model.model.multi_modal_projector.linear_1.weight`, ...)."""
    return peft_state_dict(state) | {
        f"base_model.model.{k}": v for k, v in state.items() if projector and k.startswith(projector + ".")
    }


def write_export(model, cfg: TrainConfig, out: Path, *, base: str, processor) -> None:
    """The export of a finetune=lora run into ``out`` (``model``: the trained, LoRA-wrapped LLaVA with its full
    weights here; ``base``: the LLaVA folder it adapts): the PEFT adapter folder with the processor; with
    export.merge_lora, ``out/merged`` holds the merged LlavaForConditionalGeneration."""
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    projector = projector_name(model)
    saved = projector if cfg.vlm.train_projector else None
    write_adapter_folder(out, adapter_state_dict(state, saved), adapter_config(cfg, base, projector))
    processor.save_pretrained(out)
    if cfg.export.merge_lora:
        with torch.device("meta"):
            merged = build_model(model.config)
        merged.to_empty(device="cpu")
        merge_into(merged, state, cfg.lora, merged.model.language_model)
        merged.save_pretrained(out / "merged", state_dict=llava_hf_state_dict(merged), safe_serialization=True)
        processor.save_pretrained(out / "merged")
        processor.image_processor.save_pretrained(out / "merged")
