"""A released diffusers pipeline folder as a family's base (`model.init_from`) and the shape of its export: the
folder checked, its parts copied with the trained transformer in place, the LoRA file diffusers' loader reads, and
the export rebuilt from any checkpoint. The text-to-image (SD3, Flux) and video (Wan) families share it; what differs
between their pipelines is their weights module (recipes/<family>/weights.py), which this module takes as
`weights`:

    weights.pipeline_folder(init_from) -> Path       the folder, checked (one ConfigError line otherwise)
    weights.pipeline_class(base) -> str              diffusers' pipeline class of the folder ("WanPipeline")
    weights.load_transformer(base)                   its transformer in fp32, training mode
    weights.meta_transformer(base)                   the same on the meta device (a streamed export's layout)
    weights.export_info(cfg, base, step, load=None)  kiln.json: the run and how to sample the export

The LoRA file is diffusers' own: the pipeline class's `save_lora_weights` writes pytorch_lora_weights.safetensors from
the adapter under peft's `get_peft_model_state_dict(transformer)` names, as diffusers' examples/dreambooth scripts do,
with the adapter's LoraConfig in its metadata: load_lora_weights reads lora_alpha from it (without it diffusers would
take alpha = rank, another scale than the run trained). Kiln's transformer is diffusers' class itself, so the names
are the model's own (`blocks.0.attn1.to_q`). The weights are the EMA's, as the full export's are.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType

import torch

from common.config import TrainConfig
from common.errors import ConfigError
from common.weights import check_folder

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE: what load_lora_weights reads


def read_index(init_from: str, transformers: dict[str, str], recipe: str) -> tuple[Path, dict]:
    """(the folder, its model_index.json) of the pipeline `model.init_from` names, one of `transformers`' classes
    (pipeline class -> its transformer's class); one line if it is no pipeline folder, one of another class, or its
    transformer's weights are missing or damaged."""
    folder = Path(init_from).expanduser().absolute()
    try:
        index = json.loads((folder / "model_index.json").read_text())
    except (OSError, ValueError):
        raise ConfigError(
            f"model.init_from={init_from}: no diffusers pipeline folder there (no readable model_index.json; a "
            f"{' or '.join(transformers)} saved with save_pretrained or downloaded whole)"
        ) from None
    name = index.get("_class_name") if isinstance(index, dict) else None
    if name not in transformers:
        raise ConfigError(
            f"model.init_from={init_from} is a {name or 'pipeline of no known class'}; the {recipe} recipe trains "
            f"{', '.join(transformers)} folders"
        )
    if (index.get("transformer") or [None, None])[1] != transformers[name]:
        raise ConfigError(f"model.init_from={init_from}: its transformer is not a diffusers {transformers[name]}")
    transformer = folder / "transformer"
    if not any(transformer.glob("*.safetensors")):
        raise ConfigError(f"model.init_from={init_from}: no *.safetensors weights in {transformer}")
    check_folder(transformer, f"model.init_from={init_from}")  # one line for a file cut short
    return folder, index


def part_identity(folder: Path, name: str, source: str) -> dict:
    """What a cache of a frozen part (the VAE, a text encoder: subfolder `name`) records of it: its config (version
    stamps left out) and its weights' fingerprint (common/weights.py)."""
    from common.weights import fingerprint

    config = json.loads((folder / name / "config.json").read_text())
    drop = ("transformers_version", "_diffusers_version", "_name_or_path")
    return {"config": {k: v for k, v in config.items() if k not in drop}, "weights": fingerprint(folder / name, source)}


def meta_model(cls: type, folder: Path):
    """A diffusers model of class `cls` configured as `folder`'s, on the meta device: the layout and config.json of a
    streamed export. from_pretrained records where it loaded from (`_name_or_path`, in the config.json
    save_pretrained writes at the end of a run); from_config does not: recorded here the same way."""
    with torch.device("meta"):
        model = cls.from_config(json.loads((folder / "config.json").read_text()))
    model.register_to_config(_name_or_path=str(folder))
    return model


def write_pipeline(folder: Path, base: Path, info: dict, transformer=None) -> None:
    """The export: the base pipeline's folder with its transformer replaced (`transformer` saved with
    save_pretrained, in the dtype it trained in; None: the caller writes transformer/), and kiln.json (`info`)."""
    shutil.copytree(base, folder, ignore=lambda d, names: ["transformer"] if Path(d) == base else [])
    if transformer is not None:
        transformer.save_pretrained(folder / "transformer", safe_serialization=True)
    (folder / "kiln.json").write_text(json.dumps(info, indent=2))


# ---- LoRA: the adapter as diffusers' LoRA file on the base -------------------------------------------------
def adapted_model(weights: ModuleType, cfg: TrainConfig, base: Path):
    """A LoRA-wrapped transformer in this process (scripts/export.py), built as the trainer builds it: the base
    pipeline's weights, in fp32, the adapter still to be loaded."""
    from common.lora import apply_lora

    return apply_lora(weights.load_transformer(base), cfg.lora)


def write_lora_export(weights: ModuleType, model, cfg: TrainConfig, out: Path, *, base: Path, step: int) -> None:
    """The export of a finetune=lora run into ``out`` (``model``: the LoRA-wrapped transformer holding the EMA weights,
    whole, here; ``base``: the pipeline folder it adapts): diffusers' LoRA file and kiln.json; with export.merge_lora,
    ``out/merged`` holds the whole pipeline with the merged transformer."""
    import diffusers

    from common.lora import peft_config

    pipeline = weights.pipeline_class(base)
    metadata = peft_config(cfg.lora, base=str(base)).to_dict()
    metadata["target_modules"] = sorted(metadata["target_modules"])  # peft keeps a set: the same file every time
    getattr(diffusers, pipeline).save_lora_weights(
        out,
        transformer_lora_layers=lora_layers(model),
        weight_name=LORA_WEIGHTS,
        transformer_lora_adapter_metadata=metadata,
    )
    load = f"pipe = {pipeline}.from_pretrained(base); pipe.load_lora_weights(EXPORT); pipe"
    info = weights.export_info(cfg, base, step, load=load)
    info["lora"] = {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "targets": list(cfg.lora.targets)}
    (out / "kiln.json").write_text(json.dumps(info, indent=2))
    if cfg.export.merge_lora:
        merged_info = weights.export_info(cfg, base, step)
        write_pipeline(out / "merged", base, merged_info, transformer=merged(weights, model, cfg, base))


def lora_layers(model) -> dict[str, torch.Tensor]:
    """peft's `get_peft_model_state_dict(model)` (`blocks.0.attn1.to_q.lora_A.weight`, ...), from the state dict,
    whose names activation checkpointing's wrapper leaves alone (peft's function matches module names, which it
    renames: under toggles.activation_checkpointing it finds no adapter)."""
    from common.lora import peft_state_dict

    prefix = "base_model.model."
    return {k.removeprefix(prefix): v for k, v in peft_state_dict(model.state_dict()).items()}


def merged(weights: ModuleType, model, cfg: TrainConfig, base: Path):
    """The base's transformer with ``model``'s adapter merged in by peft (W + B A alpha/rank; the caller's
    weights are copied), in ``model``'s dtype."""
    from common.lora import merge_into

    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    dtype = next(model.parameters()).dtype
    fresh = merge_into(weights.load_transformer(base), state, cfg.lora)
    return (fresh if dtype == torch.float32 else fresh.to(dtype)).eval()


# ---- scripts/export.py: the export of any checkpoint ------------------------------------------------------
def export_checkpoint(
    weights: ModuleType, cfg: TrainConfig, path: Path, meta: dict, out: Path, *, max_shard_size: str | None
) -> str:
    """The export the end of the run writes, from checkpoint `path` (its EMA transformer, one safetensors shard at a
    time: common/ds_export.py write_ema_module, and the base pipeline's other parts); returns it in words."""
    from common.ds_export import export_ema, write_ema_module

    def write(cfg: TrainConfig, ckpt, out: Path, *, step: int, max_shard_size: int) -> int:
        base = weights.pipeline_folder(cfg.model.init_from)
        model = weights.meta_transformer(base)
        write_pipeline(out, base, weights.export_info(cfg, base, step))
        return write_ema_module(ckpt, model, out / "transformer", "diffusion_pytorch_model.safetensors", max_shard_size)

    return export_ema(cfg, path, meta, out, max_shard_size, write)


def export_lora_checkpoint(
    weights: ModuleType, cfg: TrainConfig, path: Path, meta: dict, out: Path, *, max_shard_size: str | None
) -> str:
    """The export of finetune=lora checkpoint `path`: the adapted transformer built on model.init_from's weights,
    whole in host memory (the merged export needs them, and the adapter is small), the EMA adapter put in, and what
    the end of the run writes (`write_lora_export`); returns it in words."""
    from common.ds_export import export_ema_lora, load_ema_adapter

    def write(cfg: TrainConfig, ckpt, out: Path, *, step: int) -> int:
        base = weights.pipeline_folder(cfg.model.init_from)
        model = adapted_model(weights, cfg, base)
        adapter = load_ema_adapter(model, ckpt)
        write_lora_export(weights, model, cfg, out, base=base, step=step)
        return sum(p.numel() for p in adapter.values())

    return export_ema_lora(cfg, path, meta, out, max_shard_size, write)
