"""The VLM's LoRA export: a PEFT adapter folder over the LLaVA (or Qwen-VL) of model.init_from (what
`PeftModel.from_pretrained(LlavaForConditionalGeneration.from_pretrained(base), folder)` loads; a
Qwen2_5_VLForConditionalGeneration or Qwen3VLForConditionalGeneration the same way), and with export.merge_lora the
merged model in export/merged, in llava-hf's layout (a Qwen-VL's: its release's).

Kiln's VLM is transformers' LlavaForConditionalGeneration itself, so the adapter's names are the model's own
(`model.language_model.layers.0.self_attn.q_proj`): no name map. The targets are one regex over whole names,
so that a PeftModel adapts the language model only (the SigLIP/CLIP tower has q_proj/k_proj/v_proj too). The
projector (a Qwen-VL's: its merger, and Qwen3-VL's DeepStack mergers), trained in full, travels in the adapter as
peft's `modules_to_save`.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from common.config import TrainConfig
from common.lora import merge_into, peft_config, peft_state_dict, write_adapter_folder
from recipes.vlm.llava import llava_hf_state_dict
from recipes.vlm.model import build_model
from recipes.vlm.parallelize import vlm_parts

LANGUAGE_MODEL = "model.language_model"  # LLaVA's, Qwen2.5-VL's and Qwen3-VL's


def projector_names(model) -> list[str]:
    """The projector's module names: `model.multi_modal_projector` (LLaVA), `model.visual.merger` (Qwen2.5-VL), and
    Qwen3-VL's `model.visual.deepstack_merger_list.<i>` after it (`vlm_parts`' view of them)."""
    projector = vlm_parts(model)[1]
    names = {id(module): name for name, module in model.named_modules()}
    return [names[id(m)] for m in ([projector] if id(projector) in names else projector)]


def saved_module(name: str) -> str:
    """peft's modules_to_save entry for module `name`: its last part, with its list's name for a list element
    (`deepstack_merger_list.0`; peft matches the entries as suffixes of module names)."""
    parts = name.split(".")
    return ".".join(parts[-2:] if parts[-1].isdigit() else parts[-1:])


def adapter_config(cfg: TrainConfig, base: str, projector: tuple[str, ...] = ("model.multi_modal_projector",)):
    """peft's LoraConfig of the export: the language model's targets as a regex, the projector saved whole when it
    trained (vlm.train_projector)."""
    targets = rf"{re.escape(LANGUAGE_MODEL)}\..*\.({'|'.join(sorted(cfg.lora.targets))})"
    saved = [saved_module(n) for n in projector] if cfg.vlm.train_projector else None
    config = peft_config(cfg.lora, targets, base=base, modules_to_save=saved)
    config.inference_mode = True  # as PeftModel.save_pretrained writes it
    return config


def adapter_state_dict(
    state: dict[str, torch.Tensor], projector: tuple[str, ...] = ("model.multi_modal_projector",)
) -> dict[str, torch.Tensor]:
    """The adapter and the projector's modules (none: a frozen one, not saved) of a LoRA-wrapped VLM's state dict
    under peft's saved names (`base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight`,
    `base_model.model.model.multi_modal_projector.linear_1.weight`, ...)."""
    return peft_state_dict(state) | {
        f"base_model.model.{k}": v for k, v in state.items() if k.startswith(tuple(n + "." for n in projector))
    }


def write_export(model, cfg: TrainConfig, out: Path, *, base: str, processor) -> None:
    """The export of a finetune=lora run into ``out`` (``model``: the trained, LoRA-wrapped LLaVA with its full
    weights here; ``base``: the LLaVA folder it adapts): the PEFT adapter folder with the processor; with
    export.merge_lora, ``out/merged`` holds the merged LlavaForConditionalGeneration."""
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    projector = tuple(projector_names(model))
    saved = projector if cfg.vlm.train_projector else ()
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
