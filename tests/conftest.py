"""Shared test helpers: run the real entrypoint (python or torchrun) in a subprocess."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from common.tools.launcher import REPO, TRAIN, run_train  # noqa: F401  (the tests' launcher: common/tools)

# Small, fast DiT runs: few steps, tiny eval, no progress bar.
FAST_DIT = [
    "recipe=dit_tiny",
    "trainer.progress_bar=false",
    "trainer.sample_every=0",
    "trainer.log_every=1",
    "diffusion.sample_steps=5",
    "diffusion.samples_per_class=2",
    "diffusion.eval_samples_per_class=3",
]


def load_script(name: str):
    """scripts/NAME.py as a module, to call its main(argv) in process."""
    spec = importlib.util.spec_from_file_location(f"kiln_script_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def losses(run_dir) -> dict[int, float]:
    from common.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
