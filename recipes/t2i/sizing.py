"""The text-to-image run for the memory model (run.dry_run, scripts/plan.py): the transformer from its pipeline
folder's config, built on the meta device and counted, plus what the recipe holds beside the DeepSpeed engine on every
GPU (the frozen text encoders in the compute dtype, the VAE in fp32). Without the folder on this machine (sizing a run
before downloading it), a released pipeline's shape comes from RELEASED below."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.config import TrainConfig
from common.errors import ConfigError
from common.memory import GB, GIB, Block, LayerType, ModelSpec, count_params, largest_module_params
from recipes.t2i.weights import (
    FLUX_TRANSFORMER,
    check_patches,
    patch_step,
    pipeline_folder,
    transformer_config,
    vae_factor,
)
from recipes.t2i.weights import check_image_size as pipeline_check_image_size

# Each pipeline's frozen text encoders: model_index.json's names and what the note calls them.
TEXT_ENCODERS = {
    "StableDiffusion3Pipeline": {"text_encoder": "CLIP-L", "text_encoder_2": "CLIP-G", "text_encoder_3": "T5-XXL"},
    "FluxPipeline": {"text_encoder": "CLIP-L", "text_encoder_2": "T5-XXL"},
}


@dataclass(frozen=True)
class Architecture:
    """What sizing needs of a pipeline: its class (model_index.json), its transformer's config.json, the CLIP
    tokenizer's length, the VAE's downsampling and parameters (all, and its encoder's: a run on the cache drops the
    encoder), and each text encoder's parameters (by its model_index.json name)."""

    source: str  # for messages: the folder, or the release it was taken from
    pipeline: str
    transformer: dict
    clip_length: int
    vae_factor: int
    vae_params: int
    vae_encoder_params: int
    text_encoders: dict[str, int] = field(default_factory=dict)

    def check_image_size(self, image_size: int) -> None:
        check_patches(self.transformer, self.vae_factor, image_size, self.source)


# Released pipelines, for sizing without their folders: transformer/config.json's architecture keys, the CLIP
# tokenizers' 77 tokens, the 16-channel VAE at 1/8, and parameter counts of the text encoders and the VAE built on the
# meta device from the release's config.json files (transformers' CLIPTextModel(WithProjection), T5EncoderModel;
# diffusers' AutoencoderKL, block_out_channels 128-256-512-512 without quant convs, the same in both: its encoder
# 34,274,208 of its 83,819,683).
# - stabilityai/stable-diffusion-3.5-medium: SD3Transformer2DModel; dual attention in layers 0-12 and QK RMSNorm are
#   what 3.5 adds to SD3 medium. CLIP-L and CLIP-G with projection, T5-XXL.
# - black-forest-labs/FLUX.1-dev: FluxTransformer2DModel, 19 dual-stream + 38 single-stream blocks of 24 heads x 128,
#   T5's 4096 features in, CLIP-L's pooled 768, the guidance embedding (dev is guidance-distilled): 11,901,408,320
#   parameters. CLIP-L (CLIPTextModel: its pooled output only) and T5-XXL.
VAE_PARAMS, VAE_ENCODER_PARAMS, CLIP_L, T5_XXL = 83_819_683, 34_274_208, 123_060_480, 4_762_310_656
RELEASED = {
    "stable-diffusion-3.5-medium": Architecture(
        source="stabilityai/stable-diffusion-3.5-medium (the release's shape: model.init_from is not on this machine)",
        pipeline="StableDiffusion3Pipeline",
        transformer={
            "_class_name": "SD3Transformer2DModel",
            "sample_size": 128,
            "patch_size": 2,
            "in_channels": 16,
            "out_channels": 16,
            "num_layers": 24,
            "attention_head_dim": 64,
            "num_attention_heads": 24,
            "joint_attention_dim": 4096,
            "caption_projection_dim": 1536,
            "pooled_projection_dim": 2048,
            "pos_embed_max_size": 384,
            "dual_attention_layers": list(range(13)),
            "qk_norm": "rms_norm",
        },
        clip_length=77,
        vae_factor=8,
        vae_params=VAE_PARAMS,
        vae_encoder_params=VAE_ENCODER_PARAMS,
        text_encoders={"text_encoder": 123_650_304, "text_encoder_2": 694_659_840, "text_encoder_3": T5_XXL},
    ),
    "FLUX.1-dev": Architecture(
        source="black-forest-labs/FLUX.1-dev (the release's shape: model.init_from is not on this machine)",
        pipeline="FluxPipeline",
        transformer={
            "_class_name": FLUX_TRANSFORMER,
            "patch_size": 1,
            "in_channels": 64,
            "num_layers": 19,
            "num_single_layers": 38,
            "attention_head_dim": 128,
            "num_attention_heads": 24,
            "joint_attention_dim": 4096,
            "pooled_projection_dim": 768,
            "guidance_embeds": True,
            "axes_dims_rope": [16, 56, 56],
        },
        clip_length=77,
        vae_factor=8,
        vae_params=VAE_PARAMS,
        vae_encoder_params=VAE_ENCODER_PARAMS,
        text_encoders={"text_encoder": CLIP_L, "text_encoder_2": T5_XXL},
    ),
}


def _class(entry) -> type:
    """A model_index.json entry ["transformers", "T5EncoderModel"] -> the class."""
    return getattr(importlib.import_module(entry[0]), entry[1])


def read_architecture(folder: Path) -> Architecture:
    """A pipeline folder's Architecture: configs read, the frozen models built on the meta device and counted."""
    index = json.loads((folder / "model_index.json").read_text())
    encoders = {}
    for name in TEXT_ENCODERS[index["_class_name"]]:
        if index.get(name, [None, None])[0] is None:
            continue
        cls = _class(index[name])
        with torch.device("meta"):
            encoders[name] = count_params(cls(cls.config_class.from_pretrained(folder / name)))
    vae_cls = _class(index["vae"])
    with torch.device("meta"):
        vae = vae_cls.from_config(vae_cls.load_config(folder / "vae"))
    tokenizer = json.loads((folder / "tokenizer" / "tokenizer_config.json").read_text())
    return Architecture(
        source=f"model.init_from={folder}",
        pipeline=index["_class_name"],
        transformer=transformer_config(folder),
        clip_length=int(tokenizer["model_max_length"]),
        vae_factor=vae_factor(folder),
        vae_params=count_params(vae),
        vae_encoder_params=count_params(vae.encoder) + count_params(vae.quant_conv),
        text_encoders=encoders,
    )


def architecture(init_from: str) -> Architecture:
    """model.init_from's Architecture: from the folder, or, where it is not on this machine (sizing a run before the
    download), from RELEASED by the folder's name (a download keeps the repository's)."""
    folder = Path(init_from).expanduser()
    if folder.exists():
        return read_architecture(pipeline_folder(init_from))
    if folder.name not in RELEASED:
        raise ConfigError(
            f"model.init_from={init_from}: no pipeline folder there to size from, and no released pipeline Kiln knows "
            f"the shape of by that name ({', '.join(RELEASED)}); point model.init_from at the downloaded folder"
        )
    return RELEASED[folder.name]


def check_image_size(init_from: str, image_size: int) -> None:
    """One line unless `image_size` images fit model.init_from's pipeline (its two config.json files, or RELEASED's
    shape; a missing folder of no known name is reported when training starts)."""
    folder = Path(init_from).expanduser()
    if folder.exists():
        pipeline_check_image_size(folder, image_size)
    elif folder.name in RELEASED:
        RELEASED[folder.name].check_image_size(image_size)


def _joint_block(heads: int, head_dim: int, ffn: int, **kw) -> Block:
    """A block of an MMDiT (SD3's, Flux's): adaLN-Zero, gelu-tanh MLP, SDPA over image + text tokens, selective AC
    keeping the narrow matmuls (recipes/t2i/parallelize.py: recompute_widening)."""
    return Block(
        hidden=heads * head_dim,
        heads=heads,
        ffn=ffn,
        norm="adaln_zero",
        mlp="gelu",
        dropout=False,
        attention="fused",
        selective="save_narrow_matmuls",
        **kw,
    )


def _sd3_layers(model, t: dict, image_tokens: int, text_tokens: int) -> list[LayerType]:
    """SD3's JointTransformerBlocks, one type: SD3.5's dual attention (`attn2`, image tokens only) and the last
    block's `context_pre_only` as the shares of layers x tokens they cover (the dual blocks' extra weights go to
    first_params: the type's parameters are a block's without them)."""
    blocks = list(model.transformer_blocks)
    seq = image_tokens + text_tokens
    dual = sum(1 for b in blocks if getattr(b, "attn2", None) is not None)
    block = _joint_block(
        t["num_attention_heads"],
        t["attention_head_dim"],
        blocks[0].ff.net[-1].in_features,
        qk_norm=t.get("qk_norm") is not None,
        attention2=dual / len(blocks) * image_tokens / seq,
        pre_only=sum(b.context_pre_only for b in blocks) / len(blocks) * text_tokens / seq,
    )
    return [LayerType(block, len(blocks), min(_trained(b) for b in blocks))]


def _flux_layers(model, t: dict, image_tokens: int, text_tokens: int) -> list[LayerType]:
    """Flux's two types over the same joint sequence: dual-stream FluxTransformerBlocks (each stream its own
    adaLN-Zero, attention projections and MLP, as SD3's) and single-stream FluxSingleTransformerBlocks (one modulated
    norm feeding attention and MLP side by side, one projection back: Block.parallel). QK RMSNorm in both; RoPE keeps
    nothing per layer (its cos/sin are shared and need no grad)."""
    kw = dict(heads=t["num_attention_heads"], head_dim=t["attention_head_dim"], qk_norm=True)
    double, single = list(model.transformer_blocks), list(model.single_transformer_blocks)
    types = []
    if double:
        types.append(
            LayerType(_joint_block(ffn=double[0].ff.net[-1].in_features, **kw), len(double), _trained(double[0]))
        )
    if single:
        block = _joint_block(ffn=single[0].proj_mlp.out_features, parallel=True, **kw)
        types.append(LayerType(block, len(single), _trained(single[0])))
    return types


# The transformers the memory model has layer types for: (diffusers class, its layers, whether CLIP's tokens join the
# sequence: SD3 concatenates CLIP-L/G's hidden states with T5's; Flux takes CLIP-L's pooled vector only).
STACKS = {
    "SD3Transformer2DModel": (_sd3_layers, True),
    FLUX_TRANSFORMER: (_flux_layers, False),
}


def _trained(module) -> int:
    return count_params(module, trainable_only=True)


def _meta_transformer(cfg: TrainConfig, arch: Architecture):
    """(model.init_from's transformer on the meta device, adapted under finetune=lora; its STACKS entry)."""
    import diffusers

    from common import lora

    t = arch.transformer
    name = t.get("_class_name")
    if name not in STACKS:
        raise ConfigError(
            f"run.dry_run and scripts/plan.py size {' and '.join(STACKS)} stacks; model.init_from="
            f"{cfg.model.init_from}'s transformer is a {name}"
        )
    with torch.device("meta"):
        model = getattr(diffusers, name).from_config(t)
    if cfg.finetune == "lora":  # the adapters train; the base is frozen weights in the engine (as the DiT's)
        lora.apply_lora(model, cfg.lora)
    return model, STACKS[name]


def _held_beside(cfg: TrainConfig, arch: Architecture, e: int) -> tuple[float, str]:
    """(bytes, what they are) the trainer holds beside the engine on every GPU: the frozen text encoders (on the fly)
    and the VAE."""
    cached = bool(cfg.data.latents)
    encoders = sum(arch.text_encoders.values())
    vae = arch.vae_params - (arch.vae_encoder_params if cached and not cfg.trainer.eval else 0)
    roles = TEXT_ENCODERS[arch.pipeline]
    parts = ", ".join(f"{roles[n]} {p / 1e9:.2f}B" for n, p in arch.text_encoders.items())
    if cached:
        # The eval after training (trainer.eval; the captioned digits only, others skip it) encodes held-out prompts:
        # CachedPrompts loads the encoders then, beside the model states, once training's activations are freed.
        beside = (
            f"on the data.latents cache, training holds no text encoder and the VAE ({vae / 1e6:.1f}M) in fp32, "
            f"{vae * 4 / GB:.2f} GB ({'with' if cfg.trainer.eval else 'without'} its encoder: trainer.eval="
            f"{str(cfg.trainer.eval).lower()}); assumed: the eval after training (trainer.eval, on the captioned "
            f"digits only) loads the text encoders ({parts}, {encoders * e / GB:.2f} GB in {cfg.toggles.precision}) "
            f"once the activations are freed: it fits where activations + transient >= {encoders * e / GIB:.2f} GiB"
        )
    else:
        beside = (
            f"the text encoders ({parts}) in {cfg.toggles.precision}, {encoders * e / GB:.2f} GB, and the VAE "
            f"({vae / 1e6:.1f}M) in fp32, {vae * 4 / GB:.2f} GB: they encode every batch on the fly (data.latents=DIR, "
            f"a cache from python -m data.cache_latents, leaves the encoders out of training)"
        )
    frozen_beside = (0 if cached else encoders * e) + vae * 4  # recipes/t2i/train.py: PromptEncoder, load_vae
    return frozen_beside, beside


def memory_spec(cfg: TrainConfig) -> ModelSpec:
    """The pipeline's transformer for the memory model: built on the meta device from its config and counted (the
    trained weights, their grads, Adam and the fp32 EMA under ZeRO), its layers by type (STACKS) over the image's
    tokens and the prompt's, and beside the engine, on every GPU whatever the stage, what the trainer holds there: on
    the fly, the text encoders in the compute dtype and the VAE in fp32; on a cache (data.latents), the VAE only
    (without its encoder unless trainer.eval: recipes/t2i/train.py); and the transformer's buffers."""
    if not cfg.model.init_from:
        raise ConfigError(
            "run.dry_run sizes a released pipeline: set model.init_from=<a StableDiffusion3Pipeline or FluxPipeline "
            "folder>"
        )
    arch = architecture(cfg.model.init_from)
    t = arch.transformer
    name = t.get("_class_name")
    model, (layer_types, clip_in_sequence) = _meta_transformer(cfg, arch)
    image_tokens = (cfg.data.image_size // patch_step(t, arch.vae_factor)) ** 2
    clip_tokens = arch.clip_length if clip_in_sequence else 0
    text_tokens = clip_tokens + cfg.model.max_sequence_length
    seq = image_tokens + text_tokens
    types = layer_types(model, t, image_tokens, text_tokens)
    if not types:
        raise ConfigError(f"model.init_from={cfg.model.init_from}: its transformer has no blocks to size")
    e = 4 if cfg.toggles.precision == "fp32" else 2
    cached = bool(cfg.data.latents)
    buffers = sum(b.numel() for b in model.buffers())
    frozen_beside, beside = _held_beside(cfg, arch, e)
    stack = " + ".join(f"{ty.layers} x {'single' if ty.block.parallel else 'dual'}-stream" for ty in types)
    tokens = f"{image_tokens} image" + (f" + {clip_tokens} CLIP" if clip_tokens else "")
    pooled = "" if clip_in_sequence else "; CLIP-L's pooled vector conditions the modulation"
    note = (
        f"held whole on every GPU (in weights): {beside}; the transformer's buffers {buffers * e / GB:.2f} GB. "
        f"{name}: {stack} blocks over {seq} tokens = {tokens} + {cfg.model.max_sequence_length} T5 (joint "
        f"attention{pooled}). Not counted: "
        + (
            ""
            if cached
            else f"the encoders' no-grad forward before each micro-batch (the VAE encoder at "
            f"data.image_size={cfg.data.image_size}) and "
        )
        + f"the embeddings and final projection outside the blocks. Sized from {arch.source}."
    )
    first = types[0]
    return ModelSpec(
        cfg.recipe.name,
        first.block,
        layers=first.layers,
        seq=seq,
        micro_batch=cfg.trainer.micro_batch_size,
        layer_params=first.params,
        first_params=_trained(model) - sum(ty.layers * ty.params for ty in types),
        frozen_params=count_params(model) - _trained(model),
        gather_unit_params=largest_module_params(model),
        precision=cfg.toggles.precision,
        ac_modes=("none", "selective", "full"),
        ema=True,
        unsharded_bytes=frozen_beside + buffers * e,
        cp_method=cfg.parallel.cp_method,  # alltoall (Ulysses: common/ulysses.py), its only method
        note=note,
        more_layers=tuple(types[1:]),
    )
