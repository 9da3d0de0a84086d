"""scripts/bench.py's options: a --quick run writes to its own folder, never over a full run's report."""

from __future__ import annotations

import pytest

from scripts.bench import FULL_OUT, QUICK_OUT, SECTIONS, parse_args
from tests.conftest import REPO


def test_default_output_folders_keep_quick_apart(tmp_path):
    full, names = parse_args([])
    quick, _ = parse_args(["--quick"])
    assert full.out == FULL_OUT == REPO / "outputs" / "bench" and names == list(SECTIONS)
    assert quick.out == QUICK_OUT == FULL_OUT / "quick" and quick.log == QUICK_OUT / "bench.log"
    assert parse_args(["--quick", "--out", str(tmp_path)])[0].out == tmp_path


def test_unknown_section_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--only", "overhead,nope"])
    assert "unknown section(s) nope" in capsys.readouterr().err
