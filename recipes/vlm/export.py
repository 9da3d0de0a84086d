"""A VLM run's export/ rebuilt from any of its DeepSpeed checkpoints (scripts/export.py), in bounded memory: the
llava-hf folder the end of the run writes (VLMTrainer.export), tensor for tensor, for the checkpoint's step.

The weights are the module's as the engine held them (common/ds_export.py reads any ZeRO stage), under the names
save_pretrained gives them: llava-hf's tower names (`llava_hf_state_dict`), then transformers' own save-time
renames, found on the model built on the meta device, so no tensor is held but one shard's.

A finetune=lora run's checkpoints hold what trains only (the language model's adapter and the projector; DeepSpeed's
exclude_frozen_parameters): `export_lora_checkpoint` loads model.init_from's LLaVA as the trainer does, whole in host
memory (the merged export needs it, and the adapter is small), puts the checkpoint's tensors in and writes what the
end of the run writes (recipes/vlm/lora.py write_export).
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.config import TrainConfig
from common.ds_export import ZeroCheckpoint, copy_checked, export_zero, export_zero_lora, write_safetensors
from common.errors import UserError
from recipes.vlm import lora as vlm_lora
from recipes.vlm.data import PROCESSOR_DIR
from recipes.vlm.llava import llava_hf_state_dict
from recipes.vlm.model import build_model
from recipes.vlm.parallelize import trainable_parts
from recipes.vlm.weights import init_folder, load_model, weight_source


def dataset_meta(cfg: TrainConfig) -> dict:
    """The dataset's meta.json (the digits demo's processor lives beside it), without building anything."""
    from common.data.dataset import load_dataset_meta
    from recipes.vlm.data import is_conversations

    meta = load_dataset_meta(cfg.data.root)
    return meta if is_conversations(meta) else load_dataset_meta(cfg.data.root, asset=PROCESSOR_DIR)


def saved_names(model) -> dict[str, str]:
    """{name in the saved file: module state-dict key}, as `save_pretrained(state_dict=llava_hf_state_dict(model))`
    names them: transformers drops tied copies and reverts its load-time renames. Meta tensors pass through
    by identity; a conversion that makes new tensors (a fused weight) is not a rename and is refused."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    llava_hf = dict(zip(state, llava_hf_state_dict(model)))  # module key -> llava-hf name, in the same order
    # Ties are found by the module's own names (meta tensors cannot be compared by storage); llava-hf's renames
    # touch the tower only, which ties nothing.
    kept = remove_tied_weights_from_state_dict(state, model)
    module_key = {id(v): k for k, v in kept.items()}
    saved = revert_weight_conversion(model, {llava_hf[k]: v for k, v in kept.items()})
    unknown = [k for k, v in saved.items() if id(v) not in module_key]
    if unknown:
        raise RuntimeError(f"transformers' save converts {unknown[0]} (not a rename): no streamed export of it")
    return {k: module_key[id(v)] for k, v in saved.items()}


def export_checkpoint(cfg: TrainConfig, path: Path, meta: dict, out: Path, *, max_shard_size: str | None) -> str:
    """Write the export of checkpoint `path` to `out` (scripts/export.py); returns what was written, in words."""
    return export_zero(path, max_shard_size, lambda ckpt, shard_size: write_export(cfg, ckpt, out, shard_size))


def write_export(cfg: TrainConfig, ckpt: ZeroCheckpoint, out: Path, max_shard_size: int) -> int:
    """Write the export of checkpoint `ckpt` to `out`; returns the weight bytes written."""
    source = weight_source(cfg, dataset_meta(cfg))
    processor, config = source.processor(), source.config()
    with torch.device("meta"):
        model = build_model(config, cfg.toggles.attention)
    names = saved_names(model)
    shapes = model.state_dict()
    layout = {
        k: torch.empty(
            shapes[m].shape, device="meta", dtype=ckpt.dtype if shapes[m].is_floating_point() else shapes[m].dtype
        )
        for k, m in names.items()
    }

    def fetch(keys: list[str]) -> dict[str, torch.Tensor]:
        got = ckpt.tensors([names[k] for k in keys])
        return {k: got[names[k]] for k in keys}

    written = write_safetensors(out, "model.safetensors", layout, fetch, max_shard_size)
    # What save_pretrained records of the model: its dtype and class.
    model.config.dtype = str(ckpt.dtype).removeprefix("torch.")
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)
    processor.save_pretrained(out)
    processor.image_processor.save_pretrained(out)
    return written


def lora_base(cfg: TrainConfig) -> str:
    """The folder a finetune=lora export loads its base from, as the trainer does: the LLaVA (or Qwen2.5-VL) folder
    model.init_from names (an align run's export/, or the folder itself)."""
    return str(init_folder(cfg.model.init_from)[0])


def export_lora_checkpoint(cfg: TrainConfig, path: Path, meta: dict, out: Path, *, max_shard_size: str | None) -> str:
    """Write the export of finetune=lora checkpoint `path` to `out` (scripts/export.py); returns what was written."""
    return export_zero_lora(
        path,
        max_shard_size,
        lambda ckpt: write_lora_export(cfg, ckpt, out),
        adapter="a LoRA adapter and projector",
        source=cfg.model.init_from,
    )


def write_lora_export(cfg: TrainConfig, ckpt: ZeroCheckpoint, out: Path) -> int:
    """Write the export of finetune=lora checkpoint `ckpt` to `out`: the PEFT adapter folder (the projector in it) with
    the processor, with export.merge_lora the merged LLaVA in out/merged; returns the parameter count read from the
    checkpoint."""
    model, processor, source = load_model(cfg, None)  # model.init_from's LLaVA, in fp32
    trainable_parts(model, cfg)  # the trainer's: the projector and the language model's adapter train
    if ckpt.dtype != torch.float32:
        model.to(ckpt.dtype)  # DeepSpeed's cast of the module (bf16/fp16 runs)
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    try:
        got = ckpt.tensors(list(trained))
    except KeyError as exc:
        raise UserError(
            f"{ckpt.path} holds no {exc.args[0]}: not a checkpoint of the adapter lora.* in the run's config.yaml build"
        ) from None
    copy_checked(trained, got, ckpt.path)
    vlm_lora.write_export(model, cfg, out, base=str(source.folder), processor=processor)
    return sum(p.numel() for p in trained.values())
