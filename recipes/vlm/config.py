"""Schemas of the VLM recipe's own config sections: `model` (architecture) and `vlm` (training stage, eval)."""

from __future__ import annotations

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

from common.config import TrainConfig
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
    vision_feature_layer: int = -1
    vision_feature_select_strategy: str = "full"  # full | default (default drops CLIP's CLS token)
    text_hidden_size: int = 128
    text_layers: int = 2
    text_heads: int = 4
    text_kv_heads: int = 2
    text_intermediate_size: int = 256
    max_position_embeddings: int = 512
    vocab_size: int = 0  # 0: the size of the data's tokenizer
    rope_theta: float = 10000.0


@dataclass
class VLMConfig:
    stage: str = "finetune"  # align: projector only | finetune: projector + language model
    init_from: str = ""  # finetune: an align run dir or checkpoint to start from ("" = fresh weights)
    eval_samples: int = 200  # held-out images answered at the end
    max_new_tokens: int = 12


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(group="model", name="vlm_schema", node=VLMModelConfig)
    cs.store(group="vlm", name="vlm_schema", node=VLMConfig)


def validate(cfg: TrainConfig) -> None:
    m, v = cfg.model, cfg.vlm
    if not isinstance(m, VLMModelConfig) or not isinstance(v, VLMConfig):
        raise ConfigError("recipe.family=vlm needs model=vlm_* and vlm=default config groups")
    if m.vision not in ("siglip", "clip"):
        raise ConfigError(f"model.vision={m.vision!r} is not allowed; choose siglip or clip")
    if m.vision_feature_select_strategy not in ("full", "default"):
        raise ConfigError(f"model.vision_feature_select_strategy={m.vision_feature_select_strategy!r}: choose full or default")
    if m.image_size % m.patch_size:
        raise ConfigError(f"model.image_size={m.image_size} must be a multiple of model.patch_size={m.patch_size}")
    if m.text_heads % m.text_kv_heads or m.text_hidden_size % m.text_heads:
        raise ConfigError("model.text_heads must divide text_hidden_size and be a multiple of model.text_kv_heads")
    if v.stage not in ("align", "finetune"):
        raise ConfigError(f"vlm.stage={v.stage!r} is not allowed; choose align or finetune")
    if v.init_from and v.stage == "align":
        raise ConfigError("vlm.init_from is for vlm.stage=finetune (align starts from fresh weights)")
    if cfg.parallel.tp != 1 or cfg.parallel.pp != 1:
        raise ConfigError(f"parallel.tp={cfg.parallel.tp} parallel.pp={cfg.parallel.pp}: the VLM recipe shards with ZeRO data parallelism only (tp=pp=1)")
