"""The one entrypoint behind scripts/train.py: compose + validate the config, join the process
group, fix run.dir on every rank, and hand over to recipes/<family>/train.py.

User mistakes (bad key, bad value, impossible layout, missing file) end the run with one
line on stderr and exit code 2, before anything is written.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from common.config import TrainConfig, register, validate
from common.errors import ConfigError, UserError
from common.parallel_dims import ParallelDims

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
USAGE = """usage: python scripts/train.py recipe=<name> [key=value ...] [--cfg]
       torchrun --nproc_per_node N scripts/train.py recipe=<name> [key=value ...]

  recipes: {recipes}
  --cfg    print the composed config and exit
Config keys: configs/train.yaml and its groups; see README.md."""


def user_error_exit(message: str) -> "SystemExit":
    """`kiln: error: <message>` on stderr (rank 0 only) and the SystemExit(2) to raise: a user mistake."""
    if os.environ.get("RANK", "0") == "0":
        print(f"kiln: error: {message}", file=sys.stderr, flush=True)
    return SystemExit(2)


def _recipes() -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / "recipe").glob("*.yaml"))


def explain_compose_error(exc: Exception) -> str:
    """One line from Hydra/OmegaConf's multi-line composition errors."""
    from hydra.errors import MissingConfigException

    if isinstance(exc, MissingConfigException):
        first = str(exc).splitlines()[0]
        if "recipe/" in first:
            return f"no such recipe ({first.split(': ', 1)[-1]}); available: {', '.join(_recipes())}"
        return first
    cause = exc.__cause__ or exc
    key = getattr(cause, "full_key", None)
    message = str(cause).splitlines()[0]
    if key and "not in" in message:
        return f"unknown config key '{key}' ({message})"
    if key:
        return f"bad value for '{key}': {message}"
    return " ".join(str(exc).split())


def _expand_home(override: str) -> str:
    """`key=~/models/x` -> `key=/home/me/models/x`: the shell does not expand a `~` after `key=`, and
    Hydra's override grammar has no `~` in unquoted values."""
    key, sep, value = override.partition("=")
    return f"{key}={os.path.expanduser(value)}" if sep and (value == "~" or value.startswith("~/")) else override


def compose(overrides: list[str]) -> TrainConfig:
    """Composed, typed and validated config (raises ConfigError)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from common import lora
    from recipes.registry import SPECS, recipe_spec

    register()
    for spec in SPECS.values():
        spec.config.register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            raw = hydra_compose(config_name="train", overrides=[_expand_home(o) for o in overrides])
        cfg: TrainConfig = OmegaConf.to_object(raw)
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(explain_compose_error(exc)) from None
    spec = recipe_spec(cfg.recipe.family)
    validate(cfg)
    lora.complete(cfg, spec.config)  # finetune=lora: the family's default targets, checked
    spec.config.complete(cfg, command_line_keys(overrides))  # keys filled from files (the LLM: model.init_from)
    spec.config.validate(cfg)
    return cfg


def command_line_keys(overrides: list[str]) -> set[str]:
    """The dotted keys that ``overrides`` set (``model.dim=64`` -> ``model.dim``; a group choice such as
    ``model=llm_8b`` gives ``model``): what a recipe must not silently replace."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return {o.key_or_group for o in OverridesParser.create().parse_overrides(overrides)}


def resolve_run_dir(cfg: TrainConfig) -> Path:
    """run.dir as given, else outputs/<recipe>/<timestamp> chosen by rank 0 for every rank."""
    from common.distributed import broadcast_object

    chosen = cfg.run.dir or f"outputs/{cfg.recipe.name}/{time.strftime('%Y%m%d-%H%M%S')}"
    return Path(broadcast_object(chosen)).resolve()


def remove_if_untouched(run_dir: Path) -> None:
    """Delete a run dir that holds no file but config.yaml: a user error found at start-up (a dataset or
    checkpoint that does not fit) then leaves nothing behind, as one found while composing does."""
    import shutil

    if all(p.name == "config.yaml" and p.parent == run_dir for p in run_dir.rglob("*") if not p.is_dir()):
        shutil.rmtree(run_dir, ignore_errors=True)


def dry_run(cfg: TrainConfig, spec, world_size: int) -> None:
    """`run.dry_run=true`: the model's size and the per-GPU memory of the configured layout, from the one
    memory model (common/memory.py; scripts/plan.py prints the same numbers for every layout)."""
    from common.memory import configured_layout, dry_run_report

    dims = ParallelDims.for_sizing(cfg.parallel, world_size)
    layout = configured_layout(spec, dp=dims.dp, tp=dims.tp, pp=dims.pp, zero_stage=cfg.parallel.zero_stage,
                               ac=cfg.toggles.activation_checkpointing, ep=cfg.parallel.ep)
    print(dry_run_report(spec, layout))
    if cfg.parallel.dp <= 0:
        print("(sized for this launch's world size; set parallel.dp=N to size for N GPUs)")


def main(argv: list[str]) -> int:
    from common.known_warnings import silence_known_warnings

    silence_known_warnings()
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE.format(recipes=", ".join(_recipes())))
        return 0
    print_cfg = "--cfg" in argv
    overrides = [a for a in argv if a != "--cfg"]
    try:
        cfg = compose(overrides)
        if print_cfg:
            print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
            return 0
        from common.distributed import watchdog_switch
        from common.toggles import apply_global_toggles, check_toggles

        check_toggles(cfg.toggles)
        watchdog_switch()  # a bad KILN_WATCHDOG stops here
    except ConfigError as exc:
        raise user_error_exit(str(exc)) from None

    from common.distributed import describe_timeout, init_distributed, is_timeout, start_watchdog, teardown
    from common.trainer import STOP_SIGNALS, Stopped

    STOP_SIGNALS.install()  # from here on SIGTERM/SIGUSR1 mean: checkpoint after the next step

    dist = init_distributed(cfg.parallel.timeout_s)
    watchdog = start_watchdog(cfg.parallel.timeout_s, dist)  # names a hung rank under NCCL too
    created = None  # run.dir, when this launch created it
    try:
        apply_global_toggles(cfg.toggles)
        from recipes.registry import recipe_spec

        recipe = recipe_spec(cfg.recipe.family).train()
        if cfg.run.dry_run:
            if dist.is_main:
                dry_run(cfg, recipe.memory_spec(cfg), dist.world_size)
            return 0
        ParallelDims.from_config(cfg.parallel, dist.world_size)  # an impossible layout stops here
        run_dir = resolve_run_dir(cfg)
        if dist.is_main:
            created = None if run_dir.exists() else run_dir
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
            print(f"kiln: {cfg.recipe.name} on {dist.world_size} rank(s), device {dist.device}, run.dir={run_dir}", flush=True)
        recipe.main(cfg, dist, run_dir)
        if dist.is_main:
            print(f"kiln: done; outputs in {run_dir}", flush=True)
    except (UserError, FileNotFoundError) as exc:
        if created is not None:
            remove_if_untouched(created)
        raise user_error_exit(str(exc)) from None
    except Stopped as exc:  # a stop signal: checkpoint written, exit as the signal would
        return exc.exit_code
    except Exception as exc:
        if not is_timeout(exc):
            raise
        # Every rank that timed out says so (rank 0 may be the stuck one); no traceback.
        print(f"kiln: error: {describe_timeout(cfg.parallel.timeout_s)}", file=sys.stderr, flush=True)
        os._exit(1)  # destroying a process group with a peer stuck mid-collective can block
    finally:
        if watchdog is not None:
            watchdog.stop()
        teardown()
    return 0
