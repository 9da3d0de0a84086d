"""VLM architecture: transformers' LlavaForConditionalGeneration, its config (from `model.*` or from the
configs of pretrained parts) and the model built from a config (weights: recipes/vlm/llava.py; attention
kernels: recipes/vlm/attention.py)."""

from __future__ import annotations

from transformers import (
    AutoModelForImageTextToText,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PretrainedConfig,
    SiglipVisionConfig,
)

from recipes.vlm.attention import attn_implementation, register_varlen_attention
from recipes.vlm.schema import TOWER_DEFAULTS, VLMModelConfig


def tower_kind(vision: PretrainedConfig) -> str:
    """clip | siglip: which LLaVA conventions (CLS token, feature defaults) a vision config follows."""
    if isinstance(vision, CLIPVisionConfig):
        return "clip"
    if isinstance(vision, SiglipVisionConfig):
        return "siglip"
    raise TypeError(f"a {type(vision).__name__} is neither a CLIP nor a SigLIP vision tower")


def tower_image_tokens(config: LlavaConfig) -> int:
    """Features the tower + feature choice give per image: patches, plus CLIP's CLS token unless
    `default` drops it. The processor must expand `<image>` to exactly this many tokens."""
    v = config.vision_config
    n = (v.image_size // v.patch_size) ** 2 + (1 if tower_kind(v) == "clip" else 0)
    return n - 1 if config.vision_feature_select_strategy == "default" else n


def feature_choice(m: VLMModelConfig, kind: str) -> tuple[int, str]:
    """(vision_feature_layer, vision_feature_select_strategy): `model.*`, defaulting per tower (TOWER_DEFAULTS)."""
    layer, strategy = TOWER_DEFAULTS[kind]
    return (
        layer if m.vision_feature_layer is None else m.vision_feature_layer,
        strategy if m.vision_feature_select_strategy == "auto" else m.vision_feature_select_strategy,
    )


def assemble_config(
    m: VLMModelConfig, vision: PretrainedConfig, text: PretrainedConfig, *, image_token_id: int
) -> LlavaConfig:
    """vision tower -> 2-layer GELU MLP projector -> language model, LLaVA-1.5's shape."""
    layer, strategy = feature_choice(m, tower_kind(vision))
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        vision_feature_layer=layer,
        vision_feature_select_strategy=strategy,
        projector_hidden_act="gelu",
        pad_token_id=text.pad_token_id,
    )
    config.image_seq_length = tower_image_tokens(config)
    return config


def llava_config(
    m: VLMModelConfig, *, vocab_size: int, image_token_id: int, pad_token_id: int, bos_token_id: int, eos_token_id: int
) -> LlavaConfig:
    """A LLaVA shaped by `model.*` (fresh weights: the digits demo, run.dry_run of the size presets)."""
    vision_cls = SiglipVisionConfig if m.vision == "siglip" else CLIPVisionConfig
    vision = vision_cls(
        hidden_size=m.vision_hidden_size,
        intermediate_size=m.vision_intermediate_size,
        num_hidden_layers=m.vision_layers,
        num_attention_heads=m.vision_heads,
        image_size=m.image_size,
        patch_size=m.vision_patch_size,
        num_channels=3,
    )
    text = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=m.text_hidden_size,
        intermediate_size=m.text_intermediate_size,
        num_hidden_layers=m.text_layers,
        num_attention_heads=m.text_heads,
        num_key_value_heads=m.text_kv_heads,
        max_position_embeddings=m.max_seq_len,
        rope_theta=m.rope_theta,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=False,
    )
    return assemble_config(m, vision, text, image_token_id=image_token_id)


def build_model(config: LlavaConfig, attention: str = "sdpa") -> LlavaForConditionalGeneration:
    if attention == "flash":
        register_varlen_attention()
    return AutoModelForImageTextToText.from_config(config, attn_implementation=attn_implementation(attention))
