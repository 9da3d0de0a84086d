"""The parallel layer: the layout (ParallelDims: dp * cp * tp * pp == world size, ep inside dp x cp), built once per
run (common/compose.py checks it against the job's ranks, scripts/kiln/launch.py hands it to the trainer), the one
DeviceMesh it builds, and the context-parallel groups (CPGroups) that both engines and every family's split take."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from common.config import ParallelConfig
from common.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    """``dp`` counts every data-parallel rank (each reads its own share of the global batch). Expert
    parallelism borrows from them, as torchtitan's does: ``ep`` of the dp ranks split the experts (and
    exchange tokens by all-to-all) while still reading different data, so ep never changes the world size
    or the global batch; ``edp = dp / ep`` is what is left to shard the experts over (FSDP2). Under context
    parallelism the ranks that split a step's tokens are dp x cp, and ep is drawn from all of them (each cp rank
    routes its own chunks of the rows): ``edp = dp * cp / ep``."""

    dp: int
    tp: int
    pp: int
    world_size: int
    ep: int = 1
    cp: int = 1  # context parallelism: each row's sequence split over cp ranks that read the same documents

    @property
    def edp(self) -> int:
        return self.dp * self.cp // self.ep

    @classmethod
    def from_config(cls, p: ParallelConfig, world_size: int) -> "ParallelDims":
        """`parallel.dp=-1` takes whatever ranks tp, pp and cp leave; any other mismatch is an error."""
        if world_size % p.cp:
            raise ConfigError(f"parallel.cp={p.cp} does not divide the {world_size} ranks this job started")
        # The degrees besides dp, named as the user set them (cp only where context parallelism is on).
        others = {"tp": p.tp, "pp": p.pp} | ({"cp": p.cp} if p.cp > 1 else {})
        names, values, product = "*".join(others), "*".join(map(str, others.values())), math.prod(others.values())
        if world_size % product:
            raise ConfigError(
                f"parallel.{names}={values}={product} does not divide the {world_size} ranks this job started"
            )
        dp = world_size // product if p.dp == -1 else p.dp
        if dp * product != world_size:
            raise ConfigError(
                f"parallel.dp*{names}={dp}*{values}={dp * product} but the job has {world_size} ranks "
                "(set parallel.dp=-1 to derive dp, or start that many ranks)"
            )
        check_ep_divides_dp(p.ep, dp, p.cp)
        return cls(dp=dp, tp=p.tp, pp=p.pp, world_size=world_size, ep=p.ep, cp=p.cp)

    @classmethod
    def for_sizing(cls, p: ParallelConfig, world_size: int) -> "ParallelDims":
        """The layout a dry run sizes: `parallel.dp` when set (a laptop sizes a cluster's layout), else
        what this launch's ranks leave after tp, pp and cp (at least enough for ep: dp * cp >= ep)."""
        dp = p.dp if p.dp > 0 else max(math.ceil(p.ep / p.cp), world_size // (p.tp * p.pp * p.cp))
        check_ep_divides_dp(p.ep, dp, p.cp)
        return cls(dp=dp, tp=p.tp, pp=p.pp, world_size=dp * p.tp * p.pp * p.cp, ep=p.ep, cp=p.cp)

    def build_mesh(self, device_type: str):
        """A 3-D mesh ("pp", "dp", "tp"): tp innermost, so tensor-parallel peers are neighbours
        (same node on a GPU cluster), pp outermost (crosses nodes least often per step). Expert
        parallelism splits "dp" (x "cp") further: :func:`expert_mesh`. Context parallelism (cp > 1) adds "cp" between dp
        and tp, and the flattened "dp_cp" that FSDP2 shards over and the loss is summed over (:func:`batch_mesh`)."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.cp == 1:
            return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))
        mesh = init_device_mesh(
            device_type, (self.pp, self.dp, self.cp, self.tp), mesh_dim_names=("pp", "dp", "cp", "tp")
        )
        batch_mesh(mesh)
        return mesh

    def context_groups(self, device_type: str) -> "CPGroups | None":
        """The cp groups of a run without its own mesh (the DeepSpeed recipes: ZeRO data parallelism, pp = tp = 1):
        :meth:`build_mesh`'s ("pp", "dp", "cp", "tp") mesh under parallel.cp > 1 (cp innermost: a cp group is
        consecutive ranks), None otherwise (no mesh: DeepSpeed's own groups). Collective."""
        return CPGroups.of(self.build_mesh(device_type)) if self.cp > 1 else None


@dataclass(frozen=True)
class CPGroups:
    """Context parallelism's process groups (parallel.cp > 1), from a mesh with "dp" and "cp" dims: the one form in
    which both engines (common/engine.py) and every family's sequence split take them.

    ``cp_group``: the ``cp`` ranks that split each sequence (they read the same rows or samples); ``cp_rank``: this
    rank's share of the tokens; attention exchanges over it (the LLM's all-gather or all-to-all, Ulysses' all-to-all).
    ``dp_group``: the ranks with the same cp rank, one per data-parallel group (``dp_rank``: which rows this rank's
    group reads); a DeepSpeed step's loss and sample counts, identical on the cp ranks of a group, are summed over it.
    ``batch_group``: dp x cp flattened (:func:`batch_mesh`), the ranks that split a step's tokens: FSDP2 and ZeRO
    shard over them and the gradients are reduced over them."""

    cp: int
    cp_rank: int
    cp_group: Any
    dp: int
    dp_rank: int
    dp_group: Any
    batch_group: Any

    @classmethod
    def of(cls, mesh) -> "CPGroups | None":
        """The groups of `mesh` (:meth:`ParallelDims.build_mesh`'s), None where it has no "cp" dim (cp = 1)."""
        if "cp" not in (mesh.mesh_dim_names or ()):
            return None
        return cls(
            cp=mesh["cp"].size(),
            cp_rank=mesh.get_local_rank("cp"),
            cp_group=mesh["cp"].get_group(),
            dp=mesh["dp"].size(),
            dp_rank=mesh.get_local_rank("dp"),
            dp_group=mesh["dp"].get_group(),
            batch_group=batch_mesh(mesh).get_group(),
        )


def batch_mesh(mesh):
    """The ranks that split a step's tokens: "dp", or under context parallelism "dp" x "cp" flattened
    (torchtitan's dp_shard_cp): FSDP2 shards the model over them and the loss and its token count are summed over
    them. Collective the first time (flattening creates the group); the same mesh after."""
    if "cp" not in (mesh.mesh_dim_names or ()):
        return mesh["dp"]
    return mesh["dp", "cp"]._flatten("dp_cp")


def expert_mesh(mesh, ep: int):
    """The ranks that split a step's tokens (:func:`batch_mesh`: "dp", or "dp" x "cp" flattened) unflattened into
    ("edp", "ep"), ep innermost: batch rank ``i * ep + j`` holds the ``j``-th ep shard of the experts, and the ranks
    ``j, ep + j, ...`` (an "edp" group) hold the same experts and shard them with FSDP2. Every rank that routes tokens
    is in one ep group (its tokens reach the experts it lacks) and one edp group (the gradients of the experts it holds
    are reduced with every other holder's), so the experts see all dp x cp ranks' tokens. ep peers are consecutive
    batch ranks, the closest ranks after tp (under cp, a dp rank's cp ranks first). Collective."""
    batch = batch_mesh(mesh)
    return batch._unflatten(0, (batch.size() // ep, ep), ("edp", "ep"))


def check_ep_divides_dp(ep: int, dp: int, cp: int = 1) -> None:
    if ep < 1 or (dp * cp) % ep:
        ranks = "parallel.dp" if cp == 1 else f"parallel.dp x parallel.cp = {dp} x {cp}"
        raise ConfigError(
            f"parallel.ep={ep} must divide the {dp * cp} data-parallel ranks ({ranks}): expert "
            "parallelism splits the experts over ep of the ranks that split a step's tokens, which still read "
            "different tokens"
        )
