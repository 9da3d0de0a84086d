"""What the video recipe knows of a Wan pipeline's shape without loading it: its transformer's config.json and its
VAE's compression, from the folder, or for a released pipeline not on this machine, from RELEASED below (sizing a
run before downloading it: run.dry_run, scripts/plan.py). The clip checks (frames 4k+1, sides a multiple of the VAE's
compression x the patch) and the context-parallel checks read it.

`memory_spec(cfg)` is the run for the memory model (common/memory.py): the WanTransformer3DModel built on the meta
device and counted, its blocks' activations over one clip's video tokens (self-attention, split by parallel.cp) and
the prompt's (cross-attention), and what the trainer holds beside the DeepSpeed engine on every GPU: the frozen UMT5 in
the compute dtype and the AutoencoderKLWan in fp32 (on a data.latents cache, the VAE's decoder only)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from common.config import TrainConfig
from common.errors import ConfigError
from common.memory import GB, Block, ModelSpec, count_params, largest_module_params, largest_trainable


@dataclass(frozen=True)
class Architecture:
    source: str  # for messages: the folder, or the release it was taken from
    transformer: dict
    vae_temporal: int
    vae_spatial: int

    @property
    def patch(self) -> tuple[int, int, int]:
        return tuple(self.transformer["patch_size"])

    def tokens(self, num_frames: int, height: int, width: int) -> int:
        """Patch tokens of one num_frames x height x width clip."""
        pt, ph, pw = self.patch
        frames = (num_frames - 1) // self.vae_temporal + 1
        return (frames // pt) * (height // self.vae_spatial // ph) * (width // self.vae_spatial // pw)

    def check_clip(self, num_frames: int, height: int, width: int) -> None:
        """One line unless num_frames x height x width clips fit the VAE and the transformer's patches."""
        if (num_frames - 1) % self.vae_temporal:
            raise ConfigError(
                f"data.num_frames={num_frames} must be {self.vae_temporal}k+1 (the VAE in {self.source} keeps the "
                f"first frame and compresses the rest {self.vae_temporal} to 1), e.g. "
                f"{(num_frames - 1) // self.vae_temporal * self.vae_temporal + 1}"
            )
        pt, ph, pw = self.patch
        if ((num_frames - 1) // self.vae_temporal + 1) % pt:
            raise ConfigError(f"data.num_frames={num_frames}: its latent frames do not divide into patches of {pt}")
        for key, side, p in (("height", height, ph), ("width", width, pw)):
            if side % (self.vae_spatial * p):
                raise ConfigError(
                    f"data.{key}={side} must be a multiple of {self.vae_spatial * p} (the VAE's {self.vae_spatial}x "
                    f"x the transformer's patch {p}) for {self.source}"
                )

    def check_cp(self, cfg) -> None:
        """parallel.cp (Ulysses over the video tokens): cp divides the heads and a clip's tokens."""
        from common import ulysses

        if cfg.parallel.cp == 1:
            return
        d = cfg.data
        ulysses.check_layout(
            cfg,
            heads=self.transformer["num_attention_heads"],
            tokens=self.tokens(d.num_frames, d.height, d.width),
            heads_from="model.init_from's transformer",
            tokens_from=f"data.num_frames={d.num_frames} x data.height={d.height} x data.width={d.width} through "
            f"the VAE and patches {list(self.patch)}",
        )


# Released pipelines, for sizing without their folders: transformer/config.json's keys (Wan-AI/Wan2.1-T2V-1.3B-Diffusers
# and -14B-Diffusers) and the VAE's compression (4 in time, 8 a side, both releases).
RELEASED = {
    "Wan2.1-T2V-1.3B-Diffusers": {
        "_class_name": "WanTransformer3DModel",
        "patch_size": [1, 2, 2],
        "num_attention_heads": 12,
        "attention_head_dim": 128,
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": 4096,
        "freq_dim": 256,
        "ffn_dim": 8960,
        "num_layers": 30,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-06,
        "rope_max_seq_len": 1024,
    },
    "Wan2.1-T2V-14B-Diffusers": {
        "_class_name": "WanTransformer3DModel",
        "patch_size": [1, 2, 2],
        "num_attention_heads": 40,
        "attention_head_dim": 128,
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": 4096,
        "freq_dim": 256,
        "ffn_dim": 13824,
        "num_layers": 40,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-06,
        "rope_max_seq_len": 1024,
    },
}


# The frozen parts of both releases (the same UMT5 and VAE), counted on the meta device: transformers'
# UMT5EncoderModel from google/umt5-xxl's config (d_model 4096, d_ff 10240, 24 layers, 64 heads of d_kv 64, vocabulary
# 256384, gated-gelu: 5,680,910,336 parameters) and diffusers' AutoencoderKLWan with its default config (the release's:
# base_dim 96, z_dim 16, dim_mult 1-2-4-4), 126,892,531 parameters of which its encoder and quant_conv are 53,596,928.
RELEASED_FROZEN = {"text_encoder": 5_680_910_336, "vae": 126_892_531, "vae_encoder": 53_596_928}


def architecture(init_from: str) -> Architecture:
    """The shape of model.init_from: its folder's configs, or a release's (by the folder's name) when the folder is
    not here; one line for neither."""
    folder = Path(init_from).expanduser()
    if folder.exists():
        from recipes.video.weights import pipeline_folder

        folder = pipeline_folder(init_from)
        transformer = json.loads((folder / "transformer" / "config.json").read_text())
        vae = json.loads((folder / "vae" / "config.json").read_text())
        return Architecture(
            str(folder), transformer, vae.get("scale_factor_temporal", 4), vae.get("scale_factor_spatial", 8)
        )
    if folder.name in RELEASED:
        source = f"{folder.name} (the release's shape: model.init_from is not on this machine)"
        return Architecture(source, RELEASED[folder.name], 4, 8)
    raise ConfigError(
        f"model.init_from={init_from}: no such folder, and not a release the video recipe knows the shape of "
        f"({', '.join(RELEASED)})"
    )


# ---- the memory model's view of a run (run.dry_run, scripts/plan.py) -------------------------------------------------
def frozen_params(init_from: str) -> dict[str, int]:
    """Parameters of the frozen parts the trainer loads beside the engine: UMT5 ("text_encoder"), the VAE, and the
    VAE's encoder + quant_conv (what a run on a cache drops), from the folder's configs on the meta device, or
    RELEASED_FROZEN for a release not on this machine."""
    folder = Path(init_from).expanduser()
    if not folder.exists():
        return dict(RELEASED_FROZEN)
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    from recipes.video.weights import pipeline_folder

    folder = pipeline_folder(init_from)
    with torch.device("meta"):
        text_encoder = UMT5EncoderModel(UMT5Config.from_pretrained(folder / "text_encoder"))
        vae = AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(folder / "vae"))
    return {
        "text_encoder": count_params(text_encoder),
        "vae": count_params(vae),
        "vae_encoder": count_params(vae.encoder) + count_params(vae.quant_conv),
    }


def wan_block(transformer: dict, cross_tokens: int) -> Block:
    """A WanTransformerBlock for the memory model: fp32 LayerNorms with fp32 modulation, self-attention over the video
    tokens with q/k RMSNorm across heads (torch.nn.RMSNorm: its fused CUDA kernel, what a GPU run keeps) and RoPE, the
    cross-attention to the prompt's tokens, the gelu-tanh FFN; selective AC keeps the narrow matmuls
    (recipes/video/parallelize.py: recompute_widening)."""
    heads, head_dim = transformer["num_attention_heads"], transformer["attention_head_dim"]
    return Block(
        hidden=heads * head_dim,
        heads=heads,
        ffn=transformer["ffn_dim"],
        norm="fp32_adaln",
        mlp="gelu",
        dropout=False,
        attention="fused",
        selective="save_narrow_matmuls",
        qk_norm=transformer.get("qk_norm") is not None,
        qk_norm_torch="fused",
        cross_tokens=cross_tokens,
    )


def _held_beside(cfg: TrainConfig, frozen: dict[str, int], e: int) -> tuple[float, str]:
    """(bytes, what they are) the trainer holds beside the engine on every GPU: UMT5 in the compute dtype and the VAE
    in fp32 on the fly; on a cache the VAE's decoder only, for the sample clips (recipes/video/train.py)."""
    t5 = frozen["text_encoder"]
    if cfg.data.latents:
        vae = frozen["vae"] - frozen["vae_encoder"]
        return vae * 4, (
            f"on the data.latents cache, training holds no UMT5 and only the VAE's decoder ({vae / 1e6:.1f}M) in fp32, "
            f"{vae * 4 / GB:.2f} GB, for the sample clips (their prompts' embeddings are in the cache)"
        )
    vae = frozen["vae"]
    return t5 * e + vae * 4, (
        f"UMT5 ({t5 / 1e9:.2f}B) in {cfg.toggles.precision}, {t5 * e / GB:.2f} GB, and the VAE ({vae / 1e6:.1f}M) in "
        f"fp32, {vae * 4 / GB:.2f} GB: they encode every batch on the fly (data.latents=DIR, a cache from python -m "
        f"data.cache_latents, leaves UMT5 and the VAE's encoder out of training)"
    )


def memory_spec(cfg: TrainConfig) -> ModelSpec:
    """model.init_from's WanTransformer3DModel for the memory model: built on the meta device from its config (the
    folder's or the release's) and counted (the trained weights, their grads, Adam and the fp32 EMA under ZeRO; under
    finetune=lora the adapters, the base frozen), its blocks over one clip's video tokens (data.num_frames x height x
    width through the VAE and the patches; parallel.cp splits them) with the prompt's model.max_sequence_length tokens
    cross-attended, and beside the engine what the trainer holds on every GPU (_held_beside) and the buffers."""
    import diffusers
    import torch

    from common import lora

    if not cfg.model.init_from:
        raise ConfigError("run.dry_run sizes a released pipeline: set model.init_from=<a WanPipeline folder>")
    arch = architecture(cfg.model.init_from)
    t, d = arch.transformer, cfg.data
    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel.from_config(t)
    if cfg.finetune == "lora":  # the adapters train; the base is frozen weights in the engine
        lora.apply_lora(model, cfg.lora)
    tokens = arch.tokens(d.num_frames, d.height, d.width)
    text = cfg.model.max_sequence_length
    e = 4 if cfg.toggles.precision == "fp32" else 2
    buffers = sum(b.numel() for b in model.buffers())
    frozen_beside, beside = _held_beside(cfg, frozen_params(cfg.model.init_from), e)
    trained = count_params(model, trainable_only=True)
    layer = count_params(model.blocks[0], trainable_only=True)
    note = (
        f"held whole on every GPU (in weights): {beside}; the transformer's buffers {buffers * e / GB:.2f} GB. "
        f"WanTransformer3DModel: {len(model.blocks)} blocks over {tokens} video tokens a clip ({d.num_frames} "
        f"frames of {d.height}x{d.width} through the VAE's {arch.vae_temporal}x/{arch.vae_spatial}x and patches "
        f"{list(arch.patch)}), self-attention over all of them, cross-attention to {text} UMT5 tokens. Not counted: "
        + ("" if d.latents else "the VAE's and UMT5's no-grad forward before each micro-batch, ")
        + "the sample clips' VAE decode (after the step's activations are freed), the embeddings and final projection "
        f"outside the blocks. Sized from {arch.source}."
    )
    return ModelSpec(
        cfg.recipe.name,
        wan_block(t, text),
        layers=len(model.blocks),
        seq=tokens,
        micro_batch=cfg.trainer.micro_batch_size,
        layer_params=layer,
        first_params=trained - len(model.blocks) * layer,
        frozen_params=count_params(model) - trained,
        gather_unit_params=largest_module_params(model),
        precision=cfg.toggles.precision,
        ac_modes=("none", "selective", "full"),
        ema=True,
        unsharded_bytes=frozen_beside + buffers * e,
        context_parallel=True,  # the planner varies parallel.cp
        largest_trainable=largest_trainable(model),
        cp_method=cfg.parallel.cp_method,  # alltoall (Ulysses: common/ulysses.py), its only method
        note=note,
    )
