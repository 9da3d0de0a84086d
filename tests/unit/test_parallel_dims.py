"""Parallel layouts are validated against the world size with one-line errors, and built once per run."""

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


def test_ep_splits_the_dp_x_cp_ranks():
    """Under context parallelism ep is drawn from dp x cp (each cp rank routes its own chunks): edp = dp * cp / ep."""
    for world, ep, (dp, edp) in ((2, 2, (1, 1)), (4, 2, (2, 2)), (4, 4, (2, 1))):
        dims = ParallelDims.from_config(MeshParallelConfig(dp=-1, cp=2, ep=ep), world_size=world)
        assert (dims.dp, dims.cp, dims.ep, dims.edp) == (dp, 2, ep, edp)
    # A dry run on one process sizes the smallest layout that holds ep: dp=1 when cp covers it.
    assert ParallelDims.for_sizing(MeshParallelConfig(cp=2, ep=2), world_size=1).world_size == 2
    with pytest.raises(ConfigError, match=r"parallel.ep=4 must divide the 2 data-parallel ranks \(parallel.dp x "):
        ParallelDims.from_config(MeshParallelConfig(dp=-1, cp=2, ep=4), world_size=2)


def test_cp_splits_the_world_besides_dp():
    dims = ParallelDims.from_config(MeshParallelConfig(dp=-1, cp=2), world_size=4)
    assert (dims.dp, dims.cp, dims.world_size) == (2, 2, 4)
    with pytest.raises(ConfigError, match="parallel.cp=2 does not divide the 3 ranks"):
        ParallelDims.from_config(MeshParallelConfig(dp=-1, cp=2), world_size=3)
    with pytest.raises(ConfigError, match=r"parallel.dp\*tp\*pp\*cp=2\*1\*1\*2=4 but the job has 2 ranks"):
        ParallelDims.from_config(MeshParallelConfig(dp=2, cp=2), world_size=2)


# Each of 8 ranks' (ep groups, edp groups) under torch's fake process group (layouts only, no collective), as JSON.
EXPERT_GROUPS = """
import json, sys
import torch.distributed as tdist
from torch.testing._internal.distributed.fake_pg import FakeStore
from common.parallel_dims import ParallelDims, expert_mesh
from recipes.llm.config import MeshParallelConfig
cp, ep = int(sys.argv[1]), int(sys.argv[2])
out = []
for rank in range(8):
    tdist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
    dims = ParallelDims.from_config(MeshParallelConfig(dp=-1, pp=2, cp=cp, ep=ep), world_size=8)
    experts = expert_mesh(dims.build_mesh("cpu"), ep)
    out.append([experts["ep"].mesh.tolist(), experts["edp"].mesh.tolist()])
    tdist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.parametrize("cp,ep", [(2, 2), (2, 4), (1, 2)])
def test_expert_mesh_draws_ep_from_dp_x_cp(cp, ep):
    """The ranks' groups on 8 ranks laid out (pp=2, dp=4/cp, cp), rank = (p * dp + d) * cp + c, one process per rank
    simulated (torch's fake process group: layouts only, no collective): an ep group is ep consecutive dp x cp ranks
    of one pipeline stage (cp=2 x ep=2: a dp rank's two cp ranks, which route chunks of the same rows; ep=4: all four;
    cp=1: consecutive dp ranks), and an edp group the ranks of that stage holding the same experts."""
    import json
    import sys

    from tests.support.launcher import run_python

    # Its own process: torch allows one default process group a process, and another test of this pytest worker may
    # hold one.
    proc = run_python([sys.executable, "-c", EXPERT_GROUPS, str(cp), str(ep)], timeout=300)
    assert proc.returncode == 0, proc.stderr
    for rank, groups in enumerate(json.loads(proc.stdout.strip().splitlines()[-1])):
        groups = tuple(groups)
        stage, batch = divmod(rank, 4)  # the dp x cp index, d * cp + c
        mine = batch // ep * ep  # this rank's ep group starts here
        assert groups == (
            [stage * 4 + b for b in range(mine, mine + ep)],
            [stage * 4 + b for b in range(batch % ep, 4, ep)],
        )


def test_the_launcher_hands_its_one_layout_to_the_trainer(tmp_path, monkeypatch):
    """ParallelDims is built once per run, when the config is composed against the job's ranks (common/compose.py:
    compose_run), and scripts/kiln/launch.py hands that object to the trainer, which builds its mesh and cp groups
    from it (common/trainer.py: Trainer.dims); nothing else builds one. A stand-in trainer records what it is given
    and stops the run with a user error (one line, nothing left behind)."""
    import torch

    from common import distributed
    from common import trainer as trainer_module
    from common.errors import UserError
    from recipes import registry
    from recipes.registry import RecipeSpec
    from scripts.kiln import launch

    built, given = [], []
    real = ParallelDims.from_config.__func__

    def counted(cls, p, world_size):
        built.append(real(cls, p, world_size))
        return built[-1]

    def trainer(cfg, dist, run_dir, dims):
        given.append(dims)
        raise UserError("stop here")

    monkeypatch.setattr(ParallelDims, "from_config", classmethod(counted))
    # One process without a process group, signal handlers or global toggles left behind in this test process.
    solo = distributed.DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    monkeypatch.setattr(distributed, "init_distributed", lambda timeout_s: solo)
    monkeypatch.setattr(trainer_module.STOP_SIGNALS, "install", lambda: None)
    monkeypatch.setattr("common.toggles.apply_global_toggles", lambda toggles: None)
    monkeypatch.setattr(RecipeSpec, "trainer", property(lambda spec: trainer))
    with pytest.raises(SystemExit):
        launch.main(["recipe=llm_tiny", "parallel.cp=1", f"run.dir={tmp_path / 'run'}"], registry=registry)
    assert len(built) == 1 and given == built and given[0] is built[0]
    assert (given[0].dp, given[0].cp, given[0].world_size) == (1, 1, 1)
    assert not (tmp_path / "run").exists()
