"""A training run's config from its command line: configs/train.yaml composed with key=value overrides (Hydra),
typed (common/config.py) and validated, each family's part by its spec (the registry the caller hands in). User
mistakes raise ConfigError with one line naming the key. The entry point (scripts/kiln/launch.py) and the CLIs that
need a run's config (data/cache_latents.py) call it."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from common.config import TrainConfig, register, validate
from common.errors import ConfigError
from common.parallel_dims import ParallelDims

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def _recipes() -> list[str]:
    return _options("recipe")


def _options(group: str) -> list[str]:
    """The choices of a config group: its configs/<group>/*.yaml."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def explain_compose_error(exc: Exception) -> str:
    """One line from Hydra/OmegaConf's multi-line composition errors."""
    from hydra.errors import MissingConfigException

    if isinstance(exc, MissingConfigException):
        first = str(exc).splitlines()[0]
        if "recipe/" in first:
            return f"no such recipe ({first.split(': ', 1)[-1]}); available: {', '.join(_recipes())}"
        # Any other group (finetune=, model=, data=, ...): its options, as for a recipe.
        group = re.search(r"Could not find '(\w+)/(.+)'", first)
        if group and (CONFIG_DIR / group[1]).is_dir():
            return f"no such {group[1]} ({group[1]}={group[2]}); choose one of: {', '.join(_options(group[1]))}"
        return first
    cause = exc.__cause__ or exc
    key = getattr(cause, "full_key", None)
    message = str(cause).splitlines()[0]
    if key and "not in" in message:
        return f"unknown config key '{key}' ({message})"
    if key:
        return f"bad value for '{key}': {message}"
    return " ".join(str(exc).split())


# A `~` that starts a path in a value: at its start, or starting a list item, a dict value or a quoted string
# (`key=~/x`, `key=[~/a,~/b]`, `key={a:~/x}`, `key="~/x"`), followed by `/` or the value's end.
_HOME = re.compile(r"(?<![^\[{,:'\"\s])~(?=/|$|[\]},'\"\s])")


def parse_overrides(overrides: list[str]) -> list[str]:
    """The command line's overrides with `~` expanded in their values, each checked against Hydra's grammar:
    the one reader of train.py's and serve.py's key=value arguments (raises ConfigError naming an argument).

    The shell leaves a `~` after `key=` alone (it is not a word's start, and `model.init_from` is no variable
    name), and Hydra's grammar has no unquoted `~`: `model.init_from=~/models/x` would be a parse error."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser, expanded = OverridesParser.create(), []
    for given in overrides:
        key, sep, value = given.partition("=")  # a key never holds `~` but as Hydra's delete (`~key`)
        override = f"{key}={_HOME.sub(lambda _: os.path.expanduser('~'), value)}" if sep else given
        try:
            parser.parse_overrides([override])
        except OverrideParseException as exc:
            raise ConfigError(
                f"cannot read the argument {given!r}: {_parse_error(override, exc)} (quote a value "
                "with special characters: 'key=\"...\"')"
            ) from None
        expanded.append(override)
    return expanded


def _parse_error(override: str, exc: Exception) -> str:
    """Hydra's parse error in a few words: the character its lexer stopped at, else the parser's first line."""
    lines = str(exc).splitlines()
    lexer = "LexerNoViableAltException: "
    if lines[0].startswith(lexer) and len(lines) > 1 and "^" in lines[1]:
        column = lines[1].index("^") - len(lexer)
        if 0 <= column < len(override):
            return f"unexpected {override[column]!r} at character {column + 1}"
    reasons = [line for line in lines if line.strip() and not line.startswith(("See https:", "Error parsing override"))]
    return reasons[0] if reasons else "not a key=value override"


def compose(overrides: list[str], world_size: int | None = None, *, registry) -> TrainConfig:
    """Composed, typed and validated config (raises ConfigError): :func:`compose_run`'s, without its layout."""
    return compose_run(overrides, world_size, registry=registry)[0]


def compose_run(
    overrides: list[str], world_size: int | None = None, *, registry
) -> tuple[TrainConfig, ParallelDims | None]:
    """Composed, typed and validated config (raises ConfigError), and with `world_size` (the ranks this job started;
    not for a dry run, which sizes any layout) its layout (ParallelDims), checked first: a job started with the wrong
    number of ranks hears that before anything else. The launcher hands that layout to the trainer: the one
    ParallelDims of a run. `registry` is the table of families (recipes/registry.py, handed in by the entry point:
    common/ imports nothing above it): its specs() and recipe_spec(family)."""
    from omegaconf.errors import OmegaConfBaseException

    from common import grpo, lora, preference
    from common.diffusion import latents

    families = list(registry.specs().values())
    register(
        (name for spec in families for name in spec.sections),
        (schema for spec in families for schema in spec.config.SCHEMAS),
    )
    overrides = rename_overrides(parse_overrides(overrides), families)
    try:
        cfg: TrainConfig = OmegaConf.to_object(_hydra_compose(overrides, families))
    except (OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(explain_compose_error(exc)) from None
    spec = registry.recipe_spec(cfg.recipe.family)
    dims = check_layout(cfg.parallel, world_size) if world_size is not None and not cfg.run.dry_run else None
    validate(cfg)
    preference.check_config(cfg.preference, cfg.recipe.family, spec.preference)  # one line for what cannot run
    grpo.check_config(cfg.grpo, cfg.reward, cfg.recipe.family, spec.grpo)
    check_export_formats(cfg.export.formats, spec)
    complete_cp_method(cfg.parallel, spec)
    given = command_line_keys(overrides)
    lora.complete(cfg, spec, given)  # finetune=lora: the family's default targets, checked
    spec.config.complete(cfg, given)  # keys filled from files (the LLM: model.init_from)
    # data.latents=auto: the cache beside data.root if there, else on the fly (one note when a training launch composes)
    training = world_size is not None and not cfg.run.dry_run
    latents.resolve(cfg, note=training)
    spec.config.validate(cfg)  # first: what the recipe refuses whatever the folder holds (data.buckets with a cache)
    if training and (missing := latents.missing_cache(cfg)):
        raise ConfigError(missing)
    return cfg, dims


def check_layout(p, world_size: int) -> ParallelDims | None:
    """The degrees against the world size (dp * tp * pp * cp == ranks, ep within dp x cp): the run's ParallelDims. A
    degree that is no degree at all (0, negative) is left to validate(), which names its key (None here)."""
    if min(p.tp, p.pp, p.cp, p.ep) < 1 or p.dp == 0 or p.dp < -1:
        return None
    return ParallelDims.from_config(p, world_size)


def check_export_formats(formats: list[str], spec) -> None:
    """One line for an export.formats entry the family does not write (its spec's export_formats)."""
    for name in formats:
        if name not in spec.export_formats:
            title = spec.title or spec.family
            offered = ", ".join(spec.export_formats) or "none"
            raise ConfigError(f"export.formats: the {title} recipes do not write {name!r} (they write: {offered})")


def complete_cp_method(p, spec) -> None:
    """parallel.cp_method from the family: its spec's `cp_methods` (recipes/registry.py), the first its default where
    no config or command line set one (the shared schema's "" means "the family's default"), any other refused in one
    line. A family that declares none (a plugin's) is left as it is."""
    methods = spec.cp_methods
    if not methods:
        return
    if not p.cp_method:
        p.cp_method = methods[0]
    elif p.cp_method not in methods:
        raise ConfigError(
            f"parallel.cp_method={p.cp_method!r} is not in the {spec.title or spec.family} recipe; choose one of: "
            f"{', '.join(methods)}"
        )


def _hydra_compose(overrides: list[str], families) -> DictConfig:
    """configs/train.yaml composed with `overrides`, untyped (raises ConfigError)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    # Families from outside the checkout bring their config groups in their own folder.
    extra = [f"file://{spec.config_dir}" for spec in families if spec.config_dir is not None]
    search = [f"hydra.searchpath=[{','.join(extra)}]"] if extra else []
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return hydra_compose(config_name="train", overrides=[*overrides, *search])
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(explain_compose_error(exc)) from None


_NOTED: set[str] = set()  # renamed keys already noted by this process (scripts/plan.py may compose twice)


def rename_overrides(overrides: list[str], families) -> list[str]:
    """`overrides` with each key that the recipe's family renamed (its spec's `renamed`) spelled the new way, and one
    `kiln: note:` line on stderr per old key: an old spelling works for one release. The family is the recipe's,
    which composition decides, so a command line holding an old key of any family is composed once without those
    keys to learn it. An old key of another family than the recipe's is left alone: composition refuses it as it
    refuses any key the family does not have."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    old = {key for spec in families for key in spec.renamed}
    parser = OverridesParser.create()
    keys = [parser.parse_override(o).key_or_group for o in overrides]
    if not old.intersection(keys):
        return overrides
    probe = _hydra_compose([o for o, key in zip(overrides, keys) if key not in old], families)
    family = OmegaConf.select(probe, "recipe.family", default=None)
    renamed = next((spec.renamed for spec in families if spec.family == family), {})
    spelled = []
    for override, key in zip(overrides, keys):
        if key in renamed:
            start = override.index(key)  # after a `+`, `++` or `~`
            override = f"{override[:start]}{renamed[key]}{override[start + len(key) :]}"
            if key not in _NOTED and os.environ.get("RANK", "0") == "0":
                print(
                    f"kiln: note: {key} is now {renamed[key]}; the old name is accepted until the next release",
                    file=sys.stderr,
                    flush=True,
                )
            _NOTED.add(key)
        spelled.append(override)
    return spelled


def command_line_keys(overrides: list[str]) -> set[str]:
    """The dotted keys that ``overrides`` set (``model.dim=64`` -> ``model.dim``; a group choice such as
    ``model=llm_8b`` gives ``model``): what a recipe must not silently replace."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return {o.key_or_group for o in OverridesParser.create().parse_overrides(overrides)}
