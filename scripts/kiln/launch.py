"""The one entrypoint behind scripts/train.py: compose + validate the config, join the process
group, fix run.dir on every rank, and run the family's trainer (its spec: recipes/registry.py).

User mistakes (bad key, bad value, impossible layout, missing file) end the run with one
line on stderr and exit code 2, before anything is written.

Several ranks: `python scripts/train.py --nproc_per_node N [torchrun's options] key=value ...` starts them itself,
through torchrun's own launch (torch's elastic agent, in this process), and reports a failed rank in one line
(`launch_ranks`), where `torchrun ... scripts/train.py` follows Kiln's line with its 40-line ChildFailedError report.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from common.compose import (  # noqa: F401  (part of this module's API: the CLIs and tests import them from here)
    CONFIG_DIR,
    _options,
    _recipes,
    check_layout,
    command_line_keys,
    compose_run,
    explain_compose_error,
    parse_overrides,
    rename_overrides,
)
from common.compose import compose as compose_with
from common.config import TrainConfig
from common.errors import ConfigError, UserError
from common.parallel_dims import ParallelDims

# The table of families: handed in by scripts/train.py (main's `registry`), else recipes/registry.py.
_REGISTRY = None


def current_registry():
    """The registry this process composes and runs with (recipes/registry.py unless main was handed another)."""
    if _REGISTRY is None:
        from recipes import registry as default

        return default
    return _REGISTRY


def compose(overrides: list[str], world_size: int | None = None) -> TrainConfig:
    """common/compose.py's compose with this process's registry."""
    return compose_with(overrides, world_size, registry=current_registry())


TRAIN_SCRIPT = CONFIG_DIR.parent / "scripts" / "train.py"
USAGE = """usage: python scripts/train.py recipe=<name> [key=value ...] [--cfg]
       python scripts/train.py --nproc_per_node N [torchrun's options] recipe=<name> [key=value ...]

  recipes: {recipes}
  --cfg    print the composed config and exit
  --nproc_per_node N, --nnodes, --rdzv_backend, --rdzv_endpoint, --max-restarts, ... (torchrun's options, first):
           start the ranks (torch's elastic agent, as torchrun does); a failed rank is reported in one line
Config keys: configs/train.yaml and its groups; see docs/training.md."""
# Set in the ranks that launch_ranks starts: they leave the report of a user mistake to it (one line, not one a rank).
LAUNCHED = "KILN_LAUNCHED_RANKS"


def user_error_exit(message: str) -> "SystemExit":
    """`kiln: error: <message>` and the SystemExit(2) to raise: a user mistake. On stderr from rank 0; under torch's
    elastic agent (torchrun, launch_ranks) every rank also records it in its error file, where the agent reads the
    root cause of a failed job: a rank that fails first names the mistake even if rank 0 is stopped before it can,
    and under launch_ranks that record is the one line the user sees."""
    line = f"kiln: error: {message}"
    record_error(line)
    if os.environ.get("RANK", "0") == "0" and os.environ.get(LAUNCHED) != "1":
        print(line, file=sys.stderr, flush=True)
    return SystemExit(2)


def record_error(line: str) -> None:
    """`line` in this rank's TORCHELASTIC_ERROR_FILE (set by torch's elastic agent), in the format of torch's
    ErrorHandler.record_exception, which torchrun's failure report shows as the rank's traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        Path(path).write_text(json.dumps(data))
    except OSError:
        pass  # the report then shows the exit code alone; the line itself was printed (or is below)


def split_launch_options(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's options, the rest) of train.py's command line: the options that lead it, each with its value
    (`--nproc_per_node 2` or `--nproc_per_node=2`); `--cfg` and `-h` are train.py's own (raises ConfigError)."""
    if not argv or not argv[0].startswith("-") or argv[0] in ("--cfg", "-h", "--help"):
        return [], argv
    from torch.distributed.run import get_args_parser

    actions = get_args_parser()._option_string_actions
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("--cfg", "-h", "--help"):
        flag, eq, _ = argv[i].partition("=")
        action = actions.get(flag)
        if action is None or action.dest in ("module", "no_python", "run_path"):
            raise ConfigError(
                f"{flag} is not a launch option here: options before the key=value arguments are torchrun's "
                "(--nproc_per_node N, --nnodes N, --rdzv_backend, --rdzv_endpoint, --max-restarts, ...), and the "
                "ranks run scripts/train.py"
            )
        i += 1 if eq or action.nargs == 0 else 2
    return argv[:i], argv[i:]


# The agent's own log lines about a failed rank ("failed (exitcode: 2) local_rank: 0 ...", "Sending process ...
# closing signal SIGTERM"): launch_ranks reports the failure itself, in one line.
_AGENT_FAILURE_LOGS = ("failed (exitcode: ", "Sending process ")


def launch_ranks(options: list[str], args: list[str]) -> int:
    """scripts/train.py on the ranks that torchrun's `options` describe, started as torchrun starts them (its
    `run`: rendezvous, restarts, signals forwarded); returns the exit status. A failed job is reported in one line:
    the user mistake a rank recorded (`user_error_exit`, exit status 2), else which rank stopped and how (1)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torchrun's default of one intra-op thread per rank, set here rather than announced in its 4-line banner.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[LAUNCHED] = "1"
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    agent_log.addFilter(lambda record: not str(record.msg).startswith(_AGENT_FAILURE_LOGS))
    try:
        run(parse_args([*options, str(TRAIN_SCRIPT), *args]))
    except ChildFailedError as exc:
        line, status = failure_line(exc)
        print(line, file=sys.stderr, flush=True)
        return status
    except SignalException as exc:  # Ctrl-C, scancel: the agent passed the signal on to the ranks and stopped them
        print(f"kiln: stopped by {exc.sigval.name}; the ranks were stopped with it", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    return 0


def failure_line(exc) -> tuple[str, int]:
    """(the one line, the exit status) for torch's ChildFailedError: the Kiln error a rank recorded (the earliest;
    the ranks of one mistake record the same line), else the rank that failed first and its exit code or signal."""
    recorded = {
        rank: f
        for rank, f in exc.failures.items()
        if isinstance(f.message, dict) and str(f.message.get("message", "")).startswith("kiln: ")
    }
    if recorded:
        rank = min(recorded, key=lambda r: (recorded[r].timestamp, r))
        return recorded[rank].message["message"], 2
    rank, failure = exc.get_first_failure()
    how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    return f"kiln: error: rank {rank} failed ({how}; its output is above) and the other ranks were stopped", 1


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
    layout = configured_layout(
        spec,
        dp=dims.dp,
        tp=dims.tp,
        pp=dims.pp,
        zero_stage=cfg.parallel.zero_stage,
        ac=cfg.toggles.activation_checkpointing,
        ep=cfg.parallel.ep,
        cp=dims.cp,
    )
    print(dry_run_report(spec, layout))
    if cfg.parallel.dp <= 0:
        print("(sized for this launch's world size; set parallel.dp=N to size for N GPUs)")


def run_recipe(trainer) -> None:
    """Every family's run, from its spec's trainer (recipes/registry.py): train, the family's end-of-training hook,
    evaluate and print its summary line, export (rank 0 prints where), then its after-export hook."""
    trainer.fit()
    trainer.after_fit()
    if trainer.cfg.trainer.eval:
        result = trainer.evaluate()
        if result is not None and trainer.dist.is_main:
            print(trainer.eval_summary(result), flush=True)
    out = trainer.export()
    if trainer.dist.is_main:
        print(f"kiln: exported to {out}", flush=True)
        trainer.after_export(out)


def merge_profiles() -> None:
    """The post-run step of a profiled run: its per-rank traces merged into one timeline and the step breakdown
    (scripts/kiln/traces.py), from what common/profiling.py left (rank 0's)."""
    from common.profiling import take_traces

    for out, run_dir in take_traces():
        from scripts.kiln.traces import merge_traces, write_summary

        try:
            merge_traces(out)
            write_summary(run_dir)
        except Exception as exc:  # a report must never cost the run its outputs
            print(f"kiln: warning: could not merge profiler traces in {out}: {exc!r}", flush=True)


def _launch_options(argv: list[str]) -> tuple[list[str], list[str]]:
    """The options that start ranks, and the rest of ``argv``; a one-line exit when they are given inside a rank."""
    try:
        options, argv = split_launch_options(argv)
        if options and "LOCAL_RANK" in os.environ:
            raise ConfigError(
                f"{options[0]} starts ranks, and this is one already (torchrun): pass only key=value arguments here"
            )
    except ConfigError as exc:
        raise user_error_exit(str(exc)) from None
    return options, argv


def main(argv: list[str], registry=None) -> int:
    """scripts/train.py's command line; `registry`: the table of families (recipes/registry.py), handed in."""
    global _REGISTRY
    from common.known_warnings import silence_known_warnings

    if registry is not None:
        _REGISTRY = registry

    silence_known_warnings()
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE.format(recipes=", ".join(_recipes())))
        return 0
    options, argv = _launch_options(argv)
    if options:
        return launch_ranks(options, argv)
    print_cfg = "--cfg" in argv
    overrides = [a for a in argv if a != "--cfg"]
    try:
        # The layout first (the world size is torchrun's WORLD_SIZE, 1 for one process); --cfg prints any layout.
        # `dims`: the run's one ParallelDims (None for --cfg and a dry run, which sizes any layout).
        world_size = None if print_cfg else int(os.environ.get("WORLD_SIZE", "1"))
        cfg, dims = compose_run(overrides, world_size, registry=current_registry())
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
        spec = current_registry().recipe_spec(cfg.recipe.family)
        if cfg.run.dry_run:
            if dist.is_main:
                dry_run(cfg, spec.sizing().memory_spec(cfg), dist.world_size)
            return 0
        run_dir = resolve_run_dir(cfg)
        if dist.is_main:
            created = None if run_dir.exists() else run_dir
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
            print(
                f"kiln: {cfg.recipe.name} on {dist.world_size} rank(s), device {dist.device}, run.dir={run_dir}",
                flush=True,
            )
        run_recipe(spec.trainer(cfg, dist, run_dir, dims))
        merge_profiles()
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
