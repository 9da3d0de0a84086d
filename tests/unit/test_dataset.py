"""Unit tests for common.data.prepare_dataset: the dataset's builder (data.build) runs as a subprocess, training
reads what it wrote; builder failures and missing datasets are one-line DataErrors."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import pytest
import torch

from common.config import DataConfig
from common.data import prepare_dataset
from common.distributed import DistInfo
from common.errors import DataError
from tests.conftest import REPO
from tests.support.launcher import run_python

SOLO = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
SMALL = ["--train-shards", "2", "--val-shards", "1"]


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """(root, meta, stdout) of a small digits dataset built on first use by prepare_dataset."""
    root = tmp_path_factory.mktemp("prep") / "digits"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        meta = prepare_dataset(DataConfig(root=str(root), build=["data.prepare_digits", *SMALL]), SOLO)
    return root, meta, printed.getvalue()


def test_builds_on_first_use_then_reuses(digits, capsys):
    root, meta, printed = digits
    assert f"building the dataset at data.root={root}" in printed and f"wrote {root}" in printed
    on_disk = json.loads((root / "meta.json").read_text())
    assert meta["splits"] == on_disk["splits"] and meta["seed"] == 0
    assert meta["train_urls"] == [str(root / f"train-{i:06d}.tar") for i in range(2)]
    assert meta["val_urls"] == [str(root / "val-000000.tar")]
    stamps = {p.name: p.stat().st_mtime_ns for p in root.iterdir()}
    # The builder runs again on every start and leaves a complete dataset with its settings alone.
    assert prepare_dataset(DataConfig(root=str(root), build=["data.prepare_digits", *SMALL]), SOLO) == meta
    assert capsys.readouterr().out == ""
    assert {p.name: p.stat().st_mtime_ns for p in root.iterdir()} == stamps


def test_builder_refusal_is_one_line_with_its_reason(digits):
    root = digits[0]
    data = DataConfig(root=str(root), build=["data.prepare_digits", *SMALL, "--seed", "5"])
    with pytest.raises(DataError) as exc:
        prepare_dataset(data, SOLO)
    message = str(exc.value)
    assert "\n" not in message and f"data.root={root}" in message and "exit code 1" in message
    assert "seed=0" in message and "--force" in message  # the builder's own last stderr line


def test_missing_builder_module(tmp_path):
    data = DataConfig(root=str(tmp_path / "x"), build=["data.no_such_builder"])
    with pytest.raises(DataError, match="No module named data.no_such_builder"):
        prepare_dataset(data, SOLO)


def test_no_builder_and_no_dataset_names_data_root(tmp_path, digits):
    root = digits[0]
    with pytest.raises(DataError, match=f"data.root={tmp_path / 'none'}: no dataset there .data.build is empty"):
        prepare_dataset(DataConfig(root=str(tmp_path / "none"), build=[]), SOLO)
    assert prepare_dataset(DataConfig(root=str(root), build=[]), SOLO)["seed"] == 0  # a built one is just read
    # A side folder that training needs but the dataset lacks (a digits dataset has no tokenizer).
    with pytest.raises(DataError, match="incomplete"):
        prepare_dataset(DataConfig(root=str(root), build=[]), SOLO, asset="tokenizer")


def test_cli_prints_one_error_line_for_a_missing_dataset(tmp_path):
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = run_python(
        [
            sys.executable,
            str(REPO / "scripts" / "train.py"),
            "recipe=dit_tiny",
            "data.build=[]",
            f"data.root={tmp_path / 'none'}",
            f"run.dir={run_dir}",
        ],
        env=env,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kiln: error: data.root=") and "data.build is empty" in lines[0], (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr + proc.stdout
