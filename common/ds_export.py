"""Export from a DeepSpeed (ZeRO 0-3) checkpoint in bounded host memory: read the module's tensors of any
stage's files a group at a time, and write them to safetensors shards.

What a Kiln DeepSpeed checkpoint dir holds (common/engine.py DeepSpeedEngine.save, DeepSpeed 0.19):

    meta.json                                       world_size, zero_stage (common/checkpoint.py)
    mp_rank_00_model_states.pt                      stage 0-2: the module's state dict, whole, in its dtype
    zero_pp_rank_R_mp_rank_00_model_states.pt       stage 3, per rank: placeholders, param_shapes, buffers and the
                                                    rank's fragments of frozen parameters
    [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt  stage 3, per rank: fp32_flat_groups, the rank's slice of every
                                                    trainable parameter (ceil(numel / world) elements, zero-padded)
    trainer.pt                                      Kiln's TrainState (the DiT's whole EMA by name: `saved_ema`)

Every file is opened with torch.load(mmap=True) for one group and dropped after it: pages it touched leave the
process with the mapping, so the peak is about one group's bytes (`max_shard_size`), not the model's. DeepSpeed's
own zero_to_fp32 reads the same layouts into one fp32 state dict (its default 5GB shard holds a whole model).
"""

from __future__ import annotations

import json
import math
import pickle
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from common.errors import UserError
from common.toggles import unwrapped_name, unwrapped_names

DEFAULT_MAX_SHARD_SIZE = "1GB"
Fetch = Callable[[list[str]], dict[str, torch.Tensor]]


def _load(path: Path) -> dict:
    # weights_only=False: DeepSpeed pickles its config and enums beside the tensors. mmap keeps them off the heap.
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:  # a truncated or foreign file
        raise UserError(f"{path} is unreadable ({str(exc).splitlines()[0].split('. ')[0]})") from None


def unpartition(pieces: Iterable[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """A ZeRO-3 parameter from its per-rank slices (rank order; the last ones zero-padded)."""
    return torch.cat([p.reshape(-1) for p in pieces])[: math.prod(shape)].view(shape)


class ZeroCheckpoint:
    """The module tensors of one DeepSpeed checkpoint dir, as the engine held them (the module's dtype)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            meta = json.loads((self.path / "meta.json").read_text())
            self.world, self.stage = int(meta["world_size"]), int(meta["zero_stage"])
        except (OSError, ValueError, KeyError, TypeError):
            raise UserError(
                f"{self.path} is not a DeepSpeed checkpoint of a Kiln run (no meta.json naming its "
                "world_size and zero_stage)"
            ) from None
        files = [self.model_file(r) for r in range(self.world if self.stage == 3 else 1)]
        files += [self.optim_file(r) for r in range(self.world)] if self.stage == 3 else []
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise UserError(f"{self.path} is an incomplete DeepSpeed checkpoint (no {missing[0]})")
        states = _load(self.model_file(0))
        # DeepSpeed records parameters by their names in the module it wraps, activation checkpointing's and
        # compile's wrapper prefixes included; its module state dict (and the models the exports build) drops them.
        # Every name read from these records is unwrapped (`unwrapped_names`), so an AC/compiled run's checkpoint
        # reads as any other. ZeRO-0 records no param_shapes (None); stage 3 needs them to cut its flat groups.
        groups = states.get("param_shapes") or []
        self.param_shapes = unwrapped_names({k: v for group in groups for k, v in group.items()})
        self.frozen_shapes = unwrapped_names(states.get("frozen_param_shapes") or {})
        shared = unwrapped_names(states.get("shared_params") or {})  # alias -> the name DeepSpeed saved it under
        self.shared = {alias: unwrapped_name(name) for alias, name in shared.items()}
        # The module's persistent buffers: whole in the module state dict at every stage (at ZeRO-3 beside the
        # parameters' placeholders).
        self.buffers = set(unwrapped_names(dict.fromkeys(states.get("buffer_names") or [])))
        floats = [v for v in states["module"].values() if v.is_floating_point()]
        self.dtype = floats[0].dtype if floats else torch.float32

    def model_file(self, rank: int) -> Path:
        if self.stage < 3:
            return self.path / "mp_rank_00_model_states.pt"
        return self.path / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"

    def optim_file(self, rank: int) -> Path:
        name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        found = sorted(self.path.glob(f"*{name}"))  # bf16 runs' files are bf16_zero_pp_rank_...
        return found[0] if found else self.path / name

    def trainer_file(self) -> Path:
        return self.path / "trainer.pt"

    def tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """`names` (module state-dict keys) whole, reading only the files they live in, each mapped for this call."""
        source = {n: self.shared.get(n, n) for n in names}  # a tied alias reads the tensor it shares
        got = self._read(list(dict.fromkeys(source.values())))
        return {n: got[s] for n, s in source.items()}

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        if self.stage < 3:
            module = _load(self.model_file(0))["module"]
            return {n: module[n] for n in names}
        out: dict[str, torch.Tensor] = {}
        trainable = [n for n in names if n in self.param_shapes]
        if trainable:
            out |= self._trainable(trainable)
        frozen = [n for n in names if n in self.frozen_shapes]
        if frozen:
            fragments = [
                unwrapped_names(_load(self.model_file(r))["frozen_param_fragments"]) for r in range(self.world)
            ]
            out |= {n: unpartition((f[n] for f in fragments), self.frozen_shapes[n]) for n in frozen}
        rest = [n for n in names if n not in out]
        if rest:
            # Buffers only: a parameter's entry in a ZeRO-3 module state dict is a placeholder of shape (0,).
            unknown = [n for n in rest if n not in self.buffers]
            if unknown:
                raise KeyError(unknown[0])
            module = _load(self.model_file(0))["module"]
            out |= {n: module[n] for n in rest}  # whole on every rank
        return out

    def _trainable(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Stage 3: each parameter's slices cut from every rank's fp32 flat groups, in the module's dtype (the
        engine's weights are these fp32 masters copied down after each step)."""
        wanted, spans, offset = set(names), {}, 0
        for name, shape in self.param_shapes.items():  # the flat groups hold them in this order, back to back
            size = math.ceil(math.prod(shape) / self.world)
            if name in wanted:
                spans[name] = (offset, size)
            offset += size
        flats = [_load(self.optim_file(r))["optimizer_state_dict"]["fp32_flat_groups"] for r in range(self.world)]
        return {
            n: unpartition((_span(groups, *spans[n]) for groups in flats), self.param_shapes[n]).to(self.dtype)
            for n in names
        }

    def trainer_state(self) -> dict:
        """Kiln's TrainState, mapped (see common/trainer.py save_checkpoint)."""
        path = self.trainer_file()
        if not path.exists():
            raise UserError(f"{self.path} is an incomplete Kiln checkpoint (no {path.name})")
        return _load(path)


def _span(groups: list[torch.Tensor], start: int, size: int) -> torch.Tensor:
    """Elements [start, start + size) of flat groups that sit back to back."""
    pieces, base = [], 0
    for g in groups:
        lo, hi = max(start, base), min(start + size, base + g.numel())
        if lo < hi:
            pieces.append(g[lo - base : hi - base])
        base += g.numel()
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def saved_ema(trainer_state: dict) -> dict[str, torch.Tensor]:
    """The EMA a DiT TrainState holds (common/ema.py EMA.state_dict): one whole fp32 tensor per trainable
    parameter, by its name in `model.named_parameters()` less activation checkpointing's and compile's wrapper
    prefixes (the exports build unwrapped models), whatever ZeRO stage wrote it."""
    return unwrapped_names(trainer_state["ema"]["shadow"])


def copy_checked(params: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], source: Path) -> None:
    """Copy ``saved`` (tensors by name, read from checkpoint ``source``) into ``params`` (a model's parameters by name),
    in place; one line where the names or a shape differ (the run's config.yaml builds another model than it saved)."""
    only = sorted(params.keys() - saved.keys()) or sorted(saved.keys() - params.keys())
    if only:
        raise UserError(
            f"{source} holds other tensors than the model the run's config.yaml builds ({only[0]} is in "
            "one of them only)"
        )
    wrong = [n for n, p in params.items() if saved[n].shape != p.shape]
    if wrong:
        raise UserError(
            f"{source} holds {wrong[0]} of shape {tuple(saved[wrong[0]].shape)}; the run's config.yaml "
            f"builds {tuple(params[wrong[0]].shape)}"
        )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(saved[name])


def write_safetensors(
    folder: Path,
    weights_name: str,
    layout: dict[str, torch.Tensor],
    fetch: Fetch,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> int:
    """`layout` (names -> meta tensors of the saved shapes and dtypes) as safetensors files in `folder`, split as
    transformers and diffusers split them (huggingface_hub; `weights_name` plus an index when there are several).
    `fetch(names)` gives one shard's tensors at a time. Returns the bytes written."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    pattern = weights_name.replace(".safetensors", "{suffix}.safetensors")
    split = split_torch_state_dict_into_shards(layout, filename_pattern=pattern, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        tensors = fetch(names)
        shard = {}
        for n in names:
            t = tensors[n]
            if t.shape != layout[n].shape or t.dtype != layout[n].dtype:
                raise RuntimeError(
                    f"{n}: the checkpoint holds {tuple(t.shape)} {t.dtype}, the model "
                    f"{tuple(layout[n].shape)} {layout[n].dtype}"
                )
            shard[n] = t.contiguous()
        save_file(shard, folder / filename, metadata={"format": "pt"})
        del tensors, shard
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (folder / f"{weights_name}.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return int(split.metadata["total_size"])


# ---- scripts/export.py's two exports of a ZeRO checkpoint (the DeepSpeed families': recipes/<family>/export.py) ----
def export_zero(path: Path, max_shard_size: str | None, write: Callable[["ZeroCheckpoint", int], int]) -> str:
    """The whole model's export of ZeRO checkpoint `path`: `write(ckpt, max shard bytes)` writes the folder, streamed,
    and returns the weight bytes written. Returns what was written, in words."""
    from huggingface_hub.serialization._base import parse_size_to_int  # how transformers/diffusers read a shard size

    try:
        shard_size = parse_size_to_int(max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    except ValueError:
        raise UserError(f"--max-shard-size {max_shard_size}: not a size (e.g. 500MB, 2GB)") from None
    ckpt = ZeroCheckpoint(path)
    written = write(ckpt, shard_size)
    return (
        f"ZeRO-{ckpt.stage} checkpoint of {ckpt.world} rank(s); {written / 1e6:.1f} MB of "
        f"{str(ckpt.dtype).removeprefix('torch.')} weights"
    )


def export_zero_lora(
    path: Path, max_shard_size: str | None, write: Callable[["ZeroCheckpoint"], int], *, adapter: str, source: str
) -> str:
    """A finetune=lora run's export of ZeRO checkpoint `path`: `write(ckpt)` writes the adapter folder (the base whole
    in host memory, as the end of the run writes it) and returns the parameters it read from the checkpoint
    (`adapter`: what they are, on model.init_from `source`). Returns what was written, in words."""
    if max_shard_size is not None:
        raise UserError(
            "--max-shard-size is for full DiT/VLM runs (a LoRA run's export is written by peft, diffusers "
            "and transformers, as at the end of the run)"
        )
    ckpt = ZeroCheckpoint(path)
    count = write(ckpt)
    return f"{adapter} of {count:,} parameters on {source}, from a ZeRO-{ckpt.stage} checkpoint of {ckpt.world} rank(s)"


def export_ema(cfg, path: Path, meta: dict, out: Path, max_shard_size: str | None, write: Callable[..., int]) -> str:
    """export_zero for a diffusion run (DiT, text-to-image): `write(cfg, ckpt, out, step=..., max_shard_size=...)`
    writes the EMA weights' export, as the end of the run does."""
    return export_zero(
        path,
        max_shard_size,
        lambda ckpt, shard_size: write(cfg, ckpt, out, step=int(meta["step"]), max_shard_size=shard_size),
    )


def export_ema_lora(
    cfg, path: Path, meta: dict, out: Path, max_shard_size: str | None, write: Callable[..., int]
) -> str:
    """export_zero_lora for a diffusion run (DiT, text-to-image): `write(cfg, ckpt, out, step=...)` writes the EMA
    adapter on model.init_from's base, as the end of the run does."""
    step = int(meta["step"])
    return export_zero_lora(
        path,
        max_shard_size,
        lambda ckpt: write(cfg, ckpt, out, step=step),
        adapter="a LoRA adapter",
        source=cfg.model.init_from,
    )


def load_ema_adapter(model: torch.nn.Module, ckpt: "ZeroCheckpoint") -> dict[str, torch.nn.Parameter]:
    """`model`'s trainable (adapter) parameters, set in place to the EMA that checkpoint `ckpt`'s TrainState holds
    (what EMA.swapped() does at the end of the run), in the checkpoint's dtype."""
    if ckpt.dtype != torch.float32:
        model.to(ckpt.dtype)  # DeepSpeed's cast of the module (bf16/fp16 runs)
    adapter = {name: p for name, p in model.named_parameters() if p.requires_grad}
    copy_checked(adapter, saved_ema(ckpt.trainer_state()), ckpt.path)
    return adapter


def write_ema_module(
    ckpt: ZeroCheckpoint, model: torch.nn.Module, folder: Path, weights_name: str, max_shard_size: int
) -> int:
    """A diffusers model's weights from checkpoint `ckpt` as its export holds them: the trainable parameters from
    the EMA in the TrainState (by name, `saved_ema`), anything else (buffers, frozen tensors) from DeepSpeed's model
    states, in the checkpoint's dtype, one safetensors shard at a time; and its config.json. `model` is built on
    the meta device with the trained module's names; a tensor two names share (a tied embedding) is written under
    each. Returns the weight bytes written."""
    ema_name = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    tensors = model.state_dict(keep_vars=True)
    layout = {
        k: torch.empty(v.shape, dtype=ckpt.dtype if v.is_floating_point() else v.dtype, device="meta")
        for k, v in tensors.items()
    }

    def fetch(names: list[str]) -> dict[str, torch.Tensor]:
        from_ema = {n: ema_name[id(tensors[n])] for n in names if id(tensors[n]) in ema_name}
        got = ckpt.tensors([n for n in names if n not in from_ema])
        if from_ema:
            ema = saved_ema(ckpt.trainer_state())
            for n, name in from_ema.items():
                got[n] = ema[name].to(ckpt.dtype, copy=True)  # a tensor two names share: one copy each
        return got

    written = write_safetensors(folder, weights_name, layout, fetch, max_shard_size)
    model.save_config(folder)
    return written
