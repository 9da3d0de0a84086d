#!/usr/bin/env python
"""Plan parallel layouts for a recipe: per-GPU memory of every layout it allows, those that fit, best first.

    python scripts/plan.py recipe=llm_8b cluster.gpus=8 cluster.gpu=h100_80gb [key=value ...] [--all] [--json]

cluster.gpus      number of GPUs (required)
cluster.gpu       one of: {gpus}
cluster.headroom  fraction of GPU memory the plan may fill (default 0.9: allocator fragmentation,
                  CUDA context, NCCL and kernel workspaces)
--all             also list the layouts that do not fit
--json            print the plan as JSON instead of a table
--fill            also the largest micro batch (a multiple of 8) at which the first-ranked layout fits: the
                  micro batch that fills the GPU (JSON: "fill": {"micro_batch": N, "layout": {...}})

Other key=value arguments are recipe overrides (trainer.micro_batch_size=2, data.max_seq_len=4096,
toggles.precision=fp32, finetune=lora, ...); parallel.* and toggles.activation_checkpointing are what the plan
varies. finetune=lora is priced without its base (model.init_from is not read): the adapter's weights, gradients
and Adam state, the frozen base's weights only.
The arithmetic, its sources and the ranking rule are in common/memory.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from common.config import TrainConfig  # noqa: E402
from common.deepspeed import check_cp_zero3  # noqa: E402
from common.errors import ConfigError  # noqa: E402
from common.memory import GIB, MEMORY_COLUMNS, Layout, ModelSpec, configured_layout  # noqa: E402
from recipes.registry import recipe_spec  # noqa: E402
from scripts.kiln.planner import GPUS, fill_micro_batch, plan  # noqa: E402


@dataclasses.dataclass
class Cluster:
    gpus: int = 0
    gpu: str = "h100_80gb"
    headroom: float = 0.9


def parse_cluster(argv: list[str]) -> tuple[Cluster, list[str]]:
    """Split the planner's own cluster.* keys off the recipe overrides and check them."""
    cluster, overrides = Cluster(), []
    fields = {f.name: f.type for f in dataclasses.fields(Cluster)}
    for arg in argv:
        if not arg.startswith("cluster."):
            overrides.append(arg)
            continue
        key, _, value = arg[len("cluster.") :].partition("=")
        if key not in fields:
            raise ConfigError(f"unknown key 'cluster.{key}'; cluster keys: {', '.join(fields)}")
        kind = {"int": (int, "an integer"), "float": (float, "a number")}.get(fields[key], (str, "a name"))
        try:
            setattr(cluster, key, kind[0](value))
        except ValueError:
            raise ConfigError(f"bad value for 'cluster.{key}': {value!r} is not {kind[1]}") from None
    if cluster.gpus < 1:
        raise ConfigError("cluster.gpus=N (the number of GPUs, >= 1) is required")
    if cluster.gpu not in GPUS:
        raise ConfigError(f"unknown cluster.gpu={cluster.gpu!r}; choose one of: {', '.join(GPUS)}")
    if not 0.0 < cluster.headroom <= 1.0:
        raise ConfigError(f"cluster.headroom={cluster.headroom} must be in (0, 1]")
    return cluster, overrides


def model_spec(cfg: TrainConfig) -> ModelSpec:
    """The recipe's own description of its model (recipes/<family>/sizing.py:memory_spec), as run.dry_run uses."""
    return recipe_spec(cfg.recipe.family).sizing().memory_spec(cfg)


def compose_for_plan(overrides: list[str]) -> tuple[TrainConfig, str]:
    """(the recipe's config for sizing, why its preset layout was refused or ""). Composed as run.dry_run, which
    reads no weights (finetune=lora is sized without its base). The plan varies parallel.*: where the recipe's
    preset layout cannot run with these keys (llm_8b's tp=8 under finetune=lora) and the command line names no
    parallel.* key, it is composed on one GPU's layout (tp = pp = 1) instead."""
    from scripts.kiln.launch import compose

    sizing = [*overrides, *([] if any(o.startswith("run.dry_run=") for o in overrides) else ["run.dry_run=true"])]
    try:
        return compose(sizing), ""
    except ConfigError as exc:
        if any(o.startswith("parallel.") for o in overrides):
            raise
        try:
            return compose([*sizing, "parallel.tp=1", "parallel.pp=1"]), str(exc)
        except ConfigError:
            raise exc from None


def with_layout(cfg: TrainConfig, layout: Layout) -> TrainConfig | None:
    """`cfg` with `layout`'s degrees set, or None where the family's `parallel` schema has no key for one of
    them and the layout needs another value than the family's only one (DiT/VLM: tp = pp = 1). A layout's
    zero_stage is a key only where the family has it: the LLM's FSDP layouts carry 3 for full sharding."""
    own = {f.name for f in dataclasses.fields(cfg.parallel)}
    keys = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "cp": layout.cp}
    if "zero_stage" in own:
        keys["zero_stage"] = layout.zero_stage
    if any(getattr(cfg.parallel, k) != v for k, v in keys.items() if k not in own):
        return None
    parallel = dataclasses.replace(cfg.parallel, **{k: v for k, v in keys.items() if k in own})
    toggles = dataclasses.replace(cfg.toggles, activation_checkpointing=layout.ac)
    return dataclasses.replace(cfg, parallel=parallel, toggles=toggles)


def recipe_allows(cfg: TrainConfig, spec: ModelSpec):
    """The recipe's schema and its own validation decide which layouts it can run (e.g. DiT/VLM: tp = pp = 1), and
    DeepSpeed's engine start which it refuses (cp x ZeRO-3 with a parameter over the reduce bucket)."""
    validate = recipe_spec(cfg.recipe.family).config.validate

    def allows(layout: Layout) -> bool:
        laid_out = with_layout(cfg, layout)
        if laid_out is None:
            return False
        try:
            validate(laid_out)
            if spec.sharding == "deepspeed":
                check_cp_zero3(laid_out, spec.largest_trainable)
        except ConfigError:
            return False
        return True

    return allows


# ---- output -------------------------------------------------------------------------------------

COLUMNS = MEMORY_COLUMNS
HEADERS = ("weights", "grads", "optim", "gathered", "activ", "transient", "total")


def table(spec: ModelSpec, rows: list[dict], cluster: Cluster, configured: Layout, show_all: bool = False) -> str:
    gpu = GPUS[cluster.gpu]
    budget = gpu.memory * cluster.headroom
    fit = sum(r["fits"] for r in rows)
    lines = [
        f"{spec.name}: {spec.total_params:,} parameters, {spec.precision}, micro batch {spec.micro_batch} x "
        f"{spec.seq} tokens on {cluster.gpus} x {gpu.name} ({gpu.memory / GIB:.1f} GiB, plan to "
        f"{budget / GIB:.1f} GiB at headroom {cluster.headroom})",
        f"{fit} of {len(rows)} layouts the recipe allows fit; GiB per GPU at the worst pipeline rank",
        "",
        f"{'#':>3} {'dp':>3} {'tp':>3} {'pp':>3} {'ep':>3} {'cp':>3} {'shard':>6} {'AC':>9} "
        + " ".join(f"{h:>9}" for h in HEADERS)
        + "   use",
    ]
    for i, r in enumerate(rows if show_all else rows[:fit], 1):
        lay = r["layout"]
        mark = "*" if lay == configured else " "
        cells = " ".join(f"{r[c] / GIB:9.2f}" for c in COLUMNS)
        note = "" if r["fits"] else "  does not fit"
        lines.append(
            f"{i:>3}{mark}{lay.dp:>3} {lay.tp:>3} {lay.pp:>3} {lay.ep:>3} {lay.cp:>3} {lay.sharding(spec):>6} "
            f"{lay.ac:>9} {cells} "
            f"{r['total'] / gpu.memory:5.0%}{note}"
        )
    lines += [
        "",
        "* the recipe's configured layout. Ranked: less recomputation, smaller tp*pp*cp, less pp, less tp, lower "
        "ZeRO stage, less memory (common/memory.py:rank_key).",
        "gathered: ZeRO-3/FSDP unit (or autocast bf16 copies); transient: logits at the loss or one layer "
        "recomputed in backward (plus, under cp, one layer's exchange: the all-gathered keys/values and, under "
        "SDPA, mask rows, or the all-to-all's send and receive buffers and, under SDPA, the whole row's mask).",
        *([spec.note] if spec.note else []),
    ]
    return "\n".join(lines)


def fill(spec: ModelSpec, rows: list[dict], cluster: Cluster) -> dict | None:
    """--fill: the first-ranked fitting layout and the largest micro batch it fits at (None where none fits)."""
    best = next((r["layout"] for r in rows if r["fits"]), None)
    if best is None:
        return None
    micro = fill_micro_batch(spec, best, GPUS[cluster.gpu], cluster.headroom)
    return {"micro_batch": micro, "layout": dataclasses.asdict(best)}


def fill_line(spec: ModelSpec, filled: dict | None) -> str:
    if filled is None:
        return "--fill: no layout fits at this micro batch"
    lay = filled["layout"]
    return (
        f"--fill: micro batch {filled['micro_batch']} (a multiple of 8) fills layout #1 (dp {lay['dp']}, ZeRO-"
        f"{lay['zero_stage']}, AC {lay['ac']}) to the headroom; the recipe's is {spec.micro_batch}"
    )


def as_json(spec: ModelSpec, rows: list[dict], cluster: Cluster, filled: dict | None = None) -> str:
    gpu = GPUS[cluster.gpu]
    layouts = [
        {
            **dataclasses.asdict(r["layout"]),
            "sharding": r["layout"].sharding(spec),
            "fits": r["fits"],
            "pipeline_rank": r["rank"],
            **{f"{c}_bytes": r[c] for c in COLUMNS},
        }
        for r in rows
    ]
    return json.dumps(
        {
            "recipe": spec.name,
            "params": spec.total_params,
            "gpu": gpu.name,
            "gpus": cluster.gpus,
            "gpu_memory_bytes": gpu.memory,
            "headroom": cluster.headroom,
            "note": spec.note,
            "layouts": layouts,
            **({"fill": filled} if filled is not None else {}),
        },
        indent=2,
    )


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.format(gpus=", ".join(GPUS)))
        return 0
    flags = {a for a in argv if a in ("--all", "--json", "--fill")}
    try:
        cluster, overrides = parse_cluster([a for a in argv if a not in flags])
        cfg, refused = compose_for_plan(overrides)
        spec = model_spec(cfg)  # a model the recipe cannot size (t2i: a pipeline of no known shape) is one line too
    except ConfigError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2
    rows = plan(spec, cluster.gpus, GPUS[cluster.gpu], cluster.headroom, allowed=recipe_allows(cfg, spec))
    filled = fill(spec, rows, cluster) if "--fill" in flags else None
    if "--json" in flags:
        print(as_json(spec, rows, cluster, filled))
        return 0
    p = cfg.parallel
    configured = configured_layout(
        spec,
        dp=cluster.gpus // (p.tp * p.pp * p.cp),
        tp=p.tp,
        pp=p.pp,
        zero_stage=p.zero_stage,
        ac=cfg.toggles.activation_checkpointing,
        ep=p.ep,
        cp=p.cp,
    )
    if refused:
        print(f"kiln: the recipe's own layout is refused here ({refused}); planned from one GPU's layout instead\n")
    print(table(spec, rows, cluster, configured, show_all="--all" in flags))
    if "--fill" in flags:
        print(fill_line(spec, filled))
    return 0


if __name__ == "__main__":
    from common.known_warnings import silence_known_warnings

    silence_known_warnings()  # before the recipes import transformers/peft/diffusers (and torchao with them)
    sys.exit(main(sys.argv[1:]))
