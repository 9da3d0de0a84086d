"""parallel.cp for the VLM: Ulysses (common/ulysses.py) over the language model of a LLaVA or a Qwen-VL (2.5, 3).

The cp ranks of a data-parallel group read the same packed rows. The vision tower and the projector (Qwen's merger)
run whole on every one of them (a row's images are few, and their features must land in whichever rank's tokens hold
the image placeholders); the merged embedding sequence (text + image features) is then split, each rank keeping a
contiguous 1/cp of every row's tokens and their position_ids (split on their last axis: a LLaVA's [R, L], Qwen's mRoPE
[3, R, L], or [1, R*L] / [4, 1, R*L] for the flattened row of toggles.attention=flash) through the decoder layers.
Qwen3-VL's DeepStack adds more of the tower's features (intermediate blocks', merged) to the first decoder layers'
hidden states at the image and video tokens: transformers hands the language model a mask of those tokens over the
whole rows (visual_pos_masks) and one feature row per masked token in row-major order; each rank keeps the mask's
columns and the feature rows of its own tokens. Attention exchanges heads for tokens (DeepSpeed's all-to-all): each
rank then holds the whole row with heads/cp heads, and runs the language model's own registered kernel on it: SDPA
with the row's 4D document + causal mask, or the varlen kernel (recipes/vlm/attention.py) with the batch's cu_seqlens.
Both are whole-row metadata that reach the kernel as they are (only the embeddings, positions and DeepStack inputs are
split), so no token attends across documents. The LM head runs on the rank's tokens and its logits are gathered
(common/ulysses.py gather_tokens, whose backward keeps the rank's rows): the loss is then transformers' own, computed
whole and identically on every cp rank, and each rank's weights receive its own tokens' share, which DeepSpeed sums
over cp.

Training only: in eval mode (generation, padded evaluation) nothing is split and attention is the plain kernel.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from common.errors import ConfigError
from common.parallel_dims import CPGroups
from common.ulysses import gather_tokens, shard_tokens, ulysses_kernel
from recipes.vlm.schema import check_heads

ULYSSES_PREFIX = "kiln_ulysses_"  # + the language model's own implementation (transformers' name for it)


def ulysses_attention(group, inner: str):
    """A transformers attention function that wraps the registered one named `inner` (the language model's own) in
    Ulysses' all-to-all (common/ulysses.py ulysses_kernel): q, k, v arrive as this rank's (B, H, S/cp, D) tokens
    (transformers' layout) and the wrapped function sees (B, H/cp, S, D) with the whole row's mask or cu_seqlens. In
    eval mode it is the wrapped function itself (nothing is split)."""
    exchange = ulysses_kernel(lambda q, k, v, kernel: kernel(q, k, v), group)

    def attend(module, query, key, value, attention_mask, **kwargs):
        wrapped = ALL_ATTENTION_FUNCTIONS[inner]
        if not module.training:
            return wrapped(module, query, key, value, attention_mask, **kwargs)

        def kernel(q, k, v):  # (B, S, H/cp, D) -> (B, S, H/cp, D), the layout ulysses_kernel exchanges
            out, _ = wrapped(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attention_mask, **kwargs)
            return out

        out = exchange(*(t.transpose(1, 2) for t in (query, key, value)), kernel)
        return out, None  # (B, S/cp, H, D), as transformers' attention functions return it

    return attend


def splittable_types() -> tuple[type, ...]:
    """The models whose language model this module splits: transformers' LLaVA, Qwen2.5-VL and Qwen3-VL, whose
    language model sits at `model.model.language_model` under `model.lm_head` and takes the merged embeddings with
    their position_ids (and Qwen3-VL's DeepStack features with their mask: `shard_deepstack`)."""
    from transformers import (
        LlavaForConditionalGeneration,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
    )

    return LlavaForConditionalGeneration, Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration


def shard_deepstack(mask: torch.Tensor, features: list[torch.Tensor], cp: int, rank: int):
    """Qwen3-VL's DeepStack inputs for this cp rank's tokens: `mask` [R, L] (or [1, R*L], flash's flattened row) marks
    the image and video tokens of the whole rows, and each of `features` (one per DeepStack layer) holds one row per
    marked token, in the mask's row-major order (transformers' Qwen3VLModel.forward). The rank's tokens are those
    shard_tokens gives it: its part of the mask, and the feature rows of the marked tokens in it, in the same order.
    The features' backward then puts the rank's gradient in its rows and zeros elsewhere; the tower and mergers before
    them (whole on every rank) get the rank's share, which DeepSpeed sums over cp as it does the merged embeddings'."""
    row = (mask.flatten().cumsum(0) - 1).view_as(mask)  # at each marked token: its feature row
    mine = shard_tokens(mask, cp, rank)
    rows = shard_tokens(row, cp, rank)[mine]  # one host sync (a boolean index), then plain gathers
    return mine, [f[rows] for f in features]


def split_language_model(model: torch.nn.Module, cp: CPGroups) -> None:
    """`model`'s (a LLaVA, a Qwen2.5-VL or a Qwen3-VL: splittable_types) language model split over the cp ranks
    (module docstring)."""
    if not isinstance(model, splittable_types()):
        raise ConfigError(
            f"parallel.cp={cp.cp}: context parallelism splits the language model of a LLaVA, a Qwen2.5-VL or a "
            f"Qwen3-VL, not of a {type(model).__name__}"
        )
    text = model.config.text_config
    check_heads(cp.cp, text.num_attention_heads, text.num_key_value_heads, "the language model's config")
    inner = text._attn_implementation
    if inner not in ALL_ATTENTION_FUNCTIONS:  # eager is each model's own function, not a registered one
        raise ConfigError(
            f"parallel.cp={cp.cp} wraps a registered attention kernel (toggles.attention=sdpa or flash), not {inner!r}"
        )
    name = ULYSSES_PREFIX + inner
    AttentionInterface.register(name, ulysses_attention(cp.cp_group, inner))
    if inner in ALL_MASK_ATTENTION_FUNCTIONS:  # the masks the wrapped kernel takes (none for the varlen one)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    model.set_attn_implementation({"text_config": name})

    def split(module, args, kwargs):
        if not module.training:
            return None
        if kwargs.get("position_ids") is None or kwargs.get("inputs_embeds") is None:
            raise ValueError("the cp-split language model takes packed rows: inputs_embeds and position_ids")
        kwargs["inputs_embeds"] = shard_tokens(kwargs["inputs_embeds"], cp.cp, cp.cp_rank)
        kwargs["position_ids"] = shard_tokens(kwargs["position_ids"], cp.cp, cp.cp_rank, dim=-1)  # tokens: last
        if kwargs.get("visual_pos_masks") is not None:  # Qwen3-VL's DeepStack, on a batch with images or videos
            kwargs["visual_pos_masks"], kwargs["deepstack_visual_embeds"] = shard_deepstack(
                kwargs["visual_pos_masks"], kwargs["deepstack_visual_embeds"], cp.cp, cp.cp_rank
            )
        return args, kwargs

    model.model.language_model.register_forward_pre_hook(split, with_kwargs=True)
    model.lm_head.register_forward_hook(lambda m, _args, out: gather_tokens(out, cp.cp_group) if m.training else out)
