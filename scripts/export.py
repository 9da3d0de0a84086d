#!/usr/bin/env python
"""Export a run's checkpoint (any step, any layout) to the folder its family serves from, in one process.

    python scripts/export.py RUN_DIR [--checkpoint step_N|PATH] [--out DIR] [--merge-lora] [--max-shard-size 1GB]
                             [--format gguf [--gguf-type f16|bf16|q8_0]]

The folder equals the end-of-run export of the same step, tensor for tensor. Without --out it is RUN_DIR/export when
exporting the latest checkpoint of a run that has no export yet (a preempted run), else RUN_DIR/exports/step_N: an
export already there is never replaced unasked.

LLM runs (DCP checkpoints, any parallel layout): a Hugging Face folder that loads with
AutoModelForCausalLM/AutoTokenizer offline and serves with `vllm serve DIR --tensor-parallel-size N`.
A run that started from model.init_from is exported in that checkpoint's format: its config.json,
generation_config.json, tokenizer and chat template, in its weights' dtype.

DiT and VLM runs (DeepSpeed checkpoints, ZeRO 0-3, any number of ranks): the DiT's diffusers folder (EMA weights;
a DiTPipeline for latent DDPM models) or the VLM's llava-hf folder. Tensors stream from the checkpoint's files
to safetensors shards of at most --max-shard-size, so host memory stays near one shard, not the model
(common/ds_export.py).

--format adds what export.formats adds at the end of a run (the run's own export.formats are written too): the LLM's
gguf, OUT/gguf/model-<type>.gguf for llama.cpp with an ollama Modelfile beside it (recipes/llm/gguf_export.py; under
finetune=lora with --merge-lora the merged model's, else model.init_from's with the adapter beside it as a GGUF LoRA,
OUT/gguf/adapter-f32.gguf, which the Modelfile's ADAPTER names). --gguf-type sets export.gguf_type.

finetune=lora runs of every family (their checkpoints hold the adapter only): the PEFT adapter folder on
model.init_from the end of the run writes -- the LLM's adapter with its tokenizer, the VLM's language-model adapter
with the projector (peft's modules_to_save) and the processor, the DiT's EMA adapter -- and with export.merge_lora
(or --merge-lora) the merged model in OUT/merged (the DiT's: a whole DiT export). The adapter is small, so the
base is loaded whole in host memory, once, as the trainer loads it (the merged model needs it anyway); a base
that is gone, or whose files changed since the run (the fingerprint in the checkpoint's meta.json), stops with
one line.

What a family exports, and from what base, is its spec's (recipes/registry.py: recipes/<family>/export.py's
export_checkpoint, export_lora_checkpoint and lora_base); this script only finds the checkpoint, checks the LoRA base
and moves the finished folder into place.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fail(msg: str) -> int:
    print(f"export: error: {msg}", file=sys.stderr)
    return 2


def find_checkpoint(run_dir: Path, name: str) -> Path:
    """The checkpoint dir `--checkpoint` names: `auto` (the run's latest), a path, or a dir under RUN_DIR/checkpoints
    (`step_0000500`, or `step_500`)."""
    from common.checkpoint import STEP_PREFIX, CheckpointManager, step_dir_name
    from common.errors import UserError

    if name == "auto":
        ckpt = CheckpointManager.__new__(CheckpointManager)
        ckpt.root = run_dir / "checkpoints"
        path = ckpt.latest()
        if path is None:
            raise UserError(f"no complete checkpoint under {run_dir}/checkpoints")
        return path
    candidates = [Path(name), run_dir / "checkpoints" / name]
    number = name.removeprefix(STEP_PREFIX)
    if name.startswith(STEP_PREFIX) and number.isdigit():
        candidates.append(run_dir / "checkpoints" / step_dir_name(int(number)))
    for path in candidates:
        if (path / "meta.json").exists():
            return path
    raise UserError(
        f"--checkpoint {name} is not a checkpoint (a step_* dir with meta.json, in {run_dir}/checkpoints or a path)"
    )


def default_out(run_dir: Path, checkpoint: str, step: int) -> Path:
    """Where an export goes without --out: RUN_DIR/export for the run's latest checkpoint when the run has no export
    yet (a preempted run), else RUN_DIR/exports/step_N, beside it: the end-of-run export is never replaced unasked
    (and neither is an earlier exports/step_N: main refuses). Not inside export/, which a resumed run that finishes
    writes anew."""
    export = run_dir / "export"
    return export if checkpoint == "auto" and not export.exists() else run_dir / "exports" / f"step_{step}"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument(
        "--checkpoint",
        default="auto",
        help="a step_* dir or its name under RUN_DIR/checkpoints (default: the run's latest)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="replaced if it exists (default: RUN_DIR/export for the latest checkpoint of a run without an "
        "export, else RUN_DIR/exports/step_N)",
    )
    ap.add_argument(
        "--merge-lora",
        action="store_true",
        help="finetune=lora runs (LLM, VLM, DiT): also write the merged model in OUT/merged, as export.merge_lora does",
    )
    ap.add_argument(
        "--max-shard-size",
        default=None,
        help="full DiT/VLM runs: the largest safetensors file, what host memory is bounded by (default 1GB)",
    )
    ap.add_argument(
        "--format",
        action="append",
        default=[],
        metavar="NAME",
        help="also write this export.formats entry (the LLM: gguf); repeatable",
    )
    ap.add_argument("--gguf-type", default=None, help="with --format gguf: export.gguf_type (f16, bf16, q8_0)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not (args.run_dir / "config.yaml").exists():
        return fail(f"{args.run_dir} has no config.yaml (not a Kiln run dir)")

    from omegaconf import OmegaConf

    from common.checkpoint import read_meta
    from common.config import rename_saved
    from common.errors import UserError
    from recipes.registry import recipe_spec

    cfg = OmegaConf.load(args.run_dir / "config.yaml")
    try:
        path = find_checkpoint(args.run_dir, args.checkpoint)
        meta = read_meta(path)
    except (UserError, ValueError) as exc:
        return fail(str(exc))
    if meta.get("recipe") != cfg.recipe.name:
        return fail(f"{path} is a checkpoint of recipe {meta.get('recipe')}; {args.run_dir} ran {cfg.recipe.name}")
    out = args.out or default_out(args.run_dir, args.checkpoint, int(meta["step"]))
    if args.out is None and out.exists():
        return fail(
            f"{out} exists (an earlier export of this checkpoint): pass --out DIR to write it elsewhere "
            "(an existing --out is replaced)"
        )
    lora = cfg.get("finetune", "full") == "lora"
    if args.merge_lora and not lora:
        return fail(
            f"--merge-lora is for finetune=lora runs ({args.run_dir} is a finetune={cfg.get('finetune', 'full')} "
            "run: its export is the whole model)"
        )
    # The export is written beside `out` and moved into place when whole. Whatever stops it (a one-line refusal, an
    # error, an interrupt) removes what it wrote: the temp folder, and the folders it made for it (exports/).
    tmp = out.with_name(f".{out.name}.tmp")
    made = [d for d in out.parents if not d.exists()]  # deepest first
    done = False
    try:
        spec = recipe_spec(cfg.recipe.family)
        rename_saved(cfg, spec.renamed)  # a run from before a key was renamed reads as a new one
        add_formats(cfg, args, spec)
        exporter = spec.exporter()  # recipes/<family>/export.py
        write = exporter.export_checkpoint
        if lora:
            write = lora_writer(args, cfg, meta, path, exporter)
        shutil.rmtree(tmp, ignore_errors=True)  # a killed export's
        written = write(cfg, path, meta, tmp, max_shard_size=args.max_shard_size)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        done = True
    except UserError as exc:
        return fail(str(exc))
    finally:
        if not done:
            shutil.rmtree(tmp, ignore_errors=True)
            for folder in made:
                with contextlib.suppress(OSError):  # not empty: not only this export's
                    folder.rmdir()
    merged = f"; merged model in {out / 'merged'}" if lora and cfg.export.merge_lora else ""
    print(f"export: {path} -> {out} ({written}{merged})")
    return 0


def add_formats(cfg, args, spec) -> None:
    """cfg.export with this version's keys (a run from before export.formats existed has none), --format's entries
    and --gguf-type in it; UserError for a format the family does not write."""
    from omegaconf import OmegaConf

    from common.compose import check_export_formats
    from common.config import ExportConfig
    from common.errors import UserError

    cfg.export = OmegaConf.merge(OmegaConf.structured(ExportConfig), cfg.get("export") or {})
    cfg.export.formats = list(dict.fromkeys([*cfg.export.formats, *args.format]))
    if args.gguf_type is not None:
        if "gguf" not in cfg.export.formats:
            raise UserError("--gguf-type is for a GGUF export: add --format gguf")
        cfg.export.gguf_type = args.gguf_type
    check_export_formats(list(cfg.export.formats), spec)


def lora_writer(args, cfg, meta: dict, path: Path, exporter):
    """A finetune=lora run's export function, once its base is found unchanged (UserError otherwise): the checkpoints
    hold the adapter only, and the export loads the base from model.init_from. Sets ``export.merge_lora``."""
    from common.errors import UserError

    source = cfg.model.get("init_from") or ""
    if not source:
        raise UserError(
            f"{args.run_dir} is a finetune=lora run without model.init_from in its config.yaml (the adapter's base)"
        )
    if not Path(source).expanduser().is_dir():
        raise UserError(
            f"the run started from model.init_from={source}, which is gone (its checkpoints hold the "
            "adapter only: the export names that base and merges into it)"
        )
    problem = changed_base(meta, path, exporter.lora_base(cfg))
    if problem:
        raise UserError(problem)
    cfg.export.merge_lora = bool(cfg.export.merge_lora or args.merge_lora)
    return exporter.export_lora_checkpoint


def changed_base(meta: dict, path: Path, base: str) -> str | None:
    """One line where ``base`` (the folder the export loads the base from) holds other weights than the base the
    adapter of finetune=lora checkpoint ``path`` trained on (its fingerprint in meta.json): the export would adapt, and
    merge into, another model."""
    from common.errors import ConfigError
    from common.lora import header_only_note, is_header_only, same_base

    saved = (meta.get("lora") or {}).get("base_fingerprint")
    try:
        same = not saved or same_base(saved, base)
    except ConfigError as exc:  # a base file cut short since the run
        return str(exc)
    if saved and is_header_only(saved):
        print(header_only_note(path), flush=True)
    if not same:
        return (
            f"model.init_from={base} holds other weights than the base the adapter of {path} trained on (its "
            "weights differ from the fingerprint in the checkpoint's meta.json)"
        )
    return None


if __name__ == "__main__":
    from common.known_warnings import silence_known_warnings

    silence_known_warnings()
    sys.exit(main())
