"""The recipe families as typed specs (torchtitan's TrainSpec): the one table that the launcher
(common/launch.py), the planner (scripts/plan.py) and the benchmarks read.

A family is two modules:

    recipes/<family>/config.py   its schema: register(), complete(cfg, command_line_keys), validate(cfg)
    recipes/<family>/train.py    TRAINER (its common.trainer.Trainer), memory_spec(cfg), main(cfg, dist, run_dir)

The schemas are plain dataclasses, imported here; a family's training code (transformers, diffusers,
DeepSpeed) is imported only when a run, a plan or a benchmark asks for it. Adding a family is one entry
below (and its configs/ group files).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

from common.errors import ConfigError
from recipes.dit import config as dit_config
from recipes.llm import config as llm_config
from recipes.vlm import config as vlm_config


@dataclass(frozen=True)
class RecipeSpec:
    family: str
    config: ModuleType  # recipes/<family>/config.py
    _train: Callable[[], ModuleType]  # imports recipes/<family>/train.py

    def train(self) -> ModuleType:
        """recipes/<family>/train.py: TRAINER, memory_spec(cfg), main(cfg, dist, run_dir)."""
        return self._train()


def _dit_train() -> ModuleType:
    from recipes.dit import train

    return train


def _vlm_train() -> ModuleType:
    from recipes.vlm import train

    return train


def _llm_train() -> ModuleType:
    from recipes.llm import train

    return train


SPECS: dict[str, RecipeSpec] = {
    "dit": RecipeSpec("dit", dit_config, _dit_train),
    "vlm": RecipeSpec("vlm", vlm_config, _vlm_train),
    "llm": RecipeSpec("llm", llm_config, _llm_train),
}


def recipe_spec(family: str) -> RecipeSpec:
    if family not in SPECS:
        raise ConfigError(f"recipe.family={family!r} is not allowed; choose one of: {', '.join(SPECS)}")
    return SPECS[family]
