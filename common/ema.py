"""Exponential moving average of a model's weights that also works under ZeRO-3.

The EMA tracks each parameter's *local storage*: the full tensor normally, this rank's
partition (`param.ds_tensor`) under DeepSpeed ZeRO-3, so it is sharded exactly like the
weights and costs 4 bytes per local element. `swapped()` puts the EMA values into the
model for sampling/export and restores the trained weights afterwards.
"""

from __future__ import annotations

import contextlib

import torch


def _local(p: torch.nn.Parameter) -> torch.Tensor:
    return p.ds_tensor if hasattr(p, "ds_tensor") else p.data


class EMA:
    def __init__(self, model: torch.nn.Module, decay: float, warmup_steps: int = 0):
        self.decay = decay
        self.warmup_steps = warmup_steps
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shadow = [_local(p).detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        decay = 0.0 if step < self.warmup_steps else self.decay
        for s, p in zip(self.shadow, self.params):
            s.lerp_(_local(p).float(), 1.0 - decay)

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped(self):
        backup = [_local(p).detach().clone() for p in self.params]
        for s, p in zip(self.shadow, self.params):
            _local(p).copy_(s)
        try:
            yield
        finally:
            for b, p in zip(backup, self.params):
                _local(p).copy_(b)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": [s.clone() for s in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        for s, saved in zip(self.shadow, state["shadow"]):
            s.copy_(saved)
