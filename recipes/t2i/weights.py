"""A released text-to-image pipeline folder in (`model.init_from`): which pipeline it is (model_index.json), its
transformer, VAE and scheduler settings, and its frozen text encoders as a prompt encoder that gives the
transformer's conditioning exactly as the diffusers pipeline computes it; and out: the export's pipeline folder and
its kiln.json (`write_pipeline`).

What differs between the pipelines Kiln trains is one small adapter each (`Adapter`: `SD3`, `Flux`, picked by
model_index.json's class): its prompt encoder, how latents [N, C, h, w] become the transformer's inputs and its
prediction comes back to that shape, whether sampling pairs each image with the empty prompt for classifier-free
guidance, and how the scheduler's timesteps are set. The flow objective, the VAE path, the EMA, the engine and the
sampler loop are the same for all (recipes/t2i/train.py, common/diffusion/)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from common.config import TrainConfig
from common.diffusion import release
from common.diffusion.release import meta_model, part_identity, read_index
from common.errors import ConfigError

FLUX_TRANSFORMER = "FluxTransformer2DModel"
# diffusion.* keys and the scheduler_config.json entries they come from.
SCHEDULER_KEYS = {"num_train_timesteps": "num_train_timesteps", "flow_shift": "shift"}


def pipeline_folder(init_from: str) -> Path:
    """The pipeline folder `model.init_from` names: one line if it is none, or one of a pipeline Kiln does not
    train, or if its transformer's weights are missing or damaged (common/diffusion/release.py read_index)."""
    return read_index(init_from, {name: a.transformer for name, a in ADAPTERS.items()}, "text-to-image")[0]


def pipeline_class(folder: Path) -> str:
    """diffusers' pipeline class of the folder (common/diffusion/release.py)."""
    return adapter(folder).pipeline


def scheduler_config(folder: Path) -> dict:
    """The pipeline's scheduler_config.json, with its class name (it picks the sampler: common/diffusion/objective.py);
    one line for a scheduler Kiln's flow objective and sampler do not implement."""
    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    if config.get("_class_name") != "FlowMatchEulerDiscreteScheduler":
        raise ConfigError(
            f"model.init_from={folder}: its scheduler is a {config.get('_class_name')}, not flow matching"
        )
    # Dynamic shifting (mu from the image's token count) is FluxPipeline's: its adapter sets the timesteps with it.
    dynamic = config.get("use_dynamic_shifting") and not adapter(folder).dynamic_shifting
    if dynamic or config.get("invert_sigmas") or config.get("shift_terminal"):
        raise ConfigError(
            f"model.init_from={folder}: its FlowMatchEulerDiscreteScheduler uses dynamic shifting, inverted sigmas or "
            "a terminal shift, which Kiln's sampler does not implement for this pipeline yet"
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


def patch_step(transformer: dict, factor: int) -> int:
    """Pixels per token a side: the VAE's downsampling `factor` x the transformer's patch (Flux's: the 2x2 packing of
    its latents, FluxPipeline._pack_latents)."""
    return factor * (2 if transformer.get("_class_name") == FLUX_TRANSFORMER else transformer["patch_size"])


def check_patches(transformer: dict, factor: int, image_size: int, source: str, what: str = "") -> None:
    """One line unless `image_size` images fit a transformer config and a VAE factor: a multiple of the VAE's factor
    times the transformer's patch (Flux's: the 2x2 packing of its latents), and within its position embedding
    (pos_embed_max_size patches a side; Flux's RoPE has no such limit). `what`: the side's name in the message
    (data.image_size=N by default)."""
    what = what or f"data.image_size={image_size}"
    step = patch_step(transformer, factor)
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

    index = json.loads((folder / "model_index.json").read_text())
    out = {"vae": vae_identity(folder / "vae")}
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        if index.get(name, [None, None])[0] is not None:
            out[name] = part_identity(folder, name, f"model.init_from={folder}")
    return out


def transformer_class(folder: Path) -> type:
    """The diffusers class of the pipeline's transformer (pipeline_folder checked it)."""
    import diffusers

    return getattr(diffusers, adapter(folder).transformer)


def load_transformer(folder: Path):
    """The pipeline's transformer in fp32 (the engine casts it to the compute dtype), in training mode."""
    return transformer_class(folder).from_pretrained(folder / "transformer", torch_dtype=torch.float32).train()


def meta_transformer(folder: Path):
    """The pipeline's transformer on the meta device, configured as `load_transformer`'s (a streamed export)."""
    return meta_model(transformer_class(folder), folder / "transformer")


# ---- out: the export's folder (T2ITrainer.export, common/diffusion/release.py) -------------------------------
def write_pipeline(folder: Path, base: Path, cfg: TrainConfig, *, step: int, transformer=None) -> None:
    """The export: the base pipeline's folder with `transformer` in place, and kiln.json (`export_info`)."""
    release.write_pipeline(folder, base, export_info(cfg, base, step), transformer)


def export_info(cfg: TrainConfig, base: Path, step: int, load: str | None = None):
    """kiln.json: the run, the base and the settings to sample the export with (`load`: how to build the pipeline;
    None: `<its class>.from_pretrained(EXPORT)`)."""
    load = load or f"{adapter(base).pipeline}.from_pretrained(EXPORT)"
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
    """A pipeline's frozen text encoders, eval mode, no gradients, in the compute dtype: prompts -> the transformer's
    `encoder_hidden_states` and `pooled_projections`, as its diffusers pipeline's encode_prompt computes them (the
    export parity tests check it end to end). `clip`: [(tokenizer, CLIP encoder)], `t5`: (tokenizer, T5 encoder or
    None), `clip_length` and `max_sequence_length`: the tokens each reads (the images server reads them too)."""

    CLIP = ()  # (tokenizer, text encoder) subfolder names of the CLIP encoders
    T5 = ("", "")  # and of the T5 encoder

    def __init__(self, folder: Path, *, device, dtype: torch.dtype, max_sequence_length: int):
        from transformers import AutoTokenizer

        index = json.loads((folder / "model_index.json").read_text())

        def load(name: str):
            if index.get(name, [None, None])[0] is None:
                return None
            if name.startswith("tokenizer"):
                return AutoTokenizer.from_pretrained(folder / name)
            import transformers

            model = getattr(transformers, index[name][1]).from_pretrained(folder / name, torch_dtype=dtype)
            return model.eval().requires_grad_(False).to(device)

        self.clip = [(load(tokenizer), load(encoder)) for tokenizer, encoder in self.CLIP]
        self.t5 = (load(self.T5[0]), load(self.T5[1]))
        self.clip_length = self.clip[0][0].model_max_length
        self.max_sequence_length = max_sequence_length
        self.device, self.dtype = device, dtype
        self.warned = False

    def ids(self, tokenizer, prompts: list[str], length: int) -> torch.Tensor:
        ids = tokenizer(prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
        if not self.warned and any(len(x) > length for x in tokenizer(prompts).input_ids):
            print(f"kiln: warning: a prompt longer than {length} tokens was truncated (as diffusers does)", flush=True)
            self.warned = True
        return ids.input_ids.to(self.device)


class SD3PromptEncoder(PromptEncoder):
    """StableDiffusion3Pipeline.encode_prompt's conditioning:

    CLIP-L and CLIP-G: padded to the first tokenizer's model_max_length, the penultimate hidden states and the
                       projected pooled output; hidden states concatenated on features, pooled likewise
    T5:                padded to max_sequence_length; zeros of joint_attention_dim where the pipeline has none
    context:           [CLIP states zero-padded to T5's width ; T5 states] along the sequence
    """

    CLIP = (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"))
    T5 = ("tokenizer_3", "text_encoder_3")

    def __init__(self, folder: Path, *, device, dtype: torch.dtype, max_sequence_length: int):
        super().__init__(folder, device=device, dtype=dtype, max_sequence_length=max_sequence_length)
        self.joint_dim = transformer_config(folder)["joint_attention_dim"]

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


class FluxPromptEncoder(PromptEncoder):
    """FluxPipeline.encode_prompt's conditioning: CLIP-L's pooled output (padded to its tokenizer's
    model_max_length) as `pooled_projections`, T5's last hidden states (padded to max_sequence_length) as
    `encoder_hidden_states`; its text ids (zeros, one row per T5 token) are the adapter's (`Flux.forward`)."""

    CLIP = (("tokenizer", "text_encoder"),)
    T5 = ("tokenizer_2", "text_encoder_2")

    @torch.no_grad()
    def __call__(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        (tokenizer, clip), (t5_tokenizer, t5) = self.clip[0], self.t5
        pooled = clip(self.ids(tokenizer, prompts, self.clip_length), output_hidden_states=False).pooler_output
        states = t5(self.ids(t5_tokenizer, prompts, self.max_sequence_length), output_hidden_states=False)[0]
        return {"encoder_hidden_states": states.to(self.dtype), "pooled_projections": pooled.to(self.dtype)}


# ---- the per-pipeline adapters ------------------------------------------------------------------------------
class Adapter:
    """What one diffusers pipeline class does differently around the shared flow core; built for a pipeline folder.

    `forward(model, x, timestep, text, guidance)`: the transformer's velocity for latents x [N, C, h, w] at the
    objective's timesteps (sigma * 1000), conditioned on the prompt encoder's `text`, shaped like x; `guidance`:
    the per-row guidance scale (read only by a guidance-distilled model). `classifier_free`: sampling pairs each image
    with the empty prompt. `set_timesteps(scheduler, steps, latent_size)`: the sampler's schedule, as the pipeline
    sets it."""

    pipeline = transformer = ""
    encoder: type[PromptEncoder] = PromptEncoder
    classifier_free = True
    dynamic_shifting = False

    def __init__(self, folder: Path):
        self.folder = folder
        self.transformer_config = transformer_config(folder)

    def prompt_encoder(self, *, device, dtype: torch.dtype, max_sequence_length: int) -> PromptEncoder:
        return self.encoder(self.folder, device=device, dtype=dtype, max_sequence_length=max_sequence_length)

    def forward(self, model, x, timestep, text: dict, guidance: torch.Tensor) -> torch.Tensor:
        return model(x, timestep=timestep, **text).sample

    def set_timesteps(self, scheduler, steps: int, latent_size: int) -> None:
        scheduler.set_timesteps(steps)


class SD3(Adapter):
    """StableDiffusion3Pipeline: latents in as they are, classifier-free guidance against the empty prompt."""

    pipeline, transformer, encoder = "StableDiffusion3Pipeline", "SD3Transformer2DModel", SD3PromptEncoder


class Flux(Adapter):
    """FluxPipeline: latents packed 2x2 into tokens with RoPE ids (row, column; zeros for the text), the timestep as
    sigma, FLUX.1-dev's guidance scale embedded (`guidance_embeds`) instead of a guidance pair (schnell: neither),
    and the Euler schedule's sigmas linspace(1, 1/steps) shifted by mu from the image's token count (calculate_shift)
    when the scheduler shifts dynamically -- all as FluxPipeline.__call__ and diffusers'
    examples/dreambooth/train_dreambooth_flux.py do."""

    pipeline, transformer, encoder = "FluxPipeline", FLUX_TRANSFORMER, FluxPromptEncoder
    classifier_free = False
    dynamic_shifting = True

    def forward(self, model, x, timestep, text: dict, guidance: torch.Tensor) -> torch.Tensor:
        from diffusers import FluxPipeline

        n, c, h, w = x.shape
        states = text["encoder_hidden_states"]
        out = model(
            hidden_states=FluxPipeline._pack_latents(x, n, c, h, w),
            timestep=timestep / 1000,
            guidance=guidance.to(x.device, torch.float32) if self.transformer_config.get("guidance_embeds") else None,
            pooled_projections=text["pooled_projections"],
            encoder_hidden_states=states,
            txt_ids=torch.zeros(states.shape[1], 3, device=x.device, dtype=states.dtype),
            img_ids=FluxPipeline._prepare_latent_image_ids(n, h // 2, w // 2, x.device, x.dtype),
        ).sample
        return FluxPipeline._unpack_latents(out, h, w, 1)

    def set_timesteps(self, scheduler, steps: int, latent_size: int) -> None:
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        c = scheduler.config
        sigmas = None if c.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        mu = calculate_shift(
            (latent_size // 2) ** 2,  # the image's tokens
            c.get("base_image_seq_len", 256),
            c.get("max_image_seq_len", 4096),
            c.get("base_shift", 0.5),
            c.get("max_shift", 1.15),
        )
        if sigmas is None:
            scheduler.set_timesteps(steps, mu=mu)
        else:
            scheduler.set_timesteps(sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)


ADAPTERS = {a.pipeline: a for a in (SD3, Flux)}  # model_index.json `_class_name`s Kiln trains


def adapter(folder: Path) -> Adapter:
    """The adapter of a pipeline folder (pipeline_folder checked its class)."""
    return ADAPTERS[json.loads((Path(folder) / "model_index.json").read_text())["_class_name"]](Path(folder))
