"""LoRA for every recipe, built on peft: the `finetune=lora` checks, `apply_lora` (one step of a recipe's
parallelize order: after the model is built, before FSDP/ZeRO wraps it), the adapter's seeded init, and the
PEFT adapter folder an export writes (adapter_config.json + adapter_model.safetensors, naming the base).

peft's `inject_adapter_in_model` works on any nn.Module (Kiln's own Llama included): each targeted linear
becomes a `peft.tuners.lora.Linear` holding the original as `base_layer`, plus `lora_A`/`lora_B`, and only
those adapter weights require grad. Its layers are plain modules of plain linears, so they are built on the
meta device, sharded by FSDP2 (frozen and trainable weights in one unit) and materialized like the rest.
Two names change, which is all the recipes see: a wrapped weight `<linear>.weight` is now
`<linear>.base_layer.weight` (`base_key` maps it back: the base checkpoint's name), and the adapter adds
`<linear>.lora_A.default.weight` / `.lora_B.default.weight` (`is_adapter_key`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import zlib
from pathlib import Path

import torch
from torch import nn

from common import weights
from common.config import LoRAConfig, TrainConfig
from common.errors import ConfigError

ADAPTER = "default"  # peft's adapter name: one adapter per run
QUANTIZE_BASE = ("none", "nf4")  # lora.quantize_base
NF4_BLOCK = 64  # QLoRA's (Dettmers et al. 2023): one absmax scale per 64 weights, the scales quantized again
_ADAPTER_PARTS = (".lora_A.", ".lora_B.")


# ---- composition --------------------------------------------------------------------------------
def complete(cfg: TrainConfig, spec, given: set[str] = frozenset()) -> None:
    """finetune=lora: the family must offer it (its spec's `lora_targets`, recipes/registry.py: the linears its
    adapters may target, all of them by default); lora.targets=[] becomes that default, so config.yaml says what ran.
    One line for a target the family's model has no linear of, and for lora.* keys (`given`: the command
    line's) without finetune=lora, which a full fine-tune would otherwise ignore."""
    if cfg.lora.quantize_base not in QUANTIZE_BASE:
        raise ConfigError(f"lora.quantize_base={cfg.lora.quantize_base!r}: choose one of {', '.join(QUANTIZE_BASE)}")
    if cfg.finetune != "lora":
        if cfg.lora.quantize_base != "none":
            raise ConfigError(
                f"lora.quantize_base={cfg.lora.quantize_base} quantizes a LoRA run's frozen base: it needs "
                "finetune=lora"
            )
        # What the user typed, not what differs from the schema's default: `lora.rank=8` (the default) is as sure
        # a sign that LoRA was meant, and a recipe file may carry LoRA settings for when finetune=lora is chosen.
        lora_keys = sorted(k for k in given if k == "lora" or k.startswith("lora."))
        if lora_keys:
            raise ConfigError(
                f"{', '.join(lora_keys)}: LoRA settings, but this run is finetune={cfg.finetune}, which "
                "would ignore them; add finetune=lora to train adapters, or drop them to train every "
                "weight"
            )
        return
    if cfg.lora.quantize_base != "none" and not spec.qlora:
        raise ConfigError(
            f"lora.quantize_base={cfg.lora.quantize_base} is not offered by the {cfg.recipe.family} recipe "
            "yet; use lora.quantize_base=none"
        )
    allowed = spec.lora_targets
    if not allowed:
        raise ConfigError(f"finetune=lora is not offered by the {cfg.recipe.family} recipe yet; use finetune=full")
    if not cfg.lora.targets:
        cfg.lora.targets = list(allowed)
    unknown = [t for t in cfg.lora.targets if t not in allowed]
    if unknown:
        raise ConfigError(
            f"lora.targets: {unknown[0]!r} matches no module the {cfg.recipe.family} recipe's LoRA can "
            f"target; choose from: {', '.join(allowed)}"
        )
    if len(set(cfg.lora.targets)) != len(cfg.lora.targets):
        raise ConfigError(f"lora.targets={list(cfg.lora.targets)} names a module twice")


def peft_config(
    lora: LoRAConfig,
    targets: list[str] | str | None = None,
    base: str | None = None,
    modules_to_save: list[str] | None = None,
):
    """peft's LoraConfig of these settings (`targets`: the names in the model at hand, default lora.targets, or
    one regex over whole module names; `modules_to_save`: modules trained in full, saved whole in the adapter)."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        bias="none",
        target_modules=targets if isinstance(targets, str) else sorted(targets or lora.targets),
        modules_to_save=modules_to_save,
        base_model_name_or_path=base,
    )


# ---- the parallelize step ---------------------------------------------------------------------------
def apply_lora(model: nn.Module, lora: LoRAConfig) -> nn.Module:
    """Wrap every linear named in lora.targets (its last name or names, e.g. `wq`, `to_out.0`) with peft's LoRA
    layer, in place; freeze everything else. On the meta device the adapter stays unallocated (`init_adapter` fills
    it after materialization). Before FSDP/ZeRO: they then shard the adapter with the frozen base."""
    from peft import inject_adapter_in_model

    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    # peft's rule for a list of targets: a module's whole name, or its last dotted parts (`to_out.0`).
    missing = [t for t in lora.targets if not any(n == t or n.endswith("." + t) for n in linears)]
    if missing:  # complete() checked the names; a model part (a pipeline stage) may still lack them all
        raise ConfigError(f"lora.targets: {missing[0]!r} matches no linear of this model")
    inject_adapter_in_model(peft_config(lora), model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():  # peft froze the base: nothing else may train
        if p.requires_grad != is_adapter_key(name):
            raise RuntimeError(f"LoRA left {name} with requires_grad={p.requires_grad}")
    return model


def merge_into(
    model: nn.Module, state: dict[str, torch.Tensor], lora: LoRAConfig, scope: nn.Module | None = None
) -> nn.Module:
    """`model` (materialized, not yet LoRA-wrapped: its own weights are overwritten) holding `state` (an adapted
    model's names: `base_layer` + adapter, LoRA on `scope`, default the whole model), the adapter then merged by
    peft's merge_and_unload (W + B A * alpha / rank) and unwrapped, in place: the caller's tensors are copied."""
    from peft import LoraModel

    tuner = LoraModel(model if scope is None else scope, peft_config(lora), ADAPTER)
    model.load_state_dict(state)
    tuner.merge_and_unload()
    return model


def quantize_base(model: nn.Module) -> int:
    """lora.quantize_base=nf4 (QLoRA): the frozen weight of every adapted linear becomes torchao's NF4Tensor, 4-bit
    NormalFloat in blocks of 64 with double-quantized scales (Dettmers et al. 2023), dequantized to the weight's
    dtype inside each matmul; the adapter and the other weights stay as they are. After the base's weights are
    loaded, on one rank (no FSDP: the recipe refuses dp, tp, pp > 1). Returns the bytes the quantized weights hold,
    about 0.52 per weight against 2 in bf16 and 4 in fp32."""
    from peft.tuners.lora import Linear as LoraLinear

    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError as exc:
        raise ConfigError(
            f"lora.quantize_base=nf4 needs torchao's NF4 tensor ({exc}): pip install -e '.[gpu]'"
        ) from None

    held = 0
    for name, module in model.named_modules():
        if not isinstance(module, LoraLinear):
            continue
        weight = module.base_layer.weight
        if weight.numel() % NF4_BLOCK:
            raise ConfigError(
                f"lora.quantize_base=nf4: {name} has {weight.numel()} weights, not a multiple of "
                f"NF4's block of {NF4_BLOCK}"
            )
        scales = weight.numel() // NF4_BLOCK
        # QLoRA quantizes the scales in blocks of 256; a small model's scale count may need a smaller block.
        scale_block = next(b for b in (256, 128, 64, 32, 16, 8, 4, 2, 1) if scales % b == 0)
        nf4 = to_nf4(weight.detach(), NF4_BLOCK, scale_block)
        module.base_layer.weight = nn.Parameter(nf4, requires_grad=False)
        held += sum(getattr(nf4, attr).nbytes for attr in nf4.__tensor_flatten__()[0])
    return held


def dequantized(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with NF4 weights (a QLoRA run's base) as plain tensors of their dtype, what the model computes."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    return {k: v.get_original_weight() if isinstance(v, NF4Tensor) else v for k, v in state.items()}


def is_adapter_key(fqn: str) -> bool:
    return any(part in fqn for part in _ADAPTER_PARTS)


def base_key(fqn: str) -> str:
    """The base model's own name of a (possibly LoRA-wrapped) parameter: `...wq.base_layer.weight` -> `...wq.weight`."""
    return fqn.replace(".base_layer.", ".")


def adapter_init(names: list[str], shapes: dict[str, torch.Size], seed: int) -> dict[str, torch.Tensor]:
    """peft's default init (A: kaiming-uniform(a=sqrt 5), B: zeros: the adapted model starts as the base),
    each A drawn from a generator seeded by (seed, its name): the same values in every layout, whichever
    rank or pipeline stage holds it."""
    out = {}
    for name in names:
        t = torch.empty(shapes[name])
        if ".lora_A." in name:
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)
        else:
            nn.init.zeros_(t)
        out[name] = t
    return out


def init_adapter(model: nn.Module, seed: int) -> None:
    """Fill the adapter of a materialized (possibly FSDP-sharded, AC-wrapped) model with `adapter_init`'s full
    tensors, named as state dicts name them (no wrapper prefixes: the same seeds in every layout); each rank
    keeps its shards. Collective where FSDP's state-dict helpers are."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    adapter = [p for name, p in model.named_parameters() if is_adapter_key(name)]
    with torch.no_grad():  # what to_empty left: a weight the state dict below misses shows as NaN, not as noise
        for p in adapter:
            (p.to_local() if hasattr(p, "to_local") else p).fill_(float("nan"))
    shapes = {k: v.shape for k, v in get_model_state_dict(model).items() if is_adapter_key(k)}  # DTensors: global
    set_model_state_dict(
        model, adapter_init(sorted(shapes), shapes, seed), options=StateDictOptions(full_state_dict=True, strict=False)
    )
    if any((p.to_local() if hasattr(p, "to_local") else p).isnan().any() for p in adapter):
        raise RuntimeError("LoRA: adapter weights left uninitialized")


# ---- the base's identity -----------------------------------------------------------------------------
def base_fingerprint(folder: str | Path) -> str:
    """The base's weights, identified (common/weights.py: headers and sampled bytes of every tensor): a same-shaped
    base with other weights, or one overwritten in place, gets another value."""
    return weights.fingerprint(folder, f"the LoRA base {folder}")


def same_base(saved: str, folder: str | Path) -> bool:
    """Whether `folder` holds the base of a checkpoint whose meta.json recorded `saved`. A checkpoint from before the
    weights were sampled recorded a bare sha256 of the headers: compared as it was computed (`is_header_only`)."""
    if is_header_only(saved):
        return saved == weights.header_fingerprint(folder)
    return saved == base_fingerprint(folder)


def is_header_only(saved: str) -> bool:
    return not saved.startswith(weights.FINGERPRINT + ":")


def header_only_note(path: Path) -> str:
    return (
        f"kiln: note: {path} records its LoRA base by the safetensors headers only (a checkpoint from before the "
        "weights were fingerprinted): a same-shaped base with other weights is not detected"
    )


def checkpoint_meta(cfg: TrainConfig, base: str) -> dict:
    """What a checkpoint records of its fine-tuning: the method and, for LoRA, every lora.* key and the base."""
    if cfg.finetune != "lora":
        return {"finetune": cfg.finetune}
    return {
        "finetune": "lora",
        "lora": {**_lora_keys(cfg.lora), "base": base, "base_fingerprint": base_fingerprint(base)},
    }


def _lora_keys(lora: LoRAConfig) -> dict:
    return {f.name: list(v) if isinstance(v := getattr(lora, f.name), list) else v for f in dataclasses.fields(lora)}


def check_resume(meta: dict, cfg: TrainConfig, base: str, path: Path) -> None:
    """One line where a checkpoint cannot continue this run: another fine-tuning method, another lora.* value (the
    key, what the checkpoint holds, what this run asks for), or (LoRA: the checkpoint holds the adapter only) a base
    with other weights."""
    was = meta.get("finetune", "full")
    if was != cfg.finetune:
        raise ConfigError(f"run.resume: {path} is a finetune={was} checkpoint; this run is finetune={cfg.finetune}")
    if cfg.finetune != "lora":
        return
    saved = meta["lora"]
    for key, now in _lora_keys(cfg.lora).items():
        if key in saved and saved[key] != now:  # older checkpoints recorded rank, alpha and targets only
            raise ConfigError(
                f"run.resume: {path} holds an adapter with lora.{key}={saved[key]}, this run asks for "
                f"{now}; resume with lora.{key}={saved[key]} or start a new run.dir"
            )
    if not same_base(saved["base_fingerprint"], base):
        raise ConfigError(
            f"run.resume: {path} trained an adapter on the base {saved['base']}; this run's base {base} "
            f"has other weights (the checkpoint holds the adapter only)"
        )
    if is_header_only(saved["base_fingerprint"]) and os.environ.get("RANK", "0") == "0":
        print(header_only_note(path), flush=True)


# ---- the PEFT adapter folder ----------------------------------------------------------------------------
def write_adapter_folder(out: Path, adapter: dict[str, torch.Tensor], config) -> None:
    """`adapter`: peft's names (`base_model.model.<module>.lora_A.weight`, ...) -> tensors; `config`: peft's
    LoraConfig naming the base (base_model_name_or_path) and the target modules, in the base's own names."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file(
        {k: v.detach().contiguous() for k, v in adapter.items()},
        str(out / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )


def peft_state_dict(state: dict[str, torch.Tensor], module_name=lambda module: module) -> dict[str, torch.Tensor]:
    """The adapter weights of an adapted model's state dict under peft's saved names; `module_name` maps the model's
    name of a wrapped linear to the base's (default: the same, for a model that is the base's own class)."""
    return {peft_key(module_name(k.split(".lora_")[0]), k): v for k, v in state.items() if is_adapter_key(k)}


def peft_key(module: str, fqn: str) -> str:
    """peft's saved name of an adapter weight of `module` (the base model's name of the linear):
    `...lora_A.default.weight` -> `base_model.model.<module>.lora_A.weight`."""
    part = "lora_A" if ".lora_A." in fqn else "lora_B"
    return f"base_model.model.{module}.{part}.weight"


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """The model's LoRA adapters off (peft's own flag, read by every LoRA layer's forward): the frozen base."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, was in zip(layers, before):
            m._disable_adapters = was
