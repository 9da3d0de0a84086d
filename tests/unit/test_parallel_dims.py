"""Parallel layouts are validated against the world size with one-line errors."""

import pytest

from common.errors import ConfigError
from common.parallel_dims import ParallelDims
from recipes.llm.config import MeshParallelConfig


def test_dp_is_derived_from_the_world_size():
    dims = ParallelDims.from_config(MeshParallelConfig(dp=-1, tp=2, pp=2), world_size=8)
    assert (dims.dp, dims.tp, dims.pp) == (2, 2, 2)


@pytest.mark.parametrize(
    "dp,tp,pp,world,needle",
    [
        (2, 2, 2, 4, "parallel.dp*tp*pp=2*2*2=8 but the job has 4 ranks"),
        (-1, 3, 1, 4, "parallel.tp*pp=3*1=3 does not divide the 4 ranks"),
        (1, 1, 1, 2, "parallel.dp*tp*pp=1*1*1=1 but the job has 2 ranks"),
    ],
)
def test_impossible_layouts_are_rejected(dp, tp, pp, world, needle):
    with pytest.raises(ConfigError, match=needle.replace("*", r"\*")):
        ParallelDims.from_config(MeshParallelConfig(dp=dp, tp=tp, pp=pp), world_size=world)


def test_ep_splits_the_dp_ranks():
    dims = ParallelDims.from_config(MeshParallelConfig(dp=-1, ep=2), world_size=4)
    assert (dims.dp, dims.ep, dims.edp, dims.world_size) == (4, 2, 2, 4)
    with pytest.raises(ConfigError, match="parallel.ep=4 must divide the 2 data-parallel ranks"):
        ParallelDims.from_config(MeshParallelConfig(dp=-1, ep=4), world_size=2)


def test_cp_splits_the_world_besides_dp():
    dims = ParallelDims.from_config(MeshParallelConfig(dp=-1, cp=2), world_size=4)
    assert (dims.dp, dims.cp, dims.world_size) == (2, 2, 4)
    with pytest.raises(ConfigError, match="parallel.cp=2 does not divide the 3 ranks"):
        ParallelDims.from_config(MeshParallelConfig(dp=-1, cp=2), world_size=3)
    with pytest.raises(ConfigError, match=r"parallel.dp\*tp\*pp\*cp=2\*1\*1\*2=4 but the job has 2 ranks"):
        ParallelDims.from_config(MeshParallelConfig(dp=2, cp=2), world_size=2)
