"""Qwen2.5-VL's vision side for the memory model (run.dry_run, scripts/plan.py; the language model is sized as
LLaVA's: recipes/vlm/train.py memory_spec): image tokens from the pixel budget, the tower's blocks over every patch
of the micro-batch, and the merger.

The budget bounds everything: the image processor resizes each image to at most data.max_pixels (a multiple of
28 x 28 px), so an image is at most max_pixels / 28^2 language-model tokens and 4x as many 14-px patches, which the
tower's blocks run over before the merger joins 2x2 of them into one token. A sample holds as many whole images as
data.max_seq_len has room for (a longer one is cut before an image, one whose images alone do not fit is skipped:
recipes/vlm/qwen.py), so the worst micro-batch is micro_batch samples of that many largest images. The tower's
windowed blocks attend within 112-px windows (8 x 8 patches), its full-attention blocks (fullatt_block_indexes)
over each whole image: the same bytes for fused kernels (linear in the tokens), different s^2 for eager ones."""

from __future__ import annotations

from common.errors import ConfigError
from common.memory import Block, LayerType, count_params


def vision_block(v, attention: str) -> Block:
    """A Qwen2_5_VLVisionBlock: RMSNorm, one fused qkv projection (with bias), 2D RoPE on q and k in fp32, attention
    per image or window, a SwiGLU MLP (with bias). `attention`: the tower's kernel (eager under toggles.attention=
    eager; SDPA or the varlen kernel otherwise, which keep no scores)."""
    return Block(
        hidden=v.hidden_size,
        heads=v.num_heads,
        ffn=v.intermediate_size,
        norm="rmsnorm",
        mlp="swiglu",
        dropout=False,
        attention="eager" if attention == "eager" else "fused",
        fused_qkv=True,
        chunked_attention=attention != "flash",
    )


def image_budget(v, max_pixels: int, max_seq_len: int) -> tuple[int, int]:
    """(language-model tokens of the largest image, whole such images a sample of max_seq_len tokens holds)."""
    unit = v.patch_size * v.spatial_merge_size  # one merged token's side in pixels: 28
    tokens = max_pixels // unit**2
    images = max_seq_len // tokens
    if not images:
        raise ConfigError(
            f"data.max_pixels={max_pixels} makes images of up to {tokens} tokens, more than data.max_seq_len="
            f"{max_seq_len}: every sample with such an image would be skipped; raise data.max_seq_len or lower "
            "data.max_pixels"
        )
    return tokens, images


def qwen_vision(model, cfg, max_pixels: int, act_bytes: int) -> tuple[list[LayerType], float, str]:
    """(the tower's layer types, empty when it is frozen: without gradients it keeps nothing; the merger's bytes
    kept for backward; the note's sentence on the images) for the worst micro-batch of `cfg` (module docstring)."""
    visual = model.model.visual
    v, e = model.config.vision_config, act_bytes
    tokens, images = image_budget(v, max_pixels, cfg.data.max_seq_len)
    merge = v.spatial_merge_size**2
    per_image = tokens * merge  # patches
    n_images = cfg.trainer.micro_batch_size * images
    patches = n_images * per_image
    window = min((v.window_size // v.patch_size) ** 2, per_image)
    trains = any(p.requires_grad for p in visual.blocks.parameters())
    types = []
    if trains:
        block = vision_block(v, cfg.toggles.attention)
        params = count_params(visual.blocks[0], trainable_only=True)
        full = len(set(v.fullatt_block_indexes))
        types = [
            LayerType(block, v.depth - full, params, seq=window, batch=patches // window),
            LayerType(block, full, params, seq=per_image, batch=n_images),
        ]
    # The merger (trained in every stage): its RMSNorm over each patch keeps the normalized patches (for its weight)
    # and, where the tower trains, its input in fp32 (the tower's output, or its fp32 copy) and 1/rms; its first
    # Linear keeps the norm's output, GELU its input, the second Linear GELU's output (4 x h wide over a quarter of
    # the patches: h per patch each). A trained tower also keeps its RoPE cos and sin (fp32, head_dim per patch
    # each), which all its blocks share. (Measured against autograd: tests/unit/test_vlm_sizing.py.)
    ph = patches * v.hidden_size
    rope = 2 * 4 * patches * (v.hidden_size // v.num_heads)
    merger = 4 * e * ph + ((4 * ph + 4 * patches + rope) if trains else 0)
    note = (
        f"images: at most {tokens} tokens each (data.max_pixels={max_pixels:,} / 28^2), {images} whole such images "
        f"a sample (data.max_seq_len={cfg.data.max_seq_len}), {patches:,} patches a micro-batch through the tower "
        f"({v.depth} blocks: {v.depth - len(set(v.fullatt_block_indexes))} in {window}-patch windows, "
        f"{len(set(v.fullatt_block_indexes))} over whole images), "
        + ("trained (vlm.train_vision)" if trains else "frozen: it keeps nothing for backward")
    )
    return types, merger, note
