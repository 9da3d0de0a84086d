"""The parallel layout: validates dp * tp * pp == world size and builds the one DeviceMesh."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import ParallelConfig
from common.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int
    pp: int
    world_size: int

    @classmethod
    def from_config(cls, p: ParallelConfig, world_size: int) -> "ParallelDims":
        """`parallel.dp=-1` takes whatever ranks tp and pp leave; any other mismatch is an error."""
        if world_size % (p.tp * p.pp):
            raise ConfigError(
                f"parallel.tp*pp={p.tp}*{p.pp}={p.tp * p.pp} does not divide the {world_size} ranks this job started"
            )
        dp = world_size // (p.tp * p.pp) if p.dp == -1 else p.dp
        if dp * p.tp * p.pp != world_size:
            raise ConfigError(
                f"parallel.dp*tp*pp={dp}*{p.tp}*{p.pp}={dp * p.tp * p.pp} but the job has {world_size} ranks "
                "(set parallel.dp=-1 to derive dp, or start that many ranks)"
            )
        return cls(dp=dp, tp=p.tp, pp=p.pp, world_size=world_size)

    @classmethod
    def for_sizing(cls, p: ParallelConfig, world_size: int) -> "ParallelDims":
        """The layout a dry run sizes: `parallel.dp` when set (a laptop sizes a cluster's layout), else
        what this launch's ranks leave after tp and pp."""
        dp = p.dp if p.dp > 0 else max(1, world_size // (p.tp * p.pp))
        return cls(dp=dp, tp=p.tp, pp=p.pp, world_size=dp * p.tp * p.pp)

    def build_mesh(self, device_type: str):
        """A 3-D mesh ("pp", "dp", "tp"): tp innermost, so tensor-parallel peers are neighbours
        (same node on a GPU cluster), pp outermost (crosses nodes least often per step)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))
