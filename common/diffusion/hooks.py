"""What the diffusion trainers (the DiT's, text-to-image's) do alike around their samples: the EMA's update and the
sample grid's cadence after each step, and sampling under the EMA's weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from common.ema import EMA


class EMASamples:
    """Mixed in before common.trainer.Trainer: after each step the EMA follows the weights, and every
    diffusion.sample_every steps `save_samples(name)` (the family's own grid) runs."""

    def after_step(self) -> None:  # the loop calls it after steps DeepSpeed did not skip
        self.ema.update()
        every = self.cfg.diffusion.sample_every  # the diffusion section both families share
        if every and self.state.step % every == 0:
            self.save_samples(f"step_{self.state.step:07d}.png")


@contextlib.contextmanager
def ema_eval(model: torch.nn.Module, ema: EMA) -> Iterator[None]:
    """`model` in eval mode with the EMA's weights swapped in; afterwards the trained weights and the mode it had."""
    was_training = model.training
    model.eval()
    with ema.swapped():
        yield
    model.train(was_training)
