"""The DiT's LoRA export: a PEFT adapter folder over the DiTTransformer2DModel of model.init_from, and with
export.merge_lora the transformer with the adapter merged in (the recipe writes it as a whole pipeline export).

diffusers' DiTTransformer2DModel has no LoRA loader of its own (no PeftAdapterMixin in diffusers 0.42) and
DiTPipeline none either: the adapter is peft's, loaded onto the pipeline's transformer in place --
`PeftModel.from_pretrained(pipe.transformer, folder)` -- after which the pipeline samples with it. Kiln's DiT is
diffusers' class itself, so the adapter's names are the model's own (`transformer_blocks.0.attn1.to_q`). The
weights are the EMA's, as the DiT's full export holds the EMA of every weight: the EMA tracks what trains.

The end of a run (DiTTrainer.export) and scripts/export.py (recipes/dit/export.py, from any checkpoint) both write
the folder with `write_export`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.config import TrainConfig
from common.lora import apply_lora, merge_into, peft_config, peft_state_dict, write_adapter_folder
from recipes.dit import weights
from recipes.dit.model import build_model


def adapted_model(cfg: TrainConfig, sample_size: int, in_channels: int):
    """A LoRA-wrapped DiT in this process (scripts/export.py), built as the trainer builds it: model.init_from's
    weights, in fp32, the adapter still to be loaded."""
    model = build_model(cfg.model, sample_size, in_channels)
    weights.load_weights(model, weights.transformer_folder(cfg.model.init_from))
    return apply_lora(model, cfg.lora)


def write_export(model, cfg: TrainConfig, out: Path, *, base: str, write_pipeline) -> None:
    """The export of a finetune=lora run into ``out`` (``model``: the LoRA-wrapped DiT holding the EMA weights, whole,
    here; ``base``: the transformer folder it adapts): the PEFT adapter folder; with export.merge_lora, ``out/merged``
    holds a whole DiT export of the merged transformer, written by ``write_pipeline(folder, transformer)``."""
    write_adapter(model, cfg, out, base=base)
    if cfg.export.merge_lora:
        write_pipeline(out / "merged", merged(model, cfg))


def write_adapter(model, cfg: TrainConfig, out: Path, *, base: str) -> None:
    """The PEFT adapter folder of ``model`` (the LoRA-wrapped DiT, its weights here) on the transformer folder
    ``base``."""
    config = peft_config(cfg.lora, base=base)
    config.inference_mode = True  # as PeftModel.save_pretrained writes it
    write_adapter_folder(out, peft_state_dict(model.state_dict()), config)


def merged(model, cfg: TrainConfig):
    """A plain DiTTransformer2DModel of ``model``'s config with its adapter merged in by peft (the caller's weights
    are copied), in ``model``'s dtype."""
    fresh = build_model(cfg.model, model.config.sample_size, model.config.in_channels)
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    dtype = next(model.parameters()).dtype
    merge_into(fresh, state, cfg.lora)
    return (fresh if dtype == torch.float32 else fresh.to(dtype)).eval()
