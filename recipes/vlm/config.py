"""Schemas of the VLM recipe's own config sections: `model` (architecture) and `vlm` (training stage, eval)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hydra.core.config_store import ConfigStore

from common.config import DataConfig, TrainConfig, ZeroParallelConfig
from common.errors import ConfigError


@dataclass
class VLMModelConfig:
    """A LLaVA: vision tower (SigLIP or CLIP) -> MLP projector -> Llama language model."""

    vision: str = "siglip"  # siglip | clip
    image_size: int = 16
    patch_size: int = 4
    vision_hidden_size: int = 64
    vision_layers: int = 2
    vision_heads: int = 4
    vision_intermediate_size: int = 128
    # Which tower output feeds the projector. null / auto: LLaVA's default for the tower (TOWER_DEFAULTS):
    # CLIP the penultimate layer without its CLS token, SigLIP the last layer (it has no CLS token).
    vision_feature_layer: Optional[int] = None
    vision_feature_select_strategy: str = "auto"  # auto | full | default (default drops the first token: CLIP's CLS)
    text_hidden_size: int = 128
    text_layers: int = 2
    text_heads: int = 4
    text_kv_heads: int = 2
    text_intermediate_size: int = 256
    max_position_embeddings: int = 512
    vocab_size: int = 0  # 0: the size of the data's tokenizer
    rope_theta: float = 10000.0


# LLaVA's feature choice per tower: (vision_feature_layer, vision_feature_select_strategy).
TOWER_DEFAULTS = {"clip": (-2, "default"), "siglip": (-1, "full")}


@dataclass
class VLMConfig:
    stage: str = "finetune"  # align: projector only | finetune: projector + language model
    # Where the weights come from (all empty: fresh weights shaped by `model.*`, the digits demo):
    init_from: str = ""  # a LLaVA to continue from: an align run (dir or export) or a llava-hf folder
    vision_from: str = ""  # a CLIP / SigLIP folder (vision model or the whole dual encoder) + its image processor
    language_from: str = ""  # a *ForCausalLM folder (Llama family) + its tokenizer
    train_vision: bool = False  # finetune: train the vision tower too (LLaVA keeps it frozen)
    eval_samples: int = 200  # held-out images answered at the end
    max_new_tokens: int = 12


@dataclass
class VLMDataConfig(DataConfig):
    """Image-conversation shards (configs/data/vlm_digits|llava): rows of up to max_seq_len tokens."""

    packing: bool = True  # pack conversations into rows of max_seq_len (no attention across them)
    max_seq_len: int = 256


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
    if bool(v.vision_from) != bool(v.language_from):
        raise ConfigError("vlm.vision_from and vlm.language_from go together: a LLaVA is built from both parts")
    if v.init_from and v.vision_from:
        raise ConfigError("vlm.init_from and vlm.vision_from/language_from exclude each other: continue from a LLaVA, "
                          "or build one from pretrained parts")
    if v.init_from and v.stage == "align":
        raise ConfigError("vlm.init_from is for vlm.stage=finetune (align starts from vlm.vision_from + vlm.language_from, "
                          "or from fresh weights)")
    if v.train_vision and v.stage == "align":
        raise ConfigError("vlm.train_vision=true is for vlm.stage=finetune (align trains the projector only)")
    if v.init_from or v.vision_from:
        from recipes.vlm.pretrained import check_sources

        check_sources(v)
    if not isinstance(cfg.parallel, ZeroParallelConfig):
        raise ConfigError("the VLM recipe shards with DeepSpeed ZeRO data parallelism only (parallel=single|zero1|zero2|"
                          "zero3: parallel.dp, parallel.zero_stage)")
    if not isinstance(cfg.data, VLMDataConfig):
        raise ConfigError(f"data={cfg.data.name} is not an image-conversation dataset; the VLM reads data=vlm_digits or llava")
    if cfg.data.max_seq_len <= 0:
        raise ConfigError(f"data.max_seq_len={cfg.data.max_seq_len} must be > 0")
