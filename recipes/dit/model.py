"""DiT architecture: diffusers' DiTTransformer2DModel, class-conditional, on pixels or VAE latents."""

from __future__ import annotations

import torch
from diffusers import DiTTransformer2DModel
from diffusers.models.embeddings import LabelEmbedding

from recipes.dit.config import DiTModelConfig


def build_model(cfg: DiTModelConfig, sample_size: int, in_channels: int | None = None) -> DiTTransformer2DModel:
    """A DiT on `in_channels` x `sample_size`^2 inputs (default channels: `cfg.in_channels`) whose label
    table has a null class (index `num_classes`) for classifier-free guidance.

    diffusers gives every block its own label embedding, each dropping labels independently
    in training mode; the trainer drops labels once per sample instead, so the per-block
    dropout is switched off here (the null row stays). With `cfg.shared_conditioning` every block
    uses the first block's timestep + class embedding, as in the DiT paper (Peebles & Xie 2023,
    DiT-XL/2: 675M parameters); the output layer already reads it from the first block.
    """
    in_channels = cfg.in_channels if in_channels is None else in_channels
    model = DiTTransformer2DModel(
        num_attention_heads=cfg.num_attention_heads,
        attention_head_dim=cfg.attention_head_dim,
        in_channels=in_channels,
        out_channels=in_channels,  # the default (None) means the same, but DiTPipeline reads the config's value
        num_layers=cfg.num_layers,
        dropout=cfg.dropout,
        norm_num_groups=cfg.norm_num_groups,
        sample_size=sample_size,
        patch_size=cfg.patch_size,
        num_embeds_ada_norm=cfg.num_classes,
    )
    for module in model.modules():
        if isinstance(module, LabelEmbedding):
            module.dropout_prob = 0.0
    if cfg.shared_conditioning:
        shared = model.transformer_blocks[0].norm1.emb
        for block in model.transformer_blocks[1:]:
            block.norm1.emb = shared
    return model


def shared_conditioning(model: DiTTransformer2DModel):
    """The conditioning embedding every block shares, or None (diffusers' per-block layout)."""
    blocks = model.transformer_blocks
    emb = blocks[0].norm1.emb
    return emb if len(blocks) > 1 and blocks[1].norm1.emb is emb else None


def untied(model: DiTTransformer2DModel) -> DiTTransformer2DModel:
    """`model` in diffusers' own layout (a per-block copy of a shared embedding), as safetensors and
    DiTPipeline want it: the same function, separate tensors. `model` itself if nothing is shared."""
    if shared_conditioning(model) is None:
        return model
    copy = DiTTransformer2DModel.from_config(model.config)
    copy.load_state_dict(model.state_dict())  # every block's keys are in the tied model's state dict
    dtype = next(model.parameters()).dtype
    return (copy if dtype == torch.float32 else copy.to(dtype)).eval()  # save in the dtype it trained in


def null_class(model: DiTTransformer2DModel) -> int:
    return model.config.num_embeds_ada_norm
