#!/usr/bin/env python
"""Consolidate an LLM run's sharded (DCP) checkpoint into a Hugging Face folder, in one process.

    python scripts/export.py RUN_DIR [--checkpoint PATH] [--out DIR]

Works whatever parallel layout wrote the checkpoint. The folder loads with
AutoModelForCausalLM/AutoTokenizer offline and serves with `vllm serve DIR --tensor-parallel-size N`.
A run that started from model.init_from is exported in that checkpoint's format: its config.json,
generation_config.json, tokenizer and chat template, in its weights' dtype. A finetune=lora run (its checkpoints
hold the adapter only) is exported as the end of its run exports it: a PEFT adapter folder on model.init_from, and
with export.merge_lora (or --merge-lora) the merged model in OUT/merged.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--checkpoint", default="auto", help="a step_* dir (default: the run's latest)")
    ap.add_argument("--out", type=Path, default=None, help="default: RUN_DIR/export")
    ap.add_argument("--merge-lora", action="store_true", help="finetune=lora runs: also write the merged model")
    args = ap.parse_args(argv)
    if not (args.run_dir / "config.yaml").exists():
        print(f"export: error: {args.run_dir} has no config.yaml (not a Kiln run dir)", file=sys.stderr)
        return 2

    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf

    from common.checkpoint import CheckpointManager
    from common.errors import UserError
    from recipes.llm import hf
    from recipes.llm.config import LLMModelConfig
    from recipes.llm.data import load_tokenizer
    from recipes.llm.model import Transformer
    from recipes.llm.train import llama_args

    cfg = OmegaConf.load(args.run_dir / "config.yaml")
    if cfg.recipe.family != "llm":
        print(f"export: error: {args.run_dir} is a {cfg.recipe.family} run; this script exports LLM runs", file=sys.stderr)
        return 2
    try:
        if args.checkpoint == "auto":
            ckpt = CheckpointManager.__new__(CheckpointManager)
            ckpt.root = args.run_dir / "checkpoints"
            path = ckpt.latest()
        else:
            path = Path(args.checkpoint)
        if path is None or not (path / "dcp").exists():
            raise UserError(f"no complete DCP checkpoint under {args.run_dir}")
    except UserError as exc:
        print(f"export: error: {exc}", file=sys.stderr)
        return 2
    # Runs from before model.init_from and friends existed get those keys' defaults.
    cfg.model = OmegaConf.merge(OmegaConf.structured(LLMModelConfig), cfg.model)
    source = cfg.model.init_from or None
    if source and not Path(source).is_dir():
        print(f"export: error: the run started from model.init_from={source}, which is gone (its config and "
              "tokenizer go into the export)", file=sys.stderr)
        return 2
    tokenizer = hf.load_tokenizer(source) if source else load_tokenizer(cfg.data.root)
    largs = llama_args(cfg, len(tokenizer))
    out = args.out or args.run_dir / "export"
    if cfg.get("finetune", "full") == "lora":
        from common.lora import dequantized, is_adapter_key
        from recipes.llm import lora

        model = lora.adapted_model(largs, cfg)  # the base from model.init_from
        adapter = {k: v for k, v in model.state_dict().items() if is_adapter_key(k)}
        dcp.load({"model": adapter}, checkpoint_id=str(path / "dcp"))  # in place: the model's own tensors
        cfg.export.merge_lora = cfg.export.merge_lora or args.merge_lora
        shutil.rmtree(out, ignore_errors=True)
        lora.write_export(dequantized(model.state_dict()), largs, cfg, out, tokenizer=tokenizer)
        print(f"export: {path} -> {out} (a LoRA adapter of {sum(v.numel() for v in adapter.values()):,} parameters "
              f"on {source}{'; merged model in ' + str(out / 'merged') if cfg.export.merge_lora else ''})")
        return 0
    model = Transformer(largs)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path / "dcp"))  # no process group: loads every shard here
    hf.write_hf_folder(state["model"], largs, out, tokenizer=tokenizer, source=source)
    print(f"export: {path} -> {out} ({sum(p.numel() for p in model.parameters()):,} parameters)")
    return 0


if __name__ == "__main__":
    from common.known_warnings import silence_known_warnings

    silence_known_warnings()
    sys.exit(main())
