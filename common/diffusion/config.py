"""The `diffusion` config section: the objective, the VAE, EMA and the sampler's settings, shared by the DiT and the
text-to-image recipes (a key one of them does not read is refused there, not ignored)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DiffusionConfig:
    objective: str = "ddpm"  # ddpm (DDPM noise schedule, DDIM sampling) | flow (rectified flow, Euler sampling)
    num_train_timesteps: int = 1000  # ddpm: the schedule's steps; flow: the timestep embedding's scale (t * this)
    beta_schedule: str = "squaredcos_cap_v2"  # ddpm
    prediction_type: str = "v_prediction"  # ddpm: v_prediction or epsilon; flow always predicts the velocity
    flow_timesteps: str = "logit_normal"  # flow: training t ~ sigmoid(N(mean, std)) (SD3) or uniform
    flow_logit_mean: float = 0.0
    flow_logit_std: float = 1.0
    flow_shift: float = 1.0  # flow: FlowMatchEulerDiscreteScheduler's `shift` for sampling (1 = no shift)
    # A diffusers AutoencoderKL folder: train on its latents ((z - shift_factor) * scaling_factor),
    # decode samples with it. Empty: pixel space.
    vae: str = ""
    class_dropout: float = 0.1  # label dropout for classifier-free guidance
    ema_decay: float = 0.999
    sample_steps: int = 50  # sampler steps for sample grids and eval
    guidance_scale: float = 2.0
    sample_every: int = 0  # a sample grid every this many steps; 0: only at the end
    samples_per_class: int = 8  # sample grid: one row per class
    eval_samples_per_class: int = 50  # eval: samples per class (text-to-image: per digit, in held-out phrasings)


# ---- what the text-conditioned families (text-to-image, video) check alike -----------------------------------------
# The section's keys that only the class-conditional DiT reads: given on their command line they stop the run with one
# line instead of being ignored.
DIT_ONLY = {
    "diffusion.vae": "the VAE is the one in model.init_from's pipeline folder",
    "diffusion.class_dropout": "prompts are dropped for guidance by data.caption_dropout",
    "diffusion.samples_per_class": "samples are drawn for the validation captions",
    "diffusion.beta_schedule": "its transformers are trained with flow matching (no DDPM schedule)",
    "diffusion.prediction_type": "flow matching always predicts the velocity",
}
POSITIVE = ("sample_steps", "flow_logit_std", "flow_shift", "num_train_timesteps", "eval_samples_per_class")


def refuse_dit_only(command_line: set[str], recipe: str) -> None:
    from common.errors import ConfigError

    for key, why in DIT_ONLY.items():
        if key in command_line:
            raise ConfigError(f"{key} is not read by the {recipe} recipe: {why}")


def take_schedule(cfg, command_line: set[str], folder, values: dict[str, tuple[str, object]]) -> None:
    """The flow schedule's keys from a pipeline folder's scheduler into the diffusion section, in place: `values` maps
    diffusion.<key> to (its name in scheduler_config.json, its value); one given on the command line that disagrees
    stops the run."""
    from common.errors import ConfigError

    for key, (name, value) in values.items():
        value = type(getattr(cfg.diffusion, key))(value)
        if f"diffusion.{key}" in command_line and getattr(cfg.diffusion, key) != value:
            raise ConfigError(
                f"diffusion.{key}={getattr(cfg.diffusion, key)} disagrees with model.init_from={folder}, whose "
                f"scheduler gives {name}={value}; leave diffusion.{key} out of the command line"
            )
        setattr(cfg.diffusion, key, value)


def check_text_diffusion(cfg, recipe: str) -> None:
    """One line for a value the text-conditioned families cannot honour: not flow matching, another attention than
    diffusers' (SDPA), a caption dropout, EMA decay, sample cadence, skip limit or schedule value out of range."""
    from common.errors import ConfigError

    d = cfg.diffusion
    if d.objective != "flow":
        raise ConfigError(
            f"diffusion.objective={d.objective}: the {recipe} recipe's transformers are trained with flow matching; "
            "set diffusion.objective=flow"
        )
    if cfg.toggles.attention != "sdpa":
        raise ConfigError(
            f"toggles.attention={cfg.toggles.attention} is not offered by the {recipe} recipe yet; use "
            "toggles.attention=sdpa (diffusers' attention)"
        )
    if cfg.data.max_bad_samples is not None and cfg.data.max_bad_samples < 0:
        raise ConfigError(f"data.max_bad_samples={cfg.data.max_bad_samples} must be >= 0 (or null: no limit)")
    if not 0.0 <= cfg.data.caption_dropout < 1.0:
        raise ConfigError(f"data.caption_dropout={cfg.data.caption_dropout} must be in [0, 1)")
    if not 0.0 <= d.ema_decay < 1.0:
        raise ConfigError(f"diffusion.ema_decay={d.ema_decay} must be in [0, 1)")
    if d.sample_every < 0:
        raise ConfigError(f"diffusion.sample_every={d.sample_every} must be >= 0")
    for key in POSITIVE:
        if not getattr(d, key) > 0:
            raise ConfigError(f"diffusion.{key}={getattr(d, key)} must be > 0")
