"""A family is its folder plus one registry entry (README, recipes/registry.py): tests/fixtures/toy_family, registered
through KILN_FAMILIES and nothing else, trains, checkpoints, resumes and exports through the users' CLIs
(scripts/train.py, scripts/export.py), its own config section (`toy.noise`) on the command line like any key."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from recipes import registry
from tests.conftest import load_script, losses, run_train

pytestmark = pytest.mark.integration

FAMILY = {"KILN_FAMILIES": "tests.fixtures.toy_family"}


def test_a_family_from_the_test_tree_trains_resumes_and_exports(tmp_path, capsys, monkeypatch):
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    args = ["recipe=toy_tiny", "trainer.max_steps=4", "toy.noise=0.1"]
    proc = run_train([*args, "checkpoint.every=2", f"run.dir={first}"], env=FAMILY)
    assert "kiln: eval loss" in proc.stdout and f"kiln: exported to {first / 'export'}" in proc.stdout
    assert "noise: 0.1" in (first / "config.yaml").read_text()  # the family's section, as the command line set it
    # Resumed from step 2 in another run dir: steps 3 and 4 bit for bit the uninterrupted run's.
    proc = run_train([*args, f"run.dir={resumed}", f"run.resume={first / 'checkpoints' / 'step_0000002'}"], env=FAMILY)
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout
    want, got = losses(first), losses(resumed)
    assert sorted(got) == [3, 4] and all(got[s] == want[s] for s in got), (want, got)

    # scripts/export.py in this process, the family registered as a user's process registers it (and unregistered
    # after the test: registry.SPECS is restored).
    monkeypatch.setattr(registry, "SPECS", dict(registry.SPECS))
    monkeypatch.setenv("KILN_FAMILIES", FAMILY["KILN_FAMILIES"])
    export = load_script("export").main
    assert export([str(first), "--checkpoint", "step_4", "--out", str(tmp_path / "step4")]) == 0
    assert export([str(first), "--checkpoint", "step_2", "--out", str(tmp_path / "step2")]) == 0
    end, step4, step2 = (
        load_file(d / "model.safetensors") for d in (first / "export", tmp_path / "step4", tmp_path / "step2")
    )
    assert end.keys() == step4.keys() and all(torch.equal(end[k], step4[k]) for k in end)  # the final checkpoint
    assert not all(torch.equal(end[k], step2[k]) for k in end)  # an earlier step's weights
    assert "161 parameters" in capsys.readouterr().out  # 8x16 + 16 + 16x1 + 1
    assert export([str(first), "--max-shard-size", "1GB"]) == 2
    assert capsys.readouterr().err.strip() == "export: error: --max-shard-size is not for toy runs"
