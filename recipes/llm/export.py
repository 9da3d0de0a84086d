"""An LLM run's export/ rebuilt from any of its DCP checkpoints (scripts/export.py), under any parallel layout: the
folder the end of the run writes (LLMTrainer.export), through the same writer (write_export below).

DCP loads every shard of the checkpoint into one whole model in this process (no process group). A run that started
from model.init_from is exported in that checkpoint's format (its config.json, generation_config.json, tokenizer and
chat template, in its weights' dtype); a finetune=lora run's checkpoints hold the adapter only: the base comes from
model.init_from, loaded whole in host memory as the trainer loads it.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from common import lora
from common.config import TrainConfig
from common.errors import UserError
from recipes.llm import lora as llm_lora
from recipes.llm import weights
from recipes.llm.config import LLMModelConfig
from recipes.llm.data import load_tokenizer
from recipes.llm.model import LlamaArgs
from recipes.llm.sizing import llama_args


def _model_args(cfg, path: Path, max_shard_size: str | None):
    """(LlamaArgs, tokenizer) of the run, after the refusals every LLM export shares."""
    if max_shard_size is not None:
        raise UserError("--max-shard-size is for DiT/VLM runs (an LLM export is written by transformers)")
    if not (path / "dcp").exists():
        raise UserError(f"{path} is not a complete DCP checkpoint (no dcp/)")
    # Runs from before model.init_from and friends existed get those keys' defaults.
    cfg.model = OmegaConf.merge(OmegaConf.structured(LLMModelConfig), cfg.model)
    source = cfg.model.init_from or None
    if source and not Path(source).is_dir():
        raise UserError(
            f"the run started from model.init_from={source}, which is gone (its config and tokenizer go "
            "into the export)"
        )
    tokenizer = weights.load_tokenizer(source) if source else load_tokenizer(cfg.data.root)
    return llama_args(cfg, len(tokenizer)), tokenizer


def export_checkpoint(cfg, path: Path, meta: dict, out: Path, *, max_shard_size: str | None) -> str:
    """Write the Hugging Face folder of DCP checkpoint `path` to `out`; returns what was written, in words."""
    from recipes.llm.model import Transformer

    args, tokenizer = _model_args(cfg, path, max_shard_size)
    model = Transformer(args)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path / "dcp"))  # no process group: loads every shard here
    write_export(state["model"], args, cfg, out, tokenizer=tokenizer)
    return f"{sum(p.numel() for p in model.parameters()):,} parameters"


def lora_base(cfg) -> str:
    """The folder a finetune=lora export loads its base from: model.init_from's checkpoint."""
    return cfg.model.init_from


def export_lora_checkpoint(cfg, path: Path, meta: dict, out: Path, *, max_shard_size: str | None) -> str:
    """Write the PEFT adapter folder of finetune=lora checkpoint `path` on model.init_from to `out` (with
    export.merge_lora the merged model in out/merged); returns what was written, in words."""
    from common.lora import is_adapter_key
    from recipes.llm import lora

    args, tokenizer = _model_args(cfg, path, max_shard_size)
    model = lora.adapted_model(args, cfg)  # the base from model.init_from
    adapter = {k: v for k, v in model.state_dict().items() if is_adapter_key(k)}
    dcp.load({"model": adapter}, checkpoint_id=str(path / "dcp"))  # in place: the model's own tensors
    write_export(model.state_dict(), args, cfg, out, tokenizer=tokenizer)  # dequantized there (QLoRA's base)
    return f"a LoRA adapter of {sum(v.numel() for v in adapter.values()):,} parameters on {cfg.model.init_from}"


def write_export(state: dict, args: LlamaArgs, cfg: TrainConfig, folder: Path, *, tokenizer) -> None:
    """The export folder of a whole model's weights (a full state dict on the host): a Hugging Face folder, with
    model.init_from in the source's format (recipes/llm/weights.py:write_hf_folder); under LoRA a PEFT adapter folder on
    model.init_from (recipes/llm/lora.py). The end of a run and scripts/export.py (recipes/llm/export.py) both write
    through it."""
    if cfg.finetune == "lora":
        llm_lora.write_export(lora.dequantized(state), args, cfg, folder, tokenizer=tokenizer)
    else:
        weights.write_hf_folder(state, args, folder, tokenizer=tokenizer, source=cfg.model.init_from or None)
    write_formats(cfg, folder)


def write_formats(cfg, folder: Path) -> None:
    """export.formats from the Hugging Face folder just written: gguf, folder/gguf/ (a GGUF file and an ollama
    Modelfile, recipes/llm/gguf_export.py) of the model; under finetune=lora of the merged model (folder/merged) with
    export.merge_lora; else of the base (model.init_from), the adapter (the PEFT folder) beside it as a GGUF LoRA."""
    if "gguf" not in cfg.export.formats:
        return
    from recipes.llm.config import check_gguf_export
    from recipes.llm.gguf_export import write_gguf

    check_gguf_export(cfg)  # a run composed before the key existed, or scripts/export.py --format gguf
    if cfg.finetune == "lora" and not cfg.export.merge_lora:
        base = Path(cfg.model.init_from).expanduser()
        write_gguf(base, folder / "gguf", cfg.export.gguf_type, adapter=folder)
        return
    source = folder / "merged" if cfg.finetune == "lora" else folder
    write_gguf(source, folder / "gguf", cfg.export.gguf_type)
