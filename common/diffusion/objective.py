"""Training objectives -- DDPM (epsilon or v prediction) and rectified flow -- and the diffusers scheduler that
samples each.

    ddpm: x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) noise, integer t in [0, T); the DDPM schedule
          trains, DDIM (deterministic, eta=0) samples.
    flow: x_t = (1 - t) x_0 + t noise, t in (0, 1) uniform or logit-normal (Esser et al. 2024, SD3);
          the target is the velocity noise - x_0, and FlowMatchEulerDiscreteScheduler integrates it
          from t=1 to 0. Its timesteps are sigma * num_train_timesteps, so the DiT's sinusoidal
          timestep embedding sees t * T in training too (a float in [0, T)).

Random draws (timesteps here, noise and label drops in the trainer) come from each sample's own generator
(common/seed.py: `sample_rngs`, keyed by the sample's place in the global stream), so they do not depend on
the parallel layout.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import DDIMScheduler, DDPMScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from common.diffusion.config import DiffusionConfig
from common.seed import per_sample

FLOW_SCHEDULER = "FlowMatchEulerDiscreteScheduler"
UNIPC_SCHEDULER = "UniPCMultistepScheduler"


def ddpm_scheduler(d: DiffusionConfig) -> DDPMScheduler:
    return DDPMScheduler(
        num_train_timesteps=d.num_train_timesteps,
        beta_schedule=d.beta_schedule,
        prediction_type=d.prediction_type,
        clip_sample=False,
    )


def sampling_scheduler(d: DiffusionConfig) -> DDIMScheduler | FlowMatchEulerDiscreteScheduler:
    """The scheduler that samples a model trained with `d` (the one an export saves in scheduler/)."""
    if d.objective == "flow":
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=d.num_train_timesteps, shift=d.flow_shift)
    return DDIMScheduler.from_config(ddpm_scheduler(d).config)


def scheduler_config(scheduler) -> dict:
    """A scheduler's config as its saved scheduler_config.json has it: with the class name, which
    picks the sampler (a live scheduler's `.config` leaves it out)."""
    return {**scheduler.config, "_class_name": type(scheduler).__name__}


def is_flow_scheduler(config: dict) -> bool:
    """A saved scheduler config that samples a flow-matching model: FlowMatchEulerDiscreteScheduler, or a
    UniPCMultistepScheduler on flow sigmas predicting the flow (Wan 2.1's)."""
    name = config.get("_class_name")
    unipc = (
        name == UNIPC_SCHEDULER and config.get("use_flow_sigmas") and config.get("prediction_type") == "flow_prediction"
    )
    return name == FLOW_SCHEDULER or bool(unipc)


def scheduler_from_config(config: dict):
    """A sampler for a saved scheduler config: flow matching's Euler scheduler or Wan's flow UniPC as saved, else DDIM
    (from a DDPM or DDIM config: the same noise schedule)."""
    if config.get("_class_name") == FLOW_SCHEDULER:
        return FlowMatchEulerDiscreteScheduler.from_config(config)
    if is_flow_scheduler(config):
        return UniPCMultistepScheduler.from_config(config)
    return DDIMScheduler.from_config(config)


class Objective:
    """What the DiT is trained to predict at which noisy input."""

    def __init__(self, d: DiffusionConfig):
        self.d = d
        self.ddpm = ddpm_scheduler(d) if d.objective == "ddpm" else None

    def timesteps(self, rngs: list) -> torch.Tensor:
        """One training timestep per sample, drawn from its generator (CPU): DDPM's integer t in [0, T), flow's
        t in (0, 1), uniform or logit-normal (sigmoid(N(mean, std)), Esser et al. 2024)."""
        d = self.d
        if self.ddpm is not None:
            return per_sample(rngs, lambda r: r.integers(0, d.num_train_timesteps))
        if d.flow_timesteps == "uniform":
            return per_sample(rngs, lambda r: r.random(dtype=np.float32)).float()
        normal = per_sample(rngs, lambda r: r.standard_normal(dtype=np.float32)).float()
        return torch.sigmoid(d.flow_logit_mean + d.flow_logit_std * normal)

    def noisy(
        self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_t, the DiT's timestep input, the regression target) for clean inputs `x0` at timesteps `t`
        (`timesteps`)."""
        t = t.to(x0.device)
        if self.ddpm is None:
            tb = t.view(-1, *([1] * (x0.dim() - 1)))
            return (1 - tb) * x0 + tb * noise, t * self.d.num_train_timesteps, noise - x0
        target = noise if self.d.prediction_type == "epsilon" else self.ddpm.get_velocity(x0, noise, t)
        return self.ddpm.add_noise(x0, noise, t), t, target
