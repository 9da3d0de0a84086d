"""Exponential moving average of a model's weights that also works under ZeRO-3.

The EMA tracks each parameter's *local storage*: the full tensor normally, this rank's
partition (`param.ds_tensor`) under DeepSpeed ZeRO-3, so it is sharded exactly like the
weights and costs 4 bytes per local element (diffusers' EMAModel gathers full weights on
every rank under ZeRO-3 instead). `swapped()` puts the EMA values into the model for
sampling/export and restores the trained weights afterwards.

The decay ramps up as min(decay, (1 + step) / (10 + step)), as diffusers' EMAModel does:
with a constant 0.999 the random initial weights would still hold 0.999^1500 = 22% of
the average after a 1500-step run, and its samples are visibly noisier.

A checkpoint holds the EMA whole, by parameter name (`state_dict` gathers ZeRO-3 partitions; collective),
and `load_state_dict` takes this rank's part of it: a run resumes the EMA whatever ZeRO stage and number of
ranks wrote it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as tdist

from common.toggles import unwrapped_name, unwrapped_names


def _local(p: torch.nn.Parameter) -> torch.Tensor:
    return p.ds_tensor if hasattr(p, "ds_tensor") else p.data


def _partitioned(p: torch.nn.Parameter) -> bool:
    return hasattr(p, "ds_tensor")


def _whole(p: torch.nn.Parameter, part: torch.Tensor) -> torch.Tensor:
    """The full tensor of which `part` is this rank's ZeRO-3 partition (collective), on the CPU. ZeRO-3 cuts
    the flattened tensor, padded to a multiple of the ranks, into equal consecutive partitions by rank."""
    if not _partitioned(p):
        return part.detach().cpu().clone()
    parts = [torch.empty_like(part) for _ in range(tdist.get_world_size(p.ds_process_group))]
    tdist.all_gather(parts, part.contiguous(), group=p.ds_process_group)
    return torch.cat(parts)[: p.ds_numel].view(p.ds_shape).cpu()


def _part(p: torch.nn.Parameter, whole: torch.Tensor) -> torch.Tensor:
    """This rank's ZeRO-3 partition of `whole` (see `_whole`), or `whole` for a parameter ZeRO-3 does not cut."""
    if not _partitioned(p):
        return whole
    n = p.ds_tensor.numel()
    rank, world = tdist.get_rank(p.ds_process_group), tdist.get_world_size(p.ds_process_group)
    return torch.nn.functional.pad(whole.flatten(), (0, n * world - whole.numel()))[rank * n : (rank + 1) * n]


class EMA:
    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.names = [unwrapped_name(name) for name, _ in named]  # whatever AC/compile wrap: resumes either way
        self.params = [p for _, p in named]
        self.shadow = [_local(p).detach().float().clone() for p in self.params]
        self.updates = 0  # the warm-up counts the EMA's own updates (skipped optimizer steps make none)

    @torch.no_grad()
    def update(self) -> None:
        step = self.updates
        self.updates += 1
        decay = min(self.decay, (1 + step) / (10 + step))
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
        """Collective under ZeRO-3: the whole EMA by parameter name, on the CPU."""
        shadow = {name: _whole(p, s) for name, p, s in zip(self.names, self.params, self.shadow)}
        return {"decay": self.decay, "updates": self.updates, "shadow": shadow}

    def load_state_dict(self, state: dict) -> None:
        self.updates = state["updates"]
        saved = unwrapped_names(state["shadow"])  # older EMAs kept the prefixes
        for name, p, s in zip(self.names, self.params, self.shadow):
            s.copy_(_part(p, saved[name]))
