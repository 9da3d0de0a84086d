"""The VLM recipe's config sections, `model` (architecture) and `vlm` (training stage, sources, eval): their
schemas (recipes/vlm/schema.py) registered with Hydra, and the composed config validated."""

from __future__ import annotations

from common.config import ZERO_LAYOUTS, TrainConfig, ZeroParallelConfig, check_family_sections, fill_from_checkpoint
from common.errors import ConfigError
from recipes.vlm.archs import QWEN_ARCHS
from recipes.vlm.schema import VLMConfig, VLMDataConfig, VLMModelConfig, check_heads
from recipes.vlm.weights import init_folder, init_model_type, released, released_config, weight_source

# parallel.cp_method (its spec's cp_methods, the default first): Ulysses over the language model
# (recipes/vlm/context_parallel.py), named as the LLM names the same exchange of heads for tokens: the only choice.
CP_METHODS = ("alltoall",)
# finetune=lora (common/lora.py): the language model's linears an adapter may target, all of them by default
# (transformers' Llama names); the projector still trains in full, the vision tower stays frozen.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# The top-level sections only this family has (its spec's `sections`, recipes/registry.py): vlm.* keys.
SECTIONS = {"vlm": VLMConfig}
# Keys this family renamed (its spec's `renamed`): old dotted key -> new. The old spelling still composes, with one
# note, until the next release (scripts/kiln/launch.py rename_overrides; scripts/export.py reads old runs' config.yaml).
RENAMED = {
    "model.max_position_embeddings": "model.max_seq_len",  # the LLM's name for the same length
    "model.patch_size": "model.vision_patch_size",  # the DiT's model.patch_size is a latent patch
}


# The schemas of this family's config groups (its spec's `config.SCHEMAS`): (group, name, dataclass), stored in
# Hydra's ConfigStore by common/compose.py; the group files name them in their defaults (`- vlm_schema`).
SCHEMAS = [
    ("data", "vlm_schema", VLMDataConfig),
    ("model", "vlm_schema", VLMModelConfig),
    ("vlm", "vlm_schema", VLMConfig),
]


# model.* keys a LLaVA's config sets: model key -> (LlavaConfig's section, its name there). With model.init_from
# they come from the checkpoint, as the DiT's and the LLM's model.* keys do from theirs.
CHECKPOINT_KEYS = {
    "image_size": ("vision_config", "image_size"),
    "vision_patch_size": ("vision_config", "patch_size"),
    "vision_hidden_size": ("vision_config", "hidden_size"),
    "vision_layers": ("vision_config", "num_hidden_layers"),
    "vision_heads": ("vision_config", "num_attention_heads"),
    "vision_intermediate_size": ("vision_config", "intermediate_size"),
    "vision_feature_layer": ("", "vision_feature_layer"),
    "vision_feature_select_strategy": ("", "vision_feature_select_strategy"),
    "text_hidden_size": ("text_config", "hidden_size"),
    "text_layers": ("text_config", "num_hidden_layers"),
    "text_heads": ("text_config", "num_attention_heads"),
    "text_kv_heads": ("text_config", "num_key_value_heads"),
    "text_intermediate_size": ("text_config", "intermediate_size"),
    "max_seq_len": ("text_config", "max_position_embeddings"),
    "vocab_size": ("text_config", "vocab_size"),
    "rope_theta": ("text_config", "rope_theta"),
}
# vision_config.model_type -> model.vision (a Qwen-VL's tower is its own: its model_type, qwen2_5_vl / qwen3_vl)
TOWERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip", **{a.tower: t for t, a in QWEN_ARCHS.items()}}


def checkpoint_values(config) -> dict[str, tuple[str, object]]:
    """model key -> (where the LLaVA's or Qwen-VL's config holds it, its value), for the keys the config sets
    (a Qwen-VL's tower has no image_size nor feature choice: native resolution, its merger reads the last block and
    Qwen3-VL's DeepStack mergers the blocks its config names;
    transformers' attribute_map reads depth / num_heads as num_hidden_layers / num_attention_heads)."""
    values = {}
    if (tower := TOWERS.get(config.vision_config.model_type)) is not None:
        values["vision"] = ("vision_config.model_type", tower)
    for key, (section, name) in CHECKPOINT_KEYS.items():
        owner = getattr(config, section) if section else config
        value = getattr(owner, name, None)
        if name == "rope_theta" and value is None:  # transformers 5 keeps it in rope_parameters
            value = (getattr(owner, "rope_parameters", None) or {}).get("rope_theta")
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):  # a list of feature layers: not a key
            values[key] = (f"{section}.{name}" if section else name, value)
    return values


def complete(cfg: TrainConfig, command_line: set[str]) -> None:
    """With model.init_from: the model.* keys from the LLaVA's config, in place (config.yaml and the logs show the
    model that trains); a key given on the command line that disagrees stops the run, as in the DiT and the LLM.
    Otherwise the LLaVA's config is read from its folders when the model is built."""
    m = cfg.model
    if not isinstance(m, VLMModelConfig) or not m.init_from:
        return
    if released(m.init_from):  # a release known by name, sized before its download
        config = released_config(m.init_from)
    else:
        from transformers import AutoConfig  # imported only for init_from runs

        config = AutoConfig.from_pretrained(init_folder(m.init_from)[0], local_files_only=True)
    fill_from_checkpoint(m, checkpoint_values(config), command_line, m.init_from)


def validate(cfg: TrainConfig) -> None:
    m, v = cfg.model, cfg.vlm
    if not isinstance(m, VLMModelConfig) or not isinstance(v, VLMConfig):
        raise ConfigError("recipe.family=vlm needs model=vlm_* and vlm=default config groups")
    qwen = m.vision in QWEN_ARCHS
    if qwen and not (m.init_from and init_model_type(m.init_from) == m.vision):
        raise ConfigError(
            f"model.vision={m.vision} is read from model.init_from=<a {QWEN_ARCHS[m.vision].name} folder>, not chosen"
        )
    if m.vision not in ("siglip", "clip", *QWEN_ARCHS):
        raise ConfigError(f"model.vision={m.vision!r} is not allowed; choose siglip or clip")
    if m.vision_feature_select_strategy not in ("auto", "full", "default"):
        raise ConfigError(
            f"model.vision_feature_select_strategy={m.vision_feature_select_strategy!r}: choose auto, full or default"
        )
    if not qwen and m.image_size % m.vision_patch_size:  # Qwen-VL: native resolution, no image size
        raise ConfigError(
            f"model.image_size={m.image_size} must be a multiple of model.vision_patch_size={m.vision_patch_size}"
        )
    if m.text_heads % m.text_kv_heads or m.text_hidden_size % m.text_heads:
        raise ConfigError("model.text_heads must divide text_hidden_size and be a multiple of model.text_kv_heads")
    if v.stage not in ("align", "finetune"):
        raise ConfigError(f"vlm.stage={v.stage!r} is not allowed; choose align or finetune")
    if v.train_vision and v.stage == "align":
        raise ConfigError("vlm.train_vision=true is for vlm.stage=finetune (align trains the projector only)")
    if not v.train_projector and v.stage == "align":
        raise ConfigError(
            "vlm.train_projector=false with vlm.stage=align leaves nothing to train (align trains the projector only)"
        )
    if cfg.finetune == "lora" and not m.init_from and not cfg.run.dry_run:  # sizing reads no weights
        raise ConfigError(
            "finetune=lora trains an adapter on a LLaVA checkpoint: set model.init_from=<a llava-hf folder or "
            "an align run> (vlm.stage=align from vlm.vision_from + vlm.language_from makes one)"
        )
    if cfg.finetune == "lora" and v.train_vision:
        raise ConfigError(
            "vlm.train_vision=true with finetune=lora: LoRA adapts the language model (the projector trains "
            "in full unless vlm.train_projector=false); the vision tower stays frozen"
        )
    weight_source(cfg)  # json only: one line for sources that contradict each other or a folder that does not fit
    check_family_sections(
        cfg,
        "VLM",
        parallel=ZeroParallelConfig,
        layouts=f"DeepSpeed ZeRO ({ZERO_LAYOUTS})",
        data=VLMDataConfig,
        datasets="vlm_digits or llava (image-conversation shards)",
    )
    check_context_parallel(cfg)
    check_preference(cfg)
    if cfg.data.max_seq_len <= 0:
        raise ConfigError(f"data.max_seq_len={cfg.data.max_seq_len} must be > 0")
    if cfg.data.pack_buffer < 0:
        raise ConfigError(f"data.pack_buffer={cfg.data.pack_buffer} must be >= 0 (0: micro-batches by stream position)")


def check_preference(cfg: TrainConfig) -> None:
    """preference.loss (recipes/vlm/preference.py): one line for what the VLM's pairs do not run with yet."""
    loss = cfg.preference.loss
    if not loss:
        return
    if cfg.preference.reference == "precomputed":
        raise ConfigError(
            "preference.reference=precomputed is not offered by the VLM recipe yet (pairs with images): use "
            "preference.reference=auto (a frozen copy, or under finetune=lora the adapter disabled)"
        )
    if cfg.parallel.cp > 1:
        raise ConfigError(f"preference.loss={loss} does not run with parallel.cp={cfg.parallel.cp} on the VLM yet")


def check_context_parallel(cfg: TrainConfig) -> None:
    """parallel.cp (Ulysses over the language model, recipes/vlm/context_parallel.py): one line for what it cannot
    split. The heads of a language model from vlm.language_from are checked when it is built; cp dividing the ranks
    when the world size is known (common/parallel_dims.py)."""
    from common.data.packing import ROW_ALIGN

    cp = cfg.parallel.cp
    if cp == 1:
        return
    check_heads(cp, cfg.model.text_heads, cfg.model.text_kv_heads, "model.text_heads, model.text_kv_heads")
    if cfg.data.max_seq_len % cp or ROW_ALIGN % cp:
        raise ConfigError(
            f"parallel.cp={cp} must divide data.max_seq_len={cfg.data.max_seq_len} and {ROW_ALIGN}: every packed row "
            f"(data.max_seq_len tokens or fewer, a multiple of {ROW_ALIGN}) is split over the cp ranks"
        )
    if not cfg.data.packing:
        raise ConfigError(
            f"parallel.cp={cp} with data.packing=false: rows padded to their longest sample have lengths cp may not "
            "divide; use data.packing=true"
        )
    if cfg.toggles.attention == "eager":
        raise ConfigError(
            f"toggles.attention=eager with parallel.cp={cp}: the VLM's Ulysses attention wraps a registered kernel "
            "(sdpa with the packed rows' 4D mask, or flash with their cu_seqlens); use toggles.attention=sdpa or flash"
        )
