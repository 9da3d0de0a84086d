"""The VLM recipe's config sections, `model` (architecture) and `vlm` (training stage, sources, eval): their
schemas (recipes/vlm/schema.py) registered with Hydra, and the composed config validated."""

from __future__ import annotations

import os

from hydra.core.config_store import ConfigStore

from common.config import ZERO_LAYOUTS, TrainConfig, ZeroParallelConfig, check_family_sections
from common.errors import ConfigError
from recipes.vlm.schema import VLMConfig, VLMDataConfig, VLMModelConfig
from recipes.vlm.sources import weight_source

# finetune=lora (common/lora.py): the language model's linears an adapter may target, all of them by default
# (transformers' Llama names); the projector still trains in full, the vision tower stays frozen.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(group="data", name="vlm_schema", node=VLMDataConfig)
    cs.store(group="model", name="vlm_schema", node=VLMModelConfig)
    cs.store(group="vlm", name="vlm_schema", node=VLMConfig)


def complete(cfg: TrainConfig, command_line: set[str]) -> None:
    """Nothing to fill from files here: the LLaVA's config is read from its folders when the model is built."""


def validate(cfg: TrainConfig) -> None:
    m, v = cfg.model, cfg.vlm
    if not isinstance(m, VLMModelConfig) or not isinstance(v, VLMConfig):
        raise ConfigError("recipe.family=vlm needs model=vlm_* and vlm=default config groups")
    if m.vision not in ("siglip", "clip"):
        raise ConfigError(f"model.vision={m.vision!r} is not allowed; choose siglip or clip")
    if m.vision_feature_select_strategy not in ("auto", "full", "default"):
        raise ConfigError(f"model.vision_feature_select_strategy={m.vision_feature_select_strategy!r}: choose auto, full or default")
    if m.image_size % m.patch_size:
        raise ConfigError(f"model.image_size={m.image_size} must be a multiple of model.patch_size={m.patch_size}")
    if m.text_heads % m.text_kv_heads or m.text_hidden_size % m.text_heads:
        raise ConfigError("model.text_heads must divide text_hidden_size and be a multiple of model.text_kv_heads")
    if v.stage not in ("align", "finetune"):
        raise ConfigError(f"vlm.stage={v.stage!r} is not allowed; choose align or finetune")
    if v.train_vision and v.stage == "align":
        raise ConfigError("vlm.train_vision=true is for vlm.stage=finetune (align trains the projector only)")
    rename_init_from(m, v)
    if cfg.finetune == "lora" and not m.init_from and not cfg.run.dry_run:  # sizing reads no weights
        raise ConfigError("finetune=lora trains an adapter on a LLaVA checkpoint: set model.init_from=<a llava-hf folder or "
                          "an align run> (vlm.stage=align from vlm.vision_from + vlm.language_from makes one)")
    if cfg.finetune == "lora" and v.train_vision:
        raise ConfigError("vlm.train_vision=true with finetune=lora: LoRA adapts the language model (the projector trains "
                          "in full); the vision tower stays frozen")
    weight_source(cfg)  # json only: one line for sources that contradict each other or a folder that does not fit
    check_family_sections(cfg, "VLM", parallel=ZeroParallelConfig, layouts=f"DeepSpeed ZeRO ({ZERO_LAYOUTS})",
                          data=VLMDataConfig, datasets="vlm_digits or llava (image-conversation shards)")
    if cfg.data.max_seq_len <= 0:
        raise ConfigError(f"data.max_seq_len={cfg.data.max_seq_len} must be > 0")


def rename_init_from(m: VLMModelConfig, v: VLMConfig) -> None:
    """vlm.init_from is model.init_from's old name (the LLM's spelling): it is moved there, with one line on
    rank 0, until the next release."""
    if not v.init_from:
        return
    if m.init_from and m.init_from != v.init_from:
        raise ConfigError(f"vlm.init_from={v.init_from} and model.init_from={m.init_from} disagree: vlm.init_from is the "
                          "old name of model.init_from; give model.init_from only")
    m.init_from, v.init_from = v.init_from, ""
    if os.environ.get("RANK", "0") == "0":
        print("kiln: vlm.init_from is now model.init_from (the old key works until the next release)", flush=True)
