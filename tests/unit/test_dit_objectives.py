"""The DiT's objectives against their definitions: rectified flow's interpolation and velocity target, DDPM's
schedule, and each sampler driven by an oracle model of a one-image dataset, which must land on that image."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from common.diffusion.config import DiffusionConfig
from common.diffusion.objective import Objective, sampling_scheduler, scheduler_config
from common.diffusion.sampling import sample_images
from common.seed import sample_rngs


def draw_t(objective: Objective, n: int) -> torch.Tensor:
    return objective.timesteps(sample_rngs(0, range(n)))


def test_flow_interpolates_and_targets_the_velocity():
    objective = Objective(DiffusionConfig(objective="flow", flow_timesteps="uniform"))
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(64, 3, 4, 4, generator=g), torch.randn(64, 3, 4, 4, generator=g)
    x_t, timestep, target = objective.noisy(x0, noise, draw_t(objective, 64))
    # the draw the objective makes: t ~ U(0, 1), from each sample's own generator
    t = torch.tensor([np.random.default_rng([0, i]).random(dtype=np.float32) for i in range(64)])
    torch.testing.assert_close(timestep, t * 1000)  # the DiT's embedding sees t scaled like the scheduler's sigmas
    torch.testing.assert_close(x_t, (1 - t)[:, None, None, None] * x0 + t[:, None, None, None] * noise)
    torch.testing.assert_close(target, noise - x0)


@pytest.mark.parametrize("kind", ["uniform", "logit_normal"])
def test_flow_timestep_distributions(kind):
    objective = Objective(
        DiffusionConfig(objective="flow", flow_timesteps=kind, flow_logit_mean=0.5, flow_logit_std=0.8)
    )
    _, timestep, _ = objective.noisy(torch.zeros(20000, 1), torch.zeros(20000, 1), draw_t(objective, 20000))
    t = timestep / 1000
    assert 0 < t.min() and t.max() < 1
    if kind == "uniform":
        assert abs(t.mean() - 0.5) < 0.01 and abs(t.var() - 1 / 12) < 0.005
    else:  # logit(t) ~ N(0.5, 0.8^2) (Esser et al. 2024)
        logit = torch.log(t / (1 - t))
        assert abs(logit.mean() - 0.5) < 0.02 and abs(logit.std() - 0.8) < 0.02


def test_ddpm_objective_is_diffusers_schedule():
    d = DiffusionConfig(objective="ddpm", prediction_type="v_prediction")
    objective = Objective(d)
    x0, noise = torch.randn(16, 1, 4, 4), torch.randn(16, 1, 4, 4)
    x_t, t, target = objective.noisy(x0, noise, draw_t(objective, 16))
    abar = objective.ddpm.alphas_cumprod[t][:, None, None, None]
    torch.testing.assert_close(x_t, abar.sqrt() * x0 + (1 - abar).sqrt() * noise)
    torch.testing.assert_close(
        target, abar.sqrt() * noise - (1 - abar).sqrt() * x0
    )  # v = sqrt(abar) eps - sqrt(1-abar) x0
    assert t.dtype == torch.long and 0 <= t.min() and t.max() < d.num_train_timesteps


class OracleDiT:
    """The exact prediction for a dataset of one image x0 (every class): flow's velocity
    (x_t - x0) / sigma with sigma = timestep / T, or DDPM's epsilon."""

    def __init__(self, x0: torch.Tensor, objective: str, alphas_cumprod: torch.Tensor | None = None):
        self.x0, self.objective, self.abar = x0, objective, alphas_cumprod

    def __call__(self, x, timestep, class_labels):
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        if self.objective == "flow":
            sigma = (timestep.float() / 1000).view(-1, 1, 1, 1)
            out = (x - self.x0) / sigma
        else:
            abar = self.abar[timestep.long()].view(-1, 1, 1, 1)
            out = (x - abar.sqrt() * self.x0) / (1 - abar).sqrt()
        return Transformer2DModelOutput(sample=out)


@pytest.mark.parametrize("objective", ["flow", "ddpm"])
def test_samplers_reach_the_data_with_an_oracle(objective):
    """Euler on a straight path and DDIM (eta=0) with the true epsilon are exact: whatever the start
    noise, the sampler ends on the one training image. This pins the timestep convention each
    scheduler feeds the model (flow: sigma * 1000, DDPM: integer steps)."""
    d = DiffusionConfig(objective=objective, prediction_type="epsilon")
    scheduler = sampling_scheduler(d)
    x0 = torch.rand(1, 3, 8, 8) * 1.6 - 0.8
    oracle = OracleDiT(x0, objective, getattr(scheduler, "alphas_cumprod", None))
    images = sample_images(
        oracle,
        scheduler_config(scheduler),
        torch.tensor([0, 1, 2]),
        null_class=3,
        image_size=8,
        in_channels=3,
        steps=8,
        guidance_scale=2.0,
        generator=torch.Generator().manual_seed(0),
        device=torch.device("cpu"),
    )
    assert images.shape == (3, 3, 8, 8)
    torch.testing.assert_close(images, x0.expand(3, -1, -1, -1), rtol=0, atol=1e-4)


def test_flow_scheduler_shift_is_the_config_key():
    """diffusion.flow_shift is the scheduler's `shift` (SD3's resolution shift): more steps at high noise."""
    plain, shifted = (sampling_scheduler(DiffusionConfig(objective="flow", flow_shift=s)) for s in (1.0, 3.0))
    for scheduler in (plain, shifted):
        scheduler.set_timesteps(4)
    assert shifted.config.shift == 3.0 and math.isclose(float(shifted.timesteps[0]), 1000.0)
    assert (shifted.sigmas[1:-1] > plain.sigmas[1:-1]).all()
