"""The LLM's LoRA export: the adapter as a PEFT folder under Hugging Face's module names (what
`PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), folder)` and vLLM's LoRA load), and with
export.merge_lora the base with the adapter merged in by peft, as a LlamaForCausalLM folder.

Names go through recipes/llm/hf_adapter.py's state-dict adapter, the one place Kiln names meet Hugging Face's. It is a
pure rename: Kiln's attention uses transformers' RoPE layout (rotate_half), so q_proj/k_proj need no row
permutation, and neither do their lora_B (the rows they write).
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.config import LoRAConfig, TrainConfig
from common.lora import apply_lora, merge_into, peft_config, peft_state_dict, quantize_base, write_adapter_folder
from recipes.llm import weights
from recipes.llm.hf_adapter import to_hf_state_dict
from recipes.llm.model import LlamaArgs, Transformer


def hf_module(module: str, args: LlamaArgs) -> str:
    """A Kiln linear's Hugging Face name: `layers.0.attention.wq` -> `model.layers.0.self_attn.q_proj`."""
    (key,) = to_hf_state_dict({f"{module}.weight": torch.empty(0)}, args)
    return key.removesuffix(".weight")


def hf_adapter_state_dict(state: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """The adapter weights of a Kiln state dict under peft's saved names for a LlamaForCausalLM
    (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, ...)."""
    return peft_state_dict(state, lambda module: hf_module(module, args))


def peft_adapter(state: dict[str, torch.Tensor], args: LlamaArgs, lora: LoRAConfig, base: str):
    """(the adapter's tensors under peft's saved names, peft's LoraConfig naming `base` and the targets in Hugging
    Face's names) of an adapted Kiln state dict: what a PEFT adapter folder holds (write_export; GRPO's sync)."""
    adapter = hf_adapter_state_dict(state, args)
    targets = sorted({key.split(".lora_")[0].rpartition(".")[2] for key in adapter})
    config = peft_config(lora, targets, base=base)
    config.task_type, config.inference_mode = "CAUSAL_LM", True  # as PeftModel.save_pretrained writes it
    return adapter, config


def merged_state_dict(state: dict[str, torch.Tensor], args: LlamaArgs, cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """A full Kiln state dict (base + adapter, on the CPU) merged by peft (W + B A * alpha / rank): a plain
    Transformer's state dict. The caller's tensors are copied, not merged in place."""
    with torch.device("meta"):
        model = Transformer(args)
    return merge_into(model.to_empty(device="cpu"), state, cfg.lora).state_dict()


def write_export(state: dict[str, torch.Tensor], args: LlamaArgs, cfg: TrainConfig, out: Path, *, tokenizer) -> None:
    """The export of a finetune=lora run into ``out``: the PEFT adapter folder naming model.init_from as its base,
    with the tokenizer; with export.merge_lora, ``out/merged`` holds the merged model in the base's format.
    ``state``: the adapter's full tensors (the base's too for merging), Kiln names."""
    write_adapter_folder(out, *peft_adapter(state, args, cfg.lora, cfg.model.init_from))
    tokenizer.save_pretrained(str(out))
    if cfg.export.merge_lora:
        weights.write_hf_folder(
            merged_state_dict(state, args, cfg), args, out / "merged", tokenizer=tokenizer, source=cfg.model.init_from
        )


def adapted_model(args: LlamaArgs, cfg: TrainConfig) -> Transformer:
    """A whole LoRA-wrapped Llama in this process (scripts/export.py): the base from model.init_from, the adapter
    still to be loaded."""
    with torch.device("meta"):
        model = Transformer(args)
    apply_lora(model, cfg.lora)
    model.to_empty(device="cpu")
    model.init_buffers()
    weights.load_weights(model, args, cfg.model.init_from)
    if (
        cfg.lora.get("quantize_base", "none") == "nf4"
    ):  # the base the adapter was trained on (the merged export merges into it)
        quantize_base(model)
    return model
