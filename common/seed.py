"""Seeding and RNG state capture, so a resumed run replays the same random numbers."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def sample_rngs(seed: int, sample_ids: list[int]) -> list[np.random.Generator]:
    """One generator per sample, keyed by (seed, the sample's ordinal in the global stream): what a sample
    draws (noise, a timestep, a label drop) does not depend on which rank or micro-batch takes it, so a run
    resumed under another layout draws the same numbers. numpy's SeedSequence hashes the whole key (torch's
    CPU generator keeps 32 bits of a seed: distinct samples would share streams)."""
    return [np.random.default_rng([seed, i]) for i in sample_ids]


def per_sample(rngs: list[np.random.Generator], draw) -> torch.Tensor:
    """`draw(rng)` (a numpy array or number) for each sample's generator, stacked into one CPU tensor."""
    return torch.from_numpy(np.stack([np.asarray(draw(r)) for r in rngs]))
