"""VLM architecture: transformers' LlavaForConditionalGeneration built from configs (no hub)."""

from __future__ import annotations

from transformers import AutoModelForImageTextToText, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, SiglipVisionConfig

from recipes.vlm.config import VLMModelConfig

ATTN_IMPLEMENTATION = {"sdpa": "sdpa", "eager": "eager", "flash": "flash_attention_2"}


def llava_config(m: VLMModelConfig, *, vocab_size: int, image_token_id: int, pad_token_id: int,
                 bos_token_id: int, eos_token_id: int) -> LlavaConfig:
    vision_cls = SiglipVisionConfig if m.vision == "siglip" else CLIPVisionConfig
    vision = vision_cls(
        hidden_size=m.vision_hidden_size,
        intermediate_size=m.vision_intermediate_size,
        num_hidden_layers=m.vision_layers,
        num_attention_heads=m.vision_heads,
        image_size=m.image_size,
        patch_size=m.patch_size,
        num_channels=3,
    )
    text = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=m.text_hidden_size,
        intermediate_size=m.text_intermediate_size,
        num_hidden_layers=m.text_layers,
        num_attention_heads=m.text_heads,
        num_key_value_heads=m.text_kv_heads,
        max_position_embeddings=m.max_position_embeddings,
        rope_theta=m.rope_theta,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=False,
    )
    tokens_per_image = (m.image_size // m.patch_size) ** 2
    if m.vision == "clip" and m.vision_feature_select_strategy == "full":
        tokens_per_image += 1  # CLIP's CLS token is kept
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        image_seq_length=tokens_per_image,
        vision_feature_layer=m.vision_feature_layer,
        vision_feature_select_strategy=m.vision_feature_select_strategy,
        projector_hidden_act="gelu",
        pad_token_id=pad_token_id,
    )


def build_model(config: LlavaConfig, attention: str = "sdpa") -> LlavaForConditionalGeneration:
    return AutoModelForImageTextToText.from_config(config, attn_implementation=ATTN_IMPLEMENTATION[attention])
