"""The text-to-image run for the memory model (run.dry_run, scripts/plan.py): the transformer from its pipeline
folder's config, built on the meta device and counted, plus what the recipe holds beside the DeepSpeed engine on every
GPU (the frozen text encoders in the compute dtype, the VAE in fp32). Without the folder on this machine (sizing a run
before downloading it), a released pipeline's shape comes from RELEASED below."""

from __future__ import annotations

import functools
import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.config import TrainConfig
from common.errors import ConfigError
from common.memory import GB, Block, ModelSpec, count_params, largest_module_params
from recipes.t2i.pipeline import FLUX_TRANSFORMER, check_patches, pipeline_folder, transformer_config, vae_factor
from recipes.t2i.pipeline import check_image_size as pipeline_check_image_size

TEXT_ENCODERS = {"text_encoder": "CLIP-L", "text_encoder_2": "CLIP-G", "text_encoder_3": "T5-XXL"}  # SD3's roles


@dataclass(frozen=True)
class Architecture:
    """What sizing needs of a pipeline: its transformer's config.json, the CLIP tokenizer's length, the VAE's
    downsampling and parameters, and each text encoder's parameters (by its model_index.json name)."""

    source: str  # for messages: the folder, or the release it was taken from
    transformer: dict
    clip_length: int
    vae_factor: int
    vae_params: int
    text_encoders: dict[str, int] = field(default_factory=dict)

    def check_image_size(self, image_size: int) -> None:
        check_patches(self.transformer, self.vae_factor, image_size, self.source)


# stabilityai/stable-diffusion-3.5-medium, for sizing without its folder: transformer/config.json's architecture keys
# (diffusers' SD3Transformer2DModel; dual attention in layers 0-12 and QK RMSNorm are what 3.5 adds to SD3 medium),
# the CLIP tokenizers' 77 tokens, the 16-channel VAE at 1/8, and parameter counts of the text encoders and the VAE
# built on the meta device from the release's config.json files (transformers' CLIPTextModelWithProjection x 2,
# T5EncoderModel; diffusers' AutoencoderKL, block_out_channels 128-256-512-512 without quant convs).
RELEASED = {
    "stable-diffusion-3.5-medium": Architecture(
        source="stabilityai/stable-diffusion-3.5-medium (the release's shape: model.init_from is not on this machine)",
        transformer={
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
        vae_params=83_819_683,
        text_encoders={"text_encoder": 123_650_304, "text_encoder_2": 694_659_840, "text_encoder_3": 4_762_310_656},
    )
}


def _class(entry) -> type:
    """A model_index.json entry ["transformers", "T5EncoderModel"] -> the class."""
    return getattr(importlib.import_module(entry[0]), entry[1])


def read_architecture(folder: Path) -> Architecture:
    """A pipeline folder's Architecture: configs read, the frozen models built on the meta device and counted."""
    index = json.loads((folder / "model_index.json").read_text())
    encoders = {}
    for name in TEXT_ENCODERS:
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
        transformer=transformer_config(folder),
        clip_length=int(tokenizer["model_max_length"]),
        vae_factor=vae_factor(folder),
        vae_params=count_params(vae),
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


def memory_spec(cfg: TrainConfig) -> ModelSpec:
    """The SD3 transformer for the memory model: built on the meta device from its config and counted (the trained
    weights, their grads, Adam and the fp32 EMA under ZeRO), its joint attention over the image's tokens and the
    prompt's (CLIP's and max_sequence_length T5 tokens), and beside the engine, on every GPU whatever the stage, the
    text encoders in the compute dtype, the VAE in fp32 and the transformer's buffers (its position embedding)."""
    from diffusers import SD3Transformer2DModel

    from common import lora

    if not cfg.model.init_from:
        raise ConfigError(
            "run.dry_run sizes a released pipeline: set model.init_from=<a StableDiffusion3Pipeline folder>"
        )
    arch = architecture(cfg.model.init_from)
    t = arch.transformer
    if t.get("_class_name") == FLUX_TRANSFORMER:
        raise ConfigError(
            f"run.dry_run and scripts/plan.py size StableDiffusion3Pipeline runs only (yet); model.init_from="
            f"{cfg.model.init_from} is a FluxPipeline"
        )
    with torch.device("meta"):
        model = SD3Transformer2DModel.from_config(t)
    if cfg.finetune == "lora":  # the adapters train; the base is frozen weights in the engine (as the DiT's)
        lora.apply_lora(model, cfg.lora)
    trained = functools.partial(count_params, trainable_only=True)
    blocks = list(model.transformer_blocks)
    layer = min(trained(b) for b in blocks)  # a block without the dual attention (the rest: with the embeddings)
    first = blocks[0]
    image_tokens = (cfg.data.image_size // arch.vae_factor // t["patch_size"]) ** 2
    text_tokens = arch.clip_length + cfg.model.max_sequence_length  # [CLIP-L ; CLIP-G] on features, then T5
    seq = image_tokens + text_tokens
    dual = sum(1 for b in blocks if getattr(b, "attn2", None) is not None)
    e = 4 if cfg.toggles.precision == "fp32" else 2
    block = Block(
        hidden=t["num_attention_heads"] * t["attention_head_dim"],
        heads=t["num_attention_heads"],
        ffn=first.ff.net[-1].in_features,
        norm="adaln_zero",  # both streams: adaLN-Zero, gelu-tanh MLP, joint SDPA over image + text tokens
        mlp="gelu",
        dropout=False,
        attention="fused",
        qk_norm=t.get("qk_norm") is not None,
        attention2=dual / len(blocks) * image_tokens / seq,
        pre_only=sum(b.context_pre_only for b in blocks) / len(blocks) * text_tokens / seq,
        selective="save_narrow_matmuls",  # recipes/t2i/parallelize.py: recompute_widening
    )
    encoders = sum(arch.text_encoders.values())
    buffers = sum(b.numel() for b in model.buffers())
    frozen_beside = encoders * e + arch.vae_params * 4  # recipes/t2i/train.py: PromptEncoder, vae_lib.load_vae
    parts = ", ".join(f"{TEXT_ENCODERS[n]} {p / 1e9:.2f}B" for n, p in arch.text_encoders.items())
    note = (
        f"held whole on every GPU (in weights): the text encoders ({parts}) in {cfg.toggles.precision}, "
        f"{encoders * e / GB:.2f} GB, and the VAE ({arch.vae_params / 1e6:.1f}M) in fp32, "
        f"{arch.vae_params * 4 / GB:.2f} GB: they encode every batch on the fly (a run on a data.latents cache loads "
        f"them only for its eval, after training: not subtracted here); the transformer's buffers "
        f"{buffers * e / GB:.2f} GB. {seq} tokens = {image_tokens} image + "
        f"{arch.clip_length} CLIP + {cfg.model.max_sequence_length} T5 (joint attention). Not counted: the encoders' "
        f"no-grad forward before each micro-batch (the VAE encoder at data.image_size={cfg.data.image_size}) and "
        f"the patch embedding and final projection outside the layers. Sized from {arch.source}."
    )
    return ModelSpec(
        cfg.recipe.name,
        block,
        layers=len(blocks),
        seq=seq,
        micro_batch=cfg.trainer.micro_batch_size,
        layer_params=layer,
        first_params=trained(model) - len(blocks) * layer,
        frozen_params=count_params(model) - trained(model),
        gather_unit_params=largest_module_params(model),
        precision=cfg.toggles.precision,
        ac_modes=("none", "selective", "full"),
        ema=True,
        unsharded_bytes=frozen_beside + buffers * e,
        note=note,
    )
