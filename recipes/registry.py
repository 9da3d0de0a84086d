"""The recipe families as typed specs (torchtitan's TrainSpec): the one table that the launcher
(scripts/kiln/launch.py), the export CLI (scripts/export.py), the planner (scripts/plan.py) and the benchmarks read.
Nothing outside recipes/ branches on a family's name: what a CLI needs from a family is a field of its spec.

A family is its folder plus one `RecipeSpec` below. It provides:

    recipes/<family>/config.py   its schema: SCHEMAS (its config groups' schemas, for Hydra's ConfigStore),
                                 complete(cfg, command_line_keys), validate(cfg); the spec names its extra top-level
                                 sections (`sections`), the keys it renamed (`renamed`) and what its LoRA may
                                 target (`lora_targets`, `qlora`)
    recipes/<family>/train.py    TRAINER: its common.trainer.Trainer, with evaluate() -> dict | None,
                                 eval_summary(result) -> str, export() -> Path and the after_fit()/after_export(out)
                                 hooks that scripts/kiln/launch.py's run_recipe calls
    recipes/<family>/sizing.py   memory_spec(cfg): the model for the memory model (scripts/plan.py, run.dry_run);
                                 it imports the model, never the trainer
    recipes/<family>/export.py   export from a checkpoint (scripts/export.py): export_checkpoint(cfg, path, meta, out,
                                 max_shard_size=) and, with LoRA, export_lora_checkpoint(...) and lora_base(cfg), each
                                 returning the summary printed after `export: CKPT -> OUT`
    configs/<group>/*.yaml       its recipe, model, data (and parallel) choices; a family outside this checkout names
                                 its own folder of them (`config_dir`)

The schemas are plain dataclasses, imported here; a family's training and export code (transformers, diffusers,
DeepSpeed) is imported by its dotted name only when a run, an export, a plan or a benchmark asks for it.

A family outside recipes/ (a plugin, the tests' toy family) registers itself with `register_family(spec)`, or is
named in the KILN_FAMILIES environment variable (comma-separated modules, each with a `SPEC`), which every process
of a launch reads: scripts/train.py under torchrun and scripts/export.py alike.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from common.errors import ConfigError
from recipes.dit import config as dit_config
from recipes.llm import config as llm_config
from recipes.t2i import config as t2i_config
from recipes.video import config as video_config
from recipes.vlm import config as vlm_config


@dataclass(frozen=True)
class RecipeSpec:
    family: str
    config: ModuleType  # recipes/<family>/config.py: SCHEMAS, complete(cfg, command_line_keys), validate(cfg)
    train_module: str  # recipes/<family>/train.py, imported on demand: TRAINER
    export_module: str  # recipes/<family>/export.py, imported on demand: export from a checkpoint
    # recipes/<family>/sizing.py, imported on demand: memory_spec(cfg) for scripts/plan.py and run.dry_run. "" (a
    # family from outside recipes/ that has none): its train_module's memory_spec.
    sizing_module: str = ""
    # Top-level config sections only this family has (name -> schema), e.g. the DiT's `diffusion`: the shared
    # schema (common/config.py) gets one field per name, None for runs of other families.
    sections: dict[str, type] = field(default_factory=dict)
    # Keys this family renamed, old dotted key -> new (e.g. the VLM's model.patch_size -> model.vision_patch_size):
    # for one release the old spelling on a command line of this family's recipe composes as the new one, with one
    # note (scripts/kiln/launch.py rename_overrides), and an older run's config.yaml reads as if it had the new one
    # (scripts/export.py). Given to another family's recipe, the old key is unknown there as any other.
    renamed: dict[str, str] = field(default_factory=dict)
    lora_targets: tuple[str, ...] = ()  # finetune=lora: the module names its adapters may target; () = no LoRA
    qlora: bool = False  # lora.quantize_base=nf4 is offered
    # data/cache_latents.py: "recipes/<family>/<module>" whose latent_cache(cfg, device) plans the family's latent
    # cache (common/diffusion/latents.py CachePlan); "" = the family has none.
    latent_cache_module: str = ""
    preference: bool = False  # preference.loss (preference optimization: common/preference.py) is offered
    grpo: bool = False  # grpo.enabled (online RL with verifiable rewards: common/grpo.py) is offered
    config_dir: Path | None = None  # a folder of config groups (recipe/, model/, ...) beside configs/
    # Context parallelism: parallel.cp_method's choices in this family, its default first (common/compose.py fills the
    # key with it where no config or command line set one, and refuses any other in one line); () = the family
    # checks the key itself. `title`: the family in messages ("not in the DiT recipe"; "" = `family`).
    cp_methods: tuple[str, ...] = ()
    title: str = ""
    # export.formats: what the family writes from its export besides the export itself (its export_checkpoint's
    # writer writes them); () = none.
    export_formats: tuple[str, ...] = ()
    # Serving (scripts/serve.py): a family whose export Kiln's images server serves (common/diffusion/server.py), not
    # vLLM or transformers serve. `is_export(folder)` tells its export apart from every other family's (file checks
    # only: no torch); `server_module` is its server, whose load_export(export, engine, device) builds the model the
    # images server serves; `serve_engines` the backends it runs; `export_kind` names its export in messages;
    # `serve_dtype_note` says which precision it serves in (serve.dtype stays auto).
    is_export: Callable[[Path], bool] | None = None
    server_module: str | None = None
    serve_engines: tuple[str, ...] = ()
    export_kind: str = ""
    serve_dtype_note: str = ""
    # serve.engine=triton (scripts/kiln/triton.py): the module whose write_repository(export, repo, name=, sys_path=,
    # max_batch=, wait_us=) writes a Triton model repository from the export; None: the family has no Triton path.
    triton_module: str | None = None

    def train(self) -> ModuleType:
        """recipes/<family>/train.py: TRAINER."""
        return importlib.import_module(self.train_module)

    def sizing(self) -> ModuleType:
        """recipes/<family>/sizing.py: memory_spec(cfg), the family's model for common/memory.py."""
        return importlib.import_module(self.sizing_module or self.train_module)

    @property
    def trainer(self) -> type:
        """The family's Trainer (common/trainer.py)."""
        return self.train().TRAINER

    def latent_cache(self) -> Callable | None:
        """The family's latent_cache(cfg, device) (data/cache_latents.py), or None."""
        return importlib.import_module(self.latent_cache_module).latent_cache if self.latent_cache_module else None

    def exporter(self) -> ModuleType:
        """recipes/<family>/export.py: export_checkpoint, export_lora_checkpoint, lora_base (module docstring)."""
        return importlib.import_module(self.export_module)


def _diffusion_export(folder: Path) -> bool:
    """A diffusion export (the DiT's, text-to-image's or video's): a kiln.json or a transformer/ folder."""
    return (folder / "kiln.json").exists() or (folder / "transformer").is_dir()


def _pipeline_class(folder: Path) -> str | None:
    """The diffusers pipeline class an export is (or adapts): its model_index.json's, else its kiln.json's (a LoRA
    export holds diffusers' LoRA file and kiln.json only); None for neither."""
    for name, key in (("model_index.json", "_class_name"), ("kiln.json", "diffusers_pipeline")):
        if (folder / name).exists():
            return json.loads((folder / name).read_text()).get(key)
    return None


T2I_PIPELINES = ("StableDiffusion3Pipeline", "FluxPipeline")  # recipes/t2i/weights.py ADAPTERS
VIDEO_PIPELINES = ("WanPipeline",)  # recipes/video/weights.py PIPELINE


def _dit_export(folder: Path) -> bool:
    return _diffusion_export(folder) and _pipeline_class(folder) not in (*T2I_PIPELINES, *VIDEO_PIPELINES)


def _t2i_export(folder: Path) -> bool:
    return _diffusion_export(folder) and _pipeline_class(folder) in T2I_PIPELINES


def _video_export(folder: Path) -> bool:
    return _diffusion_export(folder) and _pipeline_class(folder) in VIDEO_PIPELINES


SPECS: dict[str, RecipeSpec] = {
    "dit": RecipeSpec(
        "dit",
        dit_config,
        "recipes.dit.train",
        "recipes.dit.export",
        sizing_module="recipes.dit.sizing",
        sections=dit_config.SECTIONS,
        renamed=dit_config.RENAMED,
        lora_targets=dit_config.LORA_TARGETS,
        cp_methods=dit_config.CP_METHODS,
        title="DiT",
        is_export=_dit_export,
        latent_cache_module="recipes.dit.data",
        server_module="recipes.dit.serve",
        serve_engines=("tensorrt", "onnxruntime", "torch"),  # its ONNX graph (scripts/export_dit.py) or PyTorch
        export_kind="DiT",
        serve_dtype_note="a DiT export serves in its graph's precision (scripts/export_dit.py --precision)",
        triton_module="recipes.dit.triton",  # its ONNX graph on ONNX Runtime, Kiln's sampler as a BLS model
    ),
    "vlm": RecipeSpec(
        "vlm",
        vlm_config,
        "recipes.vlm.train",
        "recipes.vlm.export",
        sizing_module="recipes.vlm.sizing",
        sections=vlm_config.SECTIONS,
        renamed=vlm_config.RENAMED,
        lora_targets=vlm_config.LORA_TARGETS,
        preference=True,
        cp_methods=vlm_config.CP_METHODS,
        title="VLM",
    ),
    "llm": RecipeSpec(
        "llm",
        llm_config,
        "recipes.llm.train",
        "recipes.llm.export",
        sizing_module="recipes.llm.sizing",
        lora_targets=llm_config.LORA_TARGETS,
        qlora=True,
        preference=True,
        grpo=True,
        cp_methods=llm_config.CP_METHODS,
        title="LLM",
        export_formats=("gguf",),  # export/gguf/ (recipes/llm/gguf_export.py)
    ),  # QLoRA on one GPU (check_qlora_layout)
    # Text-to-image on a released SD3 pipeline. It shares the diffusion core with the DiT (common/diffusion: objective,
    # VAE path, sampler, the `diffusion` section), as every family shares common/: no recipe imports another.
    "t2i": RecipeSpec(
        "t2i",
        t2i_config,
        "recipes.t2i.train",
        "recipes.t2i.export",
        sizing_module="recipes.t2i.sizing",
        sections=t2i_config.SECTIONS,
        lora_targets=t2i_config.LORA_TARGETS,
        cp_methods=t2i_config.CP_METHODS,
        title="text-to-image",
        is_export=_t2i_export,
        latent_cache_module="recipes.t2i.data",
        server_module="recipes.t2i.serve",
        serve_engines=("torch",),  # PyTorch only (no ONNX graph of the pipeline yet)
        export_kind="text-to-image",
        serve_dtype_note="a text-to-image export serves in float32 (recipes/t2i/sampling.py)",
    ),
    # Text-to-video on a released Wan 2.1 pipeline: the same diffusion core (common/diffusion) over clips.
    "video": RecipeSpec(
        "video",
        video_config,
        "recipes.video.train",
        "recipes.video.export",
        sizing_module="recipes.video.sizing",
        sections=video_config.SECTIONS,
        lora_targets=video_config.LORA_TARGETS,
        cp_methods=video_config.CP_METHODS,
        title="video",
        is_export=_video_export,
        latent_cache_module="recipes.video.data",
        server_module="recipes.video.serve",  # the images server's API at /v1/videos/generations, MP4 clips
        serve_engines=("torch",),  # PyTorch only, as text-to-image
        export_kind="video",
        serve_dtype_note="a video export serves in float32 (recipes/video/sampling.py)",
    ),
}


def register_family(spec: RecipeSpec) -> None:
    """Add a family (one from outside recipes/) to the table; registering the same spec again is a no-op."""
    if SPECS.get(spec.family, spec) != spec:
        raise ValueError(f"recipe family {spec.family!r} is registered already")
    SPECS[spec.family] = spec


def specs() -> dict[str, RecipeSpec]:
    """Every family: the built-in ones and those KILN_FAMILIES names (imported once, on first use)."""
    for name in filter(None, (m.strip() for m in os.environ.get("KILN_FAMILIES", "").split(","))):
        try:
            module: Any = importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"KILN_FAMILIES={os.environ['KILN_FAMILIES']}: cannot import {name} ({exc})") from None
        register_family(module.SPEC)
    return SPECS


def recipe_spec(family: str) -> RecipeSpec:
    known = specs()
    if family not in known:
        raise ConfigError(f"recipe.family={family!r} is not allowed; choose one of: {', '.join(known)}")
    return known[family]
