"""A released text-to-image pipeline folder in (`model.init_from`): which pipeline it is (model_index.json), its
transformer, VAE and scheduler settings, and its frozen text encoders as a prompt encoder that gives the
transformer's conditioning exactly as the diffusers pipeline computes it; and out: the export's pipeline folder and
its kiln.json (`write_pipeline`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from common.config import TrainConfig
from common.errors import ConfigError
from common.weights import check_folder

TRAINED = ("StableDiffusion3Pipeline",)  # model_index.json `_class_name`s Kiln trains (FluxPipeline: next)
TRANSFORMER = "SD3Transformer2DModel"
# diffusion.* keys and the scheduler_config.json entries they come from.
SCHEDULER_KEYS = {"num_train_timesteps": "num_train_timesteps", "flow_shift": "shift"}


def pipeline_folder(init_from: str) -> Path:
    """The pipeline folder `model.init_from` names: one line if it is none, or one of a pipeline Kiln does not
    train, or if its transformer's weights are missing or damaged."""
    folder = Path(init_from).expanduser().absolute()
    try:
        index = json.loads((folder / "model_index.json").read_text())
    except (OSError, ValueError):
        raise ConfigError(
            f"model.init_from={init_from}: no diffusers pipeline folder there (no readable model_index.json; a "
            "StableDiffusion3Pipeline saved with save_pretrained or downloaded whole)"
        ) from None
    name = index.get("_class_name") if isinstance(index, dict) else None
    if name not in TRAINED:
        raise ConfigError(
            f"model.init_from={init_from} is a {name or 'pipeline of no known class'}; the text-to-image recipe "
            f"trains {', '.join(TRAINED)} folders"
        )
    if index.get("transformer", [None, None])[1] != TRANSFORMER:
        raise ConfigError(f"model.init_from={init_from}: its transformer is not a diffusers {TRANSFORMER}")
    transformer = folder / "transformer"
    if not any(transformer.glob("*.safetensors")):
        raise ConfigError(f"model.init_from={init_from}: no *.safetensors weights in {transformer}")
    check_folder(transformer, f"model.init_from={init_from}")  # one line for a file cut short
    return folder


def scheduler_config(folder: Path) -> dict:
    """The pipeline's scheduler_config.json, with its class name (it picks the sampler: common/diffusion/objective.py);
    one line for a scheduler Kiln's flow objective and sampler do not implement."""
    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    if config.get("_class_name") != "FlowMatchEulerDiscreteScheduler":
        raise ConfigError(
            f"model.init_from={folder}: its scheduler is a {config.get('_class_name')}, not flow matching"
        )
    if config.get("use_dynamic_shifting") or config.get("invert_sigmas") or config.get("shift_terminal"):
        raise ConfigError(
            f"model.init_from={folder}: its FlowMatchEulerDiscreteScheduler uses dynamic shifting, inverted sigmas or "
            "a terminal shift, which Kiln's sampler does not implement yet"
        )
    return config


def transformer_config(folder: str | Path) -> dict:
    return json.loads((Path(folder) / "transformer" / "config.json").read_text())


def vae_factor(folder: str | Path) -> int:
    """How much the pipeline's VAE downsamples: 2^(len(block_out_channels)-1)."""
    config = json.loads((Path(folder) / "vae" / "config.json").read_text())
    return 2 ** (len(config["block_out_channels"]) - 1)


def check_image_size(folder: str | Path, image_size: int) -> None:
    """One line unless `image_size` images fit the pipeline in `folder` (check_patches)."""
    check_patches(transformer_config(folder), vae_factor(folder), image_size, f"model.init_from={folder}")


def check_patches(transformer: dict, factor: int, image_size: int, source: str, what: str = "") -> None:
    """One line unless `image_size` images fit a transformer config and a VAE factor: a multiple of the VAE's factor
    times the transformer's patch, and within its position embedding (pos_embed_max_size patches a side). `what`:
    the side's name in the message (data.image_size=N by default)."""
    what = what or f"data.image_size={image_size}"
    step = factor * transformer["patch_size"]
    if image_size % step:
        raise ConfigError(
            f"{what} must be a multiple of {step} (the VAE's downsampling x the transformer's patch_size) for {source}"
        )
    side = image_size // step
    if transformer.get("pos_embed_max_size") and side > transformer["pos_embed_max_size"]:
        raise ConfigError(
            f"{what} is {side} patches a side; the transformer in {source} "
            f"embeds at most pos_embed_max_size={transformer['pos_embed_max_size']}"
        )


COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def encoders_identity(folder: Path) -> dict:
    """What a cache of the pipeline's frozen encoders records of them (recipes/t2i/data.py): each text encoder's and
    the VAE's config (version stamps left out) and weights fingerprint (common/weights.py), by subfolder name."""
    from common.diffusion.vae import vae_identity
    from common.weights import fingerprint

    index = json.loads((folder / "model_index.json").read_text())
    out = {"vae": vae_identity(folder / "vae")}
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        if index.get(name, [None, None])[0] is not None:
            config = json.loads((folder / name / "config.json").read_text())
            config = {k: v for k, v in config.items() if k not in ("transformers_version", "_name_or_path")}
            out[name] = {"config": config, "weights": fingerprint(folder / name, f"model.init_from={folder}")}
    return out


def load_transformer(folder: Path):
    """The pipeline's transformer in fp32 (the engine casts it to the compute dtype), in training mode."""
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel.from_pretrained(folder / "transformer", torch_dtype=torch.float32).train()


# ---- out: the export's folder (T2ITrainer.export, recipes/t2i/export.py and lora.py) ----------------------
def write_pipeline(folder: Path, base: Path, cfg: TrainConfig, *, step: int, transformer=None) -> None:
    """The export: the base pipeline's folder with its transformer replaced (`transformer` saved with
    save_pretrained, in the dtype it trained in; None: the caller writes transformer/), and kiln.json."""
    shutil.copytree(base, folder, ignore=lambda d, names: ["transformer"] if Path(d) == base else [])
    if transformer is not None:
        transformer.save_pretrained(folder / "transformer", safe_serialization=True)
    (folder / "kiln.json").write_text(json.dumps(export_info(cfg, base, step), indent=2))


def export_info(
    cfg: TrainConfig, base: Path, step: int, load: str = "StableDiffusion3Pipeline.from_pretrained(EXPORT)"
):
    """kiln.json: the run, the base and the settings to sample the export with (`load`: how to build the pipeline)."""
    return {
        "recipe": cfg.recipe.name,
        "step": step,
        "base": str(base),
        "diffusers_pipeline": json.loads((base / "model_index.json").read_text())["_class_name"],
        "image_size": cfg.data.image_size,
        "sample_steps": cfg.diffusion.sample_steps,
        "guidance_scale": cfg.diffusion.guidance_scale,
        "max_sequence_length": cfg.model.max_sequence_length,
        "sample_with": f"{load}(prompt, height=image_size, width=image_size, num_inference_steps=sample_steps, "
        "guidance_scale=guidance_scale, max_sequence_length=max_sequence_length)",
    }


class PromptEncoder:
    """The pipeline's frozen text encoders, eval mode, no gradients, in the compute dtype: prompts -> the
    transformer's `encoder_hidden_states` and `pooled_projections`, as StableDiffusion3Pipeline.encode_prompt
    computes them (the export parity test checks it end to end):

        CLIP-L and CLIP-G: padded to the first tokenizer's model_max_length, the penultimate hidden states and the
                           projected pooled output; hidden states concatenated on features, pooled likewise
        T5:                padded to max_sequence_length; zeros of joint_attention_dim where the pipeline has none
        context:           [CLIP states zero-padded to T5's width ; T5 states] along the sequence
    """

    def __init__(self, folder: Path, *, device, dtype: torch.dtype, max_sequence_length: int, joint_dim: int):
        from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

        index = json.loads((folder / "model_index.json").read_text())

        def load(name: str, cls):
            if index.get(name, [None, None])[0] is None:
                return None
            if cls is None:
                return AutoTokenizer.from_pretrained(folder / name)
            model = cls.from_pretrained(folder / name, torch_dtype=dtype)
            return model.eval().requires_grad_(False).to(device)

        self.clip = [
            (load(f"tokenizer{s}", None), load(f"text_encoder{s}", CLIPTextModelWithProjection)) for s in ("", "_2")
        ]
        self.t5 = (load("tokenizer_3", None), load("text_encoder_3", T5EncoderModel))
        self.clip_length = self.clip[0][0].model_max_length
        self.max_sequence_length, self.joint_dim = max_sequence_length, joint_dim
        self.device, self.dtype = device, dtype
        self.warned = False

    def ids(self, tokenizer, prompts: list[str], length: int) -> torch.Tensor:
        ids = tokenizer(prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
        if not self.warned and any(len(x) > length for x in tokenizer(prompts).input_ids):
            print(f"kiln: warning: a prompt longer than {length} tokens was truncated (as diffusers does)", flush=True)
            self.warned = True
        return ids.input_ids.to(self.device)

    @torch.no_grad()
    def __call__(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        states, pooled = [], []
        for tokenizer, encoder in self.clip:
            out = encoder(self.ids(tokenizer, prompts, self.clip_length), output_hidden_states=True)
            states.append(out.hidden_states[-2])
            pooled.append(out[0])
        tokenizer, encoder = self.t5
        if encoder is None:
            t5 = torch.zeros(
                (len(prompts), self.max_sequence_length, self.joint_dim), device=self.device, dtype=self.dtype
            )
        else:
            t5 = encoder(self.ids(tokenizer, prompts, self.max_sequence_length))[0]
        clip = torch.cat(states, dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {
            "encoder_hidden_states": torch.cat([clip, t5], dim=-2).to(self.dtype),
            "pooled_projections": torch.cat(pooled, dim=-1).to(self.dtype),
        }
