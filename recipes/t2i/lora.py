"""The text-to-image LoRA export: the adapter in the format diffusers' pipeline of the base's class loads --
`StableDiffusion3Pipeline.from_pretrained(base).load_lora_weights(export)`, FluxPipeline's likewise -- and with
export.merge_lora a whole pipeline folder with the adapter merged into the transformer (export/merged).

The file is diffusers' own: the pipeline class's `save_lora_weights` writes pytorch_lora_weights.safetensors from
the adapter under peft's `get_peft_model_state_dict(transformer)` names, as diffusers'
examples/dreambooth/train_dreambooth_lora_sd3.py (and _flux.py) do, with the adapter's LoraConfig in the file's
metadata: load_lora_weights reads lora_alpha from it (without it diffusers would take alpha = rank, another scale
than the run trained). Kiln's transformer is diffusers' class itself, so the names are the model's own
(`transformer_blocks.0.attn.to_q`). The weights are the EMA's, as the full export's are.

The end of a run (T2ITrainer.export) and scripts/export.py (recipes/t2i/export.py, from any checkpoint) both write the
folder with `write_export`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from common.config import TrainConfig
from common.lora import apply_lora, merge_into, peft_config, peft_state_dict
from recipes.t2i.weights import adapter, export_info, load_transformer, write_pipeline

WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE: what load_lora_weights looks for


def adapted_model(cfg: TrainConfig, base: Path):
    """A LoRA-wrapped transformer (SD3's, Flux's) in this process (scripts/export.py), built as the trainer builds it:
    the base pipeline's weights, in fp32, the adapter still to be loaded."""
    return apply_lora(load_transformer(base), cfg.lora)


def write_export(model, cfg: TrainConfig, out: Path, *, base: Path, step: int) -> None:
    """The export of a finetune=lora run into ``out`` (``model``: the LoRA-wrapped transformer holding the EMA weights,
    whole, here; ``base``: the pipeline folder it adapts): diffusers' LoRA file and kiln.json; with export.merge_lora,
    ``out/merged`` holds the whole pipeline with the merged transformer."""
    import diffusers

    pipeline = adapter(base).pipeline
    metadata = peft_config(cfg.lora, base=str(base)).to_dict()
    metadata["target_modules"] = sorted(metadata["target_modules"])  # peft keeps a set: the same file every time
    getattr(diffusers, pipeline).save_lora_weights(
        out,
        transformer_lora_layers=lora_layers(model),
        weight_name=WEIGHTS,
        transformer_lora_adapter_metadata=metadata,
    )
    load = f"pipe = {pipeline}.from_pretrained(base); pipe.load_lora_weights(EXPORT); pipe"
    info = export_info(cfg, base, step, load=load)
    info["lora"] = {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "targets": list(cfg.lora.targets)}
    (out / "kiln.json").write_text(json.dumps(info, indent=2))
    if cfg.export.merge_lora:
        write_pipeline(out / "merged", base, cfg, step=step, transformer=merged(model, cfg, base))


def lora_layers(model) -> dict[str, torch.Tensor]:
    """peft's `get_peft_model_state_dict(model)` (`transformer_blocks.0.attn.to_q.lora_A.weight`, ...), from the state
    dict, whose names activation checkpointing's wrapper leaves alone (peft's function matches module names, which it
    renames: under toggles.activation_checkpointing it finds no adapter)."""
    prefix = "base_model.model."
    return {k.removeprefix(prefix): v for k, v in peft_state_dict(model.state_dict()).items()}


def merged(model, cfg: TrainConfig, base: Path):
    """The base's transformer with ``model``'s adapter merged in by peft (W + B A alpha/rank; the caller's
    weights are copied), in ``model``'s dtype."""
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    dtype = next(model.parameters()).dtype
    fresh = merge_into(load_transformer(base), state, cfg.lora)
    return (fresh if dtype == torch.float32 else fresh.to(dtype)).eval()
