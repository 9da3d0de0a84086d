"""A Qwen-VL's vision side for the memory model (run.dry_run, scripts/plan.py; the language model is sized as
LLaVA's: memory_spec below): image tokens from the pixel budget, the tower's blocks over every patch
of the micro-batch, and the merger(s). Qwen2.5-VL and Qwen3-VL take one path: what differs is the QwenArch row's
tower_norm / tower_mlp (recipes/vlm/archs.py) and what the vision config says (windows, DeepStack, learned position
embeddings).

The budget bounds everything: the image processor resizes each image to at most data.max_pixels (a multiple of
unit x unit px, the merged token's side: 28 for Qwen2.5-VL's 14-px patches, 32 for Qwen3-VL's 16-px ones), so an
image is at most max_pixels / unit^2 language-model tokens and 4x as many patches, which the tower's blocks run over
before the merger joins 2x2 of them into one token. A sample holds as many whole images as data.max_seq_len has room
for (a longer one is cut before an image, one whose images alone do not fit is skipped: recipes/vlm/qwen.py), so the
worst micro-batch is micro_batch samples of that many largest images. Qwen2.5-VL's windowed blocks attend within
112-px windows (8 x 8 patches), its full-attention blocks (fullatt_block_indexes) over each whole image; Qwen3-VL has
no windows: every block attends over whole images. The same bytes for fused kernels (linear in the tokens), different
s^2 for eager ones. Videos are not counted: the worst micro-batch is taken to be images."""

from __future__ import annotations

import torch

from common.config import TrainConfig
from common.errors import ConfigError
from common.memory import (
    Block,
    LayerType,
    ModelSpec,
    count_params,
    largest_module_params,
    largest_trainable,
    preference_reference,
)
from recipes.vlm.archs import QWEN_ARCHS, QwenArch
from recipes.vlm.model import build_model
from recipes.vlm.parallelize import trainable_parts
from recipes.vlm.weights import QwenWeights, weight_source

# Qwen3-VL's learned position embeddings are resampled to each image's grid bilinearly (Qwen3VLVisionModel's
# interpolation_mode): each patch sums 4 table rows, weighted.
POSITION_TAPS = 4


def vision_block(v, arch: QwenArch, attention: str) -> Block:
    """A Qwen-VL vision block (Qwen2_5_VLVisionBlock, Qwen3VLVisionBlock): a norm (arch.tower_norm: Qwen2.5-VL's
    RMSNorm, Qwen3-VL's LayerNorm), one fused qkv projection (with bias), 2D RoPE on q and k in fp32, attention per
    image or window, an MLP with bias (arch.tower_mlp: Qwen2.5-VL's SwiGLU, Qwen3-VL's fc1 -> GELU -> fc2).
    `attention`: the tower's kernel (eager under toggles.attention=eager; SDPA or the varlen kernel otherwise, which
    keep no scores)."""
    return Block(
        hidden=v.hidden_size,
        heads=v.num_heads,
        ffn=v.intermediate_size,
        norm=arch.tower_norm,
        mlp=arch.tower_mlp,
        dropout=False,
        attention="eager" if attention == "eager" else "fused",
        fused_qkv=True,
        chunked_attention=attention != "flash",
    )


def image_budget(v, max_pixels: int, max_seq_len: int) -> tuple[int, int]:
    """(language-model tokens of the largest image, whole such images a sample of max_seq_len tokens holds)."""
    unit = v.patch_size * v.spatial_merge_size  # one merged token's side in pixels: 28 or 32
    tokens = max_pixels // unit**2
    images = max_seq_len // tokens
    if not images:
        raise ConfigError(
            f"data.max_pixels={max_pixels} makes images of up to {tokens} tokens, more than data.max_seq_len="
            f"{max_seq_len}: every sample with such an image would be skipped; raise data.max_seq_len or lower "
            "data.max_pixels"
        )
    return tokens, images


def merger_bytes(norm: str, ph: int, rows: int, e: int, *, input_grad: bool, input_kept: bool = False) -> float:
    """Bytes a patch merger (a norm, then Linear -> GELU -> Linear over 2x2 patches) keeps for backward when it
    trains: its first Linear keeps the norm's output, GELU its input, the second Linear GELU's output (4 x h wide over
    a quarter of the patches: h per patch each; `ph` = patches x h). `rows`: the norm's rows (every patch for a norm
    before the 2x2 shuffle, a quarter of them after it: DeepStack's). An RMSNorm keeps the normalized patches (for its
    weight) and, where its input needs a gradient (`input_grad`: the tower trains), its input in fp32 (the tower's
    output, or its fp32 copy) and 1/rms; a LayerNorm keeps its input and its fp32 mean and 1/std per row whatever
    needs a gradient, the input counted here unless something else keeps it already (`input_kept`: a DeepStack
    merger's input is the next block's, which a trained tower keeps)."""
    mlp = 3 * e * ph
    if norm == "layernorm":
        return mlp + (0 if input_kept else e * ph) + 2 * 4 * rows
    return mlp + e * ph + ((4 * ph + 4 * rows) if input_grad else 0)


def qwen_vision(model, cfg, max_pixels: int, act_bytes: int, rows: int) -> tuple[list[LayerType], float, str]:
    """(the tower's layer types, empty when it is frozen: without gradients it keeps nothing; the mergers' bytes
    kept for backward; the note's sentence on the images) for the worst micro-batch of `cfg` (module docstring):
    `rows` samples (documents) of data.max_seq_len tokens."""
    visual = model.model.visual
    v, e, arch = model.config.vision_config, act_bytes, QWEN_ARCHS[model.config.model_type]
    tokens, images = image_budget(v, max_pixels, cfg.data.max_seq_len)
    merge, unit = v.spatial_merge_size**2, v.patch_size * v.spatial_merge_size
    per_image = tokens * merge  # patches
    n_images = rows * images
    patches = n_images * per_image
    # Windows where the config has them (Qwen2.5-VL: all blocks but fullatt_block_indexes); none: whole images.
    full = len(set(v.fullatt_block_indexes)) if getattr(v, "window_size", 0) else v.depth
    window = min((v.window_size // v.patch_size) ** 2, per_image) if full < v.depth else per_image
    deepstack = len(getattr(v, "deepstack_visual_indexes", None) or ())
    trains = any(p.requires_grad for p in visual.blocks.parameters())
    types = []
    if trains:
        block = vision_block(v, arch, cfg.toggles.attention)
        params = count_params(visual.blocks[0], trainable_only=True)
        spans = ((v.depth - full, window), (full, per_image))
        types = [LayerType(block, n, params, seq=s, batch=patches // s) for n, s in spans if n]
    # The mergers (trained in every stage): the main one's norm runs per patch on the last block's output; each
    # DeepStack merger's after the 2x2 shuffle on its block's output, which the next block keeps too where the tower
    # trains. (Their features' addition to the first language layers keeps only the image tokens' mask.) A trained
    # tower also keeps its RoPE cos and sin (fp32, head_dim per patch each), which all its blocks share, and a
    # learned position table resampled per image keeps each patch's tap indices (int64) and weights (fp32).
    # (Measured against autograd: tests/unit/test_vlm_sizing.py.)
    ph = patches * v.hidden_size
    outside = merger_bytes(arch.tower_norm, ph, patches, e, input_grad=trains)
    outside += deepstack * merger_bytes(arch.tower_norm, ph, patches // merge, e, input_grad=trains, input_kept=trains)
    if trains:
        outside += 2 * 4 * patches * (v.hidden_size // v.num_heads)
        outside += (8 + 4) * POSITION_TAPS * patches if getattr(v, "num_position_embeddings", 0) else 0
    blocks = f"{v.depth} blocks: {v.depth - full} in {window}-patch windows, {full} over whole images"
    if full == v.depth:
        blocks = f"{v.depth} blocks over whole images"
    mergers = f", {deepstack} DeepStack mergers" if deepstack else ""
    note = (
        f"images: at most {tokens} tokens each (data.max_pixels={max_pixels:,} / {unit}^2), {images} whole such images "
        f"a sample (data.max_seq_len={cfg.data.max_seq_len}), {patches:,} patches a micro-batch through the tower "
        f"({blocks}{mergers}), " + ("trained (vlm.train_vision)" if trains else "frozen: it keeps nothing for backward")
    )
    return types, outside, note


def memory_spec(cfg: TrainConfig) -> ModelSpec:
    """The VLM for the memory model (common/memory.py): built on the meta device from its config (the folders', a
    RELEASED Qwen-VL's by name, or `model.*` with an assumed vocabulary when model.vocab_size is 0: no weights nor
    tokenizer read), frozen per stage, counted. A Qwen2.5-VL or Qwen3-VL adds its tower and merger(s) over the pixel
    budget's images (qwen_vision). Under preference.loss (recipes/vlm/preference.py) a micro-batch of pairs is twice
    as many documents, each with its images (chosen and rejected go through one forward), and the live reference is
    a frozen copy of the whole model in the policy's dtype: partitioned over dp as the policy under ZeRO-3, whole on
    every GPU under stages 0-2 (common/deepspeed.py frozen_copy), none under finetune=lora or a reference-free loss."""
    source = weight_source(cfg)
    config = source.config()
    t = config.text_config
    with torch.device("meta"):
        model = build_model(config, "sdpa")
    copy, reference = preference_reference(
        cfg, count_params(model), "in the compute dtype, partitioned as the policy under ZeRO-3, whole under 0-2"
    )
    rows = cfg.trainer.micro_batch_size * (2 if cfg.preference.enabled else 1)
    trainable_parts(model, cfg)
    first_layer = model.model.language_model.layers[0]
    layer = count_params(first_layer, trainable_only=True)
    trainable = count_params(model, trainable_only=True)
    # A LLaVA's frozen vision tower runs without autograd: it keeps nothing. The text rows are taken at their
    # longest, `rows` x max_seq_len tokens (image tokens included).
    block = Block(
        hidden=t.hidden_size,
        heads=t.num_attention_heads,
        ffn=t.intermediate_size,
        kv_heads=t.num_key_value_heads,
        # transformers' attention takes config.head_dim where the config has one (Qwen3-VL-4B: 32 x 128 over 2560).
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        norm="rmsnorm",
        mlp="swiglu",
        dropout=False,
        attention="eager" if cfg.toggles.attention == "eager" else "fused",
        dense_mask=cfg.toggles.attention == "sdpa",
        # Qwen3's (Qwen3-VL's) RMSNorm per head on q and k, transformers' RMSNorm: it keeps the fp32 copy only.
        qk_norm=hasattr(first_layer.self_attn, "q_norm"),
        qk_norm_keeps_input=False,
    )
    e = 4 if cfg.toggles.precision == "fp32" else 2
    tower, outside, note = [], 0.0, ""
    if isinstance(source, QwenWeights):
        tower, outside, note = qwen_vision(model, cfg, source.pixel_budget()[1], e, rows)
        note = f"{source.arch.name} from {source.label}; {note}"
    if reference:
        pairs = f"{cfg.trainer.micro_batch_size} pair(s) a micro-batch: {rows} documents with their images"
        note = "\n".join(filter(None, (note, f"{reference}; {pairs}")))
    first = trainable - t.num_hidden_layers * layer - sum(ty.layers * ty.params for ty in tower)
    return ModelSpec(
        cfg.recipe.name,
        block,
        layers=t.num_hidden_layers,
        seq=cfg.data.max_seq_len,
        micro_batch=rows,
        layer_params=layer,
        first_params=first,
        frozen_params=count_params(model) - trainable,
        gather_unit_params=largest_module_params(model),
        largest_trainable=largest_trainable(model),
        vocab=t.vocab_size,
        precision=cfg.toggles.precision,
        outside_layers_bytes=outside,
        note=note,
        more_layers=tuple(tower),
        # parallel.cp: Ulysses over the language model, the logits gathered (recipes/vlm/context_parallel.py); the
        # planner varies it, but for preference pairs, which do not run with it yet (recipes/vlm/config.py).
        context_parallel=not cfg.preference.enabled,
        cp_method=cfg.parallel.cp_method,
        cp_whole_loss=True,
        reference_copy=copy,
    )
