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
