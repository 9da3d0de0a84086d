"""DiT architecture: diffusers' DiTTransformer2DModel, class-conditional, in pixel space."""

from __future__ import annotations

from diffusers import DiTTransformer2DModel
from diffusers.models.embeddings import LabelEmbedding

from recipes.dit.config import DiTModelConfig


def build_model(cfg: DiTModelConfig, image_size: int) -> DiTTransformer2DModel:
    """A DiT whose label table has a null class (index `num_classes`) for classifier-free guidance.

    diffusers gives every block its own label embedding, each dropping labels independently
    in training mode; the trainer drops labels once per sample instead, so the per-block
    dropout is switched off here (the null row stays).
    """
    model = DiTTransformer2DModel(
        num_attention_heads=cfg.num_attention_heads,
        attention_head_dim=cfg.attention_head_dim,
        in_channels=cfg.in_channels,
        num_layers=cfg.num_layers,
        dropout=cfg.dropout,
        norm_num_groups=cfg.norm_num_groups,
        sample_size=image_size,
        patch_size=cfg.patch_size,
        num_embeds_ada_norm=cfg.num_classes,
    )
    for module in model.modules():
        if isinstance(module, LabelEmbedding):
            module.dropout_prob = 0.0
    return model


def null_class(model: DiTTransformer2DModel) -> int:
    return model.config.num_embeds_ada_norm
