"""A released WanPipeline folder in (`model.init_from`): its transformer, its video VAE (AutoencoderKLWan: latents
normalized per channel by the folder's latents_mean/latents_std), its frozen UMT5 as a prompt encoder that gives
exactly WanPipeline.encode_prompt's embeddings, and its flow scheduler's settings; and out: the export's pipeline folder
and kiln.json (common/diffusion/release.py with this module as the family's weights).

Wan 2.1 text-to-video (1.3B, 14B) trains. Wan 2.2's two-expert A14B (a transformer_2 switched in at a boundary
timestep) and TI2V-5B (per-token timesteps, `expand_timesteps`) load in diffusers 0.42 but train differently (an
expert per noise range; a first frame kept clean): each is refused with one line rather than trained as a 2.1 model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from common.config import TrainConfig
from common.diffusion import release
from common.diffusion.objective import is_flow_scheduler
from common.errors import ConfigError

PIPELINE, TRANSFORMER = "WanPipeline", "WanTransformer3DModel"
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def pipeline_folder(init_from: str) -> Path:
    """The WanPipeline folder `model.init_from` names, checked: one line for anything else, for a Wan 2.2 layout this
    recipe does not train, or for missing or damaged transformer weights."""
    folder, index = release.read_index(init_from, {PIPELINE: TRANSFORMER}, "video")
    if (index.get("transformer_2") or [None])[0] is not None:
        raise ConfigError(
            f"model.init_from={init_from} is a two-expert Wan 2.2 pipeline (transformer_2, switched in at "
            f"boundary_ratio={index.get('boundary_ratio')}); the video recipe trains one-transformer Wan 2.1 folders"
        )
    if index.get("expand_timesteps"):
        raise ConfigError(
            f"model.init_from={init_from} is a Wan 2.2 TI2V pipeline (expand_timesteps: a timestep per token); the "
            "video recipe trains Wan 2.1 text-to-video folders"
        )
    return folder


def pipeline_class(folder: Path) -> str:
    return PIPELINE


def scheduler_config(folder: Path) -> dict:
    """The folder's scheduler_config.json; one line unless it samples a flow-matching model (Wan 2.1's
    UniPCMultistepScheduler on flow sigmas, or FlowMatchEulerDiscreteScheduler)."""
    config = json.loads((Path(folder) / "scheduler" / "scheduler_config.json").read_text())
    if not is_flow_scheduler(config):
        raise ConfigError(
            f"model.init_from={folder}: its scheduler ({config.get('_class_name')}) does not sample a flow-matching "
            "model (a UniPCMultistepScheduler with prediction_type=flow_prediction and use_flow_sigmas, or "
            "FlowMatchEulerDiscreteScheduler)"
        )
    if config.get("use_dynamic_shifting") or config.get("invert_sigmas") or config.get("shift_terminal"):
        raise ConfigError(
            f"model.init_from={folder}: its scheduler shifts dynamically, inverts sigmas or has a terminal shift, "
            "which the video recipe's training schedule does not follow"
        )
    return config


def schedule(folder: Path) -> dict[str, tuple[str, object]]:
    """The diffusion.* keys the folder's scheduler sets: key -> (its name in scheduler_config.json, the value)."""
    config = scheduler_config(folder)
    shift = "flow_shift" if "flow_shift" in config else "shift"
    return {
        "num_train_timesteps": ("num_train_timesteps", config["num_train_timesteps"]),
        "flow_shift": (shift, config[shift]),
    }


def load_transformer(folder: Path):
    """The pipeline's WanTransformer3DModel in fp32 (the engine casts it to the compute dtype), in training mode."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(folder / "transformer", torch_dtype=torch.float32).train()


def meta_transformer(folder: Path):
    from diffusers import WanTransformer3DModel

    return release.meta_model(WanTransformer3DModel, folder / "transformer")


def encoders_identity(folder: Path) -> dict:
    """What a cache of the frozen VAE's and UMT5's outputs records of them (recipes/video/data.py)."""
    source = f"model.init_from={folder}"
    return {name: release.part_identity(folder, name, source) for name in ("vae", "text_encoder")}


# ---- the video VAE ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VideoVae:
    """AutoencoderKLWan's geometry and latent normalization: a latent is (z - latents_mean) / latents_std per channel
    (what WanPipeline decodes: z = latent * std + mean); `temporal`/`spatial`: its compression of time (after the
    first frame) and of each side."""

    channels: int
    temporal: int
    spatial: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def of(cls, folder: Path) -> VideoVae:
        c = json.loads((Path(folder) / "vae" / "config.json").read_text())
        return cls(
            c["z_dim"],
            c.get("scale_factor_temporal", 4),
            c.get("scale_factor_spatial", 8),
            tuple(c["latents_mean"]),
            tuple(c["latents_std"]),
        )

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        return (self.channels, (num_frames - 1) // self.temporal + 1, height // self.spatial, width // self.spatial)

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, self.channels, 1, 1, 1)
        return (
            torch.tensor(self.mean, device=like.device).view(shape),
            torch.tensor(self.std, device=like.device).view(shape),
        )

    def to_latents(self, mean: torch.Tensor, std: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """A posterior sample (mean + std * eps), normalized to the transformer's latent space."""
        m, s = self._stats(mean)
        return (mean + std * eps - m) / s

    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """Transformer-space latents [N, C, f, h, w] -> video [N, 3, F, H, W] in [-1, 1], as WanPipeline decodes."""
        m, s = self._stats(latents)
        with torch.no_grad():
            return vae.decode(latents.float() * s + m).sample.clamp(-1, 1)


def load_vae(folder: Path, device):
    """The pipeline's AutoencoderKLWan in fp32 eval mode with no trainable parameters, on `device`; it encodes and
    decodes a batch one clip at a time (diffusers' slicing: each clip's result as alone, a batch's peak memory one
    clip's, which at 81 x 480 x 832 is what bounds a batch)."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(Path(folder) / "vae", torch_dtype=torch.float32)
    vae.enable_slicing()
    return vae.eval().requires_grad_(False).to(device)


def posterior(vae, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the VAE's posterior for video [N, 3, F, H, W] in [-1, 1] (contiguous, as a cache stores them)."""
    with torch.no_grad():
        dist = vae.encode(video.float()).latent_dist
    return dist.mean.contiguous(), dist.std.contiguous()


# ---- UMT5 -------------------------------------------------------------------------------------------------------
class PromptEncoder:
    """The pipeline's frozen UMT5, eval mode, no gradients, in the compute dtype: prompts -> `encoder_hidden_states`
    [N, max_sequence_length, text_dim] as WanPipeline._get_t5_prompt_embeds computes them (its prompt_clean, the
    tokenizer padded to max_sequence_length with its attention mask, the states past each prompt's length zeroed)."""

    def __init__(self, folder: Path, *, device, dtype: torch.dtype, max_sequence_length: int):
        from transformers import AutoTokenizer, UMT5EncoderModel

        self.tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
        encoder = UMT5EncoderModel.from_pretrained(folder / "text_encoder", torch_dtype=dtype)
        self.encoder = encoder.eval().requires_grad_(False).to(device)
        self.max_sequence_length, self.device, self.dtype = max_sequence_length, device, dtype
        self.warned = False

    @torch.no_grad()
    def __call__(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        prompts = [prompt_clean(p) for p in prompts]
        length = self.max_sequence_length
        tokens = self.tokenizer(prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
        if not self.warned and any(len(x) > length for x in self.tokenizer(prompts).input_ids):
            print(f"kiln: warning: a prompt longer than {length} tokens was truncated (as diffusers does)", flush=True)
            self.warned = True
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
        states = self.encoder(ids, mask).last_hidden_state
        states = states * mask.unsqueeze(-1).to(states.dtype)  # zeros past each prompt's tokens, as the pipeline pads
        return {"encoder_hidden_states": states.to(self.dtype)}


# ---- out: the export's folder ----------------------------------------------------------------------------------
def export_info(cfg: TrainConfig, base: Path, step: int, load: str | None = None) -> dict:
    """kiln.json: the run, the base and the settings to sample the export with (`load`: how to build the pipeline)."""
    load = load or f"{PIPELINE}.from_pretrained(EXPORT)"
    d = cfg.data
    return {
        "recipe": cfg.recipe.name,
        "step": step,
        "base": str(base),
        "diffusers_pipeline": PIPELINE,
        "num_frames": d.num_frames,
        "height": d.height,
        "width": d.width,
        "sample_steps": cfg.diffusion.sample_steps,
        "guidance_scale": cfg.diffusion.guidance_scale,
        "max_sequence_length": cfg.model.max_sequence_length,
        "sample_with": f"{load}(prompt, num_frames=num_frames, height=height, width=width, num_inference_steps="
        "sample_steps, guidance_scale=guidance_scale, max_sequence_length=max_sequence_length)",
    }


def write_pipeline(folder: Path, base: Path, cfg: TrainConfig, *, step: int, transformer=None) -> None:
    """The export: the base pipeline's folder with `transformer` in place, and kiln.json (`export_info`)."""
    release.write_pipeline(folder, base, export_info(cfg, base, step), transformer)
