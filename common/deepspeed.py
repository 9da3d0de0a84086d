"""DeepSpeed for the ZeRO recipes (DiT, VLM): the config dict derived from the Hydra config in
this one place (no JSON files), engine creation, checkpoints, gradient norm, state bytes."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from common.checkpoint import read_meta
from common.config import TrainConfig
from common.distributed import DistInfo
from common.errors import ConfigError, UserError
from common.memory import deepspeed_state_bytes, model_state_bytes
from common.optim import lr_factor


def zero_stage(cfg: TrainConfig, dp: int) -> int:
    """The ZeRO stage a run on `dp` data-parallel ranks (DeepSpeed's dp, x parallel.cp) runs: parallel.zero_stage,
    but 0 on one rank. ZeRO partitions optimizer state, gradients (and at stage 3 weights) over the ranks: one rank has
    nothing to partition over, so it would hold the same bytes and pay only ZeRO's bookkeeping (flat partitions,
    bucketed reduce copies: a DiT-XL/2 step on an H100 spent 0.08-0.11 s of 0.31-0.33 s in ZeRO-2's optimizer step).
    ZeRO-0 instead: DeepSpeed's bf16/fp16 wrapper (FP16_UnfusedOptimizer: fp32 master weights, the same Adam state)
    or torch's AdamW on the fp32 weights; torch's fused AdamW kernel on CUDA either way. The planner sizes one rank so
    too (scripts/kiln/planner.py _zero_stages)."""
    return 0 if dp * cfg.parallel.cp == 1 else cfg.parallel.zero_stage


def single_rank_note(cfg: TrainConfig, dp: int) -> str | None:
    """The one line a one-rank run with parallel.zero_stage > 0 prints (`zero_stage`), else None."""
    if zero_stage(cfg, dp) == cfg.parallel.zero_stage:
        return None
    return (
        f"kiln: parallel.zero_stage={cfg.parallel.zero_stage} on one rank: nothing to partition over, so DeepSpeed "
        "runs ZeRO-0 (the same weights and Adam state, no partitioning overhead); ZeRO applies from 2 ranks"
    )


def build_deepspeed_config(cfg: TrainConfig, dp: int) -> dict[str, Any]:
    t, o = cfg.trainer, cfg.optim
    stage = zero_stage(cfg, dp)
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch_size * t.grad_accum * dp,
        "gradient_clipping": o.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": o.lr,
                "betas": [o.beta1, o.beta2],
                "eps": o.eps,
                "weight_decay": o.weight_decay,
                # torch's AdamW: no compiled DeepSpeed op needed; its fused kernel on CUDA
                "torch_adam": True,
                **({"fused": True} if torch.cuda.is_available() else {}),
            },
        },
        "zero_optimization": {
            "stage": stage,
            "contiguous_gradients": True,
            "overlap_comm": stage >= 2,
            # Resume restores Adam state from the fp32 partitions: bitwise continuation.
            "load_from_fp32_weights": True,
        },
        "steps_per_print": 10**9,  # Kiln logs; keep DeepSpeed's own step logs quiet
        "wall_clock_breakdown": False,
    }
    if stage == 3:
        # Gather full weights for export/eval (stage3_gather_16bit_weights_on_model_save).
        ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        # Every parameter partitioned (none kept whole): common/ema.py tracks partitions.
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        if cfg.parallel.cp > 1:
            # Under sequence parallelism every path DeepSpeed reduces gradients by divides by dp (sums over cp) except
            # ZeRO-3's reduce-scatter one (stage3.py __avg_scatter_grads: reduce_scatter_coalesced averages over
            # dp x cp), which left the gradients 1/cp of the whole (the grad norm halved at cp=2, dit_tiny). Its
            # all-reduce path (__avg_scatter_contiguous_grads) divides by dp; it takes every bucket that fits
            # reduce_bucket_size, and a parameter larger than that is refused (initialize, below).
            ds["zero_optimization"]["reduce_scatter"] = False
    if cfg.toggles.precision in ("bf16", "fp8"):
        ds["bf16"] = {"enabled": True}
    elif cfg.toggles.precision == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return ds


REDUCE_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size (Kiln's config leaves it)


def check_cp_zero3(cfg: TrainConfig, largest: int, name: str = "the largest trainable parameter") -> None:
    """One line where parallel.cp > 1 under ZeRO-3 meets a trainable parameter of more than `REDUCE_BUCKET` elements
    (`largest`): DeepSpeed's reduce path for it would average its gradient over dp x cp ranks instead of summing it
    over cp (build_deepspeed_config). `initialize` names the parameter; the planner (scripts/plan.py) skips such
    layouts with the same rule."""
    if cfg.parallel.cp > 1 and cfg.parallel.zero_stage == 3 and largest > REDUCE_BUCKET:
        raise ConfigError(
            f"parallel.cp={cfg.parallel.cp} with parallel.zero_stage=3: {name} has {largest:,} elements, more than "
            f"ZeRO-3's reduce bucket ({REDUCE_BUCKET:,}); DeepSpeed would average its gradient over dp x cp ranks "
            "instead of summing it over cp (common/deepspeed.py): use parallel.zero_stage=2"
        )


def local_state_bytes(engine) -> int:
    """Measured bytes of weights + optimizer state (incl. fp32 master copies) held by this rank.

    Counts each tensor storage once: ZeRO keeps flat buffers that many views share.
    Gradients are left out: DeepSpeed frees or reuses them between steps.
    """
    import torch

    storages: dict[int, int] = {}

    def add(t) -> None:
        if torch.is_tensor(t) and t.numel() > 0:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()

    for p in engine.module.parameters():
        add(p.ds_tensor if hasattr(p, "ds_tensor") else p.data)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for group in inner.param_groups:
        for p in group["params"]:
            add(p)
    for state in inner.state.values():
        for value in state.values():
            add(value)
    return sum(storages.values())


def initialize(model: torch.nn.Module, cfg: TrainConfig, dp: int, mpu=None):
    """A DeepSpeed engine over `model`'s trainable parameters, with Kiln's LR schedule. `mpu`: the sequence-parallel
    groups under parallel.cp > 1 (common/ulysses.py: UlyssesGroups); DeepSpeed then counts `dp` = world / cp
    data-parallel ranks in its batch size."""
    import deepspeed

    config = build_deepspeed_config(cfg, dp)
    if (note := single_rank_note(cfg, dp)) is not None:
        print(note, flush=True)  # one rank: it is rank 0
    if mpu is not None:
        name, p = max(
            ((n, q) for n, q in model.named_parameters() if q.requires_grad), key=lambda item: item[1].numel()
        )
        check_cp_zero3(cfg, p.numel(), f"parameter {name}")
    schedule = functools.partial(lr_factor, cfg=cfg.optim, max_steps=cfg.trainer.max_steps)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        mpu=mpu,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
    )
    if not hasattr(engine.optimizer, "overflow"):
        # ZeRO-1/2/3 and DeepSpeed's bf16/fp16 optimizers skip a step whose gradients are not
        # finite (and report the norm as inf). ZeRO-0 in fp32 steps the plain torch optimizer,
        # which has no such check: the Trainer decides on the host from Kiln's own norm
        # (`full_grad_norm`) and DeepSpeedEngine.step sets `kiln_skip`; the hook then drops the
        # gradients, and AdamW leaves every parameter and its state as they are. (It runs after
        # DeepSpeed's gradient clipping.)
        engine.optimizer.register_step_pre_hook(_drop_grads_when_skipped)
    return engine


def frozen_copy(model: torch.nn.Module, cfg: TrainConfig, dp: int, like: torch.Tensor) -> torch.nn.Module:
    """A frozen model beside the trained one (preference training's reference), in ``like``'s dtype and device (a
    parameter of the trained model): under ZeRO-3 sharded over the `dp` ranks as the trained model is, by a DeepSpeed
    engine without an optimizer (its weights gathered for each forward, as TRL prepares its reference), else whole on
    every rank (ZeRO 0-2 keep whole weights too)."""
    model = model.to(like.device, like.dtype)
    if zero_stage(cfg, dp) != 3:
        return model
    import deepspeed

    config = build_deepspeed_config(cfg, dp)
    del config["optimizer"]
    return deepspeed.initialize(model=model, config=config)[0].module


def _drop_grads_when_skipped(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if getattr(optimizer, "kiln_skip", False):
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None


def full_grad_norm(engine) -> torch.Tensor | None:
    """Norm of the whole (all-reduced) gradients where they sit on `p.grad`: ZeRO-0 in fp32.

    Call after the backward at the accumulation boundary, before `engine.step()`. ZeRO-1/2/3 and
    the bf16/fp16 optimizers compute the norm in their step (`engine.get_global_grad_norm()`);
    DeepSpeed's plain fp32 path does not, so it is computed here.
    """
    if engine.zero_optimization_stage() > 0 or not engine.is_gradient_accumulation_boundary():
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    if not grads or grads[0].dtype != torch.float32:
        return None
    return torch.nn.utils.get_total_norm(grads)


def grad_norm(engine) -> torch.Tensor | float:
    """The norm DeepSpeed's optimizer computed in its last step (nan where it computes none)."""
    norm = engine.get_global_grad_norm()
    return norm if norm is not None else float("nan")


def trained_shapes(engine) -> dict[str, list[int]]:
    """Name -> shape of every trained parameter, by its name in the module DeepSpeed wraps (meta.json records them:
    a resume checks it fits; AC's and compile's wrapper prefixes are part of these names)."""
    return {
        name: list(getattr(p, "ds_shape", p.shape)) for name, p in engine.module.named_parameters() if p.requires_grad
    }


def _unwrapped(shapes: dict) -> dict:
    from common.toggles import unwrapped_names

    return unwrapped_names(shapes)


def load_checkpoint(engine, path: Path, *, scratch: Path, load_optimizer: bool = True, strict: bool = True) -> None:
    """Restore the engine (model, optimizer, LR schedule) from `path`, whatever ZeRO stage and number of ranks
    wrote it. The same layout loads DeepSpeed's own shards (bit for bit); another one is converted first into a
    DeepSpeed universal checkpoint (one folder per parameter: its whole fp32 weight and Adam moments) under
    `scratch` (a folder every rank sees), which each rank then takes its part of (`load_universal`). `strict=False`:
    the checkpoint holds the trainable parameters only (saved with exclude_frozen_parameters)."""
    import torch.distributed as tdist

    meta = read_meta(path)
    check_trained_shapes(engine, meta, path)
    world = tdist.get_world_size() if tdist.is_initialized() else 1
    saved = (meta["world_size"], meta.get("zero_stage"))
    # DeepSpeed's own shards name the module's parameters as the writing run wrapped them: another AC or compile
    # setting loads through the universal checkpoint (by unwrapped name) like another layout.
    same_names = list(meta.get("trained_shapes", trained_shapes(engine))) == list(trained_shapes(engine))
    if (saved == (world, engine.zero_optimization_stage()) and same_names) or not load_optimizer:
        engine.load_checkpoint(
            str(path.parent),
            tag=path.name,
            load_optimizer_states=load_optimizer,
            load_lr_scheduler_states=load_optimizer,
            load_module_only=not load_optimizer,
            load_module_strict=strict,
        )
        return
    main = not tdist.is_initialized() or tdist.get_rank() == 0
    folder = scratch / f"universal_{path.name}"
    start = time.perf_counter()
    error = None
    if main:
        print(
            f"kiln: {path} was written by {saved[0]} rank(s) under ZeRO-{saved[1]}; this run has {world} under "
            f"ZeRO-{engine.zero_optimization_stage()}: converting it to a DeepSpeed universal checkpoint in {folder}",
            flush=True,
        )
        try:
            to_universal(path, folder)
        except Exception as exc:  # the original is only read; the partial conversion goes
            shutil.rmtree(folder, ignore_errors=True)
            why = (str(exc).splitlines() or [""])[0]
            error = (
                f"run.resume: converting {path} to a universal checkpoint failed ({type(exc).__name__}: {why}); "
                "it is left as it was"
            )
    if tdist.is_initialized():
        box = [error]
        tdist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise UserError(error)
    try:
        load_universal(engine, folder)
        if tdist.is_initialized():
            tdist.barrier()
    except Exception as exc:  # one line, and the conversion goes: a failed resume leaves no checkpoints/.tmp
        why = (str(exc).splitlines() or [""])[0]
        raise UserError(
            f"run.resume: loading {path}, converted to a universal checkpoint, into this run's layout "
            f"failed ({type(exc).__name__}: {why}); it is left as it was"
        ) from exc
    finally:
        if main:  # the conversion goes, and the scratch folder with it where nothing else is in it
            shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                scratch.rmdir()
    if main:
        print(f"kiln: converted and loaded in {time.perf_counter() - start:.1f}s", flush=True)


def check_trained_shapes(engine, meta: dict, path: Path) -> None:
    """One line when the checkpoint's trained parameters are not this model's (another model shape)."""
    saved, mine = meta.get("trained_shapes"), _unwrapped(trained_shapes(engine))
    if saved is None:
        return
    saved = _unwrapped(saved)  # the same model whatever activation checkpointing or compile wrapped
    if saved == mine:
        return
    differ = sorted(set(saved) ^ set(mine)) or [n for n in mine if saved[n] != mine[n]]
    name = differ[0]
    raise ConfigError(
        f"run.resume: {path} holds another model: {len(differ)} trained parameter(s) differ, first "
        f"{name} (saved {saved.get(name, 'absent')}, this run {mine.get(name, 'absent')})"
    )


_STATES = ("exp_avg", "exp_avg_sq")  # AdamW's moments, beside the fp32 weight


def to_universal(src: Path, out: Path) -> None:
    """DeepSpeed's `ds_to_universal` over checkpoint dir `src` (ZeRO-1/2/3 shards, any precision) into `out`. A
    ZeRO-0 fp32 checkpoint has no shards to convert (its one file holds the whole model and torch's AdamW state):
    it is written out in the same layout here."""
    import argparse
    import io

    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    if not list(src.glob("*optim_states.pt")):
        return _zero0_to_universal(src, out)
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=str(src),
        output_folder=str(out),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    log = io.StringIO()  # its progress lines and bars: not Kiln's output
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            ds_to_universal.main(args)
    finally:  # its pointer for DeepSpeed's own loader, beside `out`: Kiln loads `out` by name
        (out.parent / "latest_universal").unlink(missing_ok=True)
    _unwrap_universal(out / "zero")


def _unwrap_universal(zero: Path) -> None:
    """Each parameter's folder of a universal checkpoint under its unwrapped name (`unwrapped_names`), one each.
    ds_to_universal names the optimizer's parameters as the writing module did (activation checkpointing's and
    compile's wrapper prefixes in them), and from ZeRO-1/2 sources also writes, under the module state dict's names, a
    folder holding only fp32.pt for each tensor it found no optimizer state for under that name (DeepSpeed 0.19.8:
    parameters that never had a gradient). Under AC that is a second copy of every wrapped parameter: the weight in
    the compute dtype, without the fp32 master or Adam's moments. The optimizer's folder is the one kept."""
    from common.toggles import unwrapped_name

    for folder in [f for f in zero.iterdir() if f.is_dir()]:
        name = unwrapped_name(folder.name)
        if name != folder.name:
            shutil.rmtree(zero / name, ignore_errors=True)  # DeepSpeed's copy from the module state dict
            folder.rename(zero / name)


def _zero0_to_universal(src: Path, out: Path) -> None:
    files = list(src.glob("mp_rank_*_model_states.pt"))
    if len(files) != 1:
        raise FileNotFoundError(f"no DeepSpeed model states file (mp_rank_00_model_states.pt) in {src}")
    sd = torch.load(files[0], map_location="cpu", weights_only=False)
    optim = sd["optimizer"]
    # In bf16/fp16, DeepSpeed's FP16_UnfusedOptimizer steps AdamW on fp32 master copies of the trained parameters
    # (its state dict holds them, and AdamW's beside them); the module holds only their rounded copies.
    masters = [t for group in optim.get("fp32_groups", []) for t in group]
    optim = optim.get("optimizer_state_dict", optim)
    # torch's AdamW numbers its parameters in the order they were given: the trained ones in module order,
    # which meta.json's trained_shapes keeps (DeepSpeed records no names at ZeRO-0), under the writing run's wrapper
    # prefixes, which the module state dict does not have: unwrapped, as load_universal reads them.
    names = list(_unwrapped(read_meta(src)["trained_shapes"]))
    ids = [i for group in optim["param_groups"] for i in group["params"]]
    weights = masters or [sd["module"][name].float() for name in names]
    for name, i, weight in zip(names, ids, weights, strict=True):
        folder = out / "zero" / name
        folder.mkdir(parents=True)
        torch.save({"param": weight.reshape(sd["module"][name].shape)}, folder / "fp32.pt")
        state = optim["state"].get(i, {})
        for key in _STATES:
            torch.save({"param": state.get(key, torch.zeros_like(sd["module"][name]))}, folder / f"{key}.pt")
        torch.save(state.get("step", torch.tensor(0.0)), folder / "step.pt")
    shutil.copy2(files[0], out / files[0].name)


def load_universal(engine, folder: Path) -> None:
    """Each rank's part of a universal checkpoint into the live engine, by parameter name, through DeepSpeed's
    own setters of whole fp32 weights and optimizer states (`deepspeed.utils.safe_set_full_*`: ZeRO-1/2/3 and the
    bf16 optimizer); ZeRO-0 steps torch's AdamW on whole tensors (the parameters in fp32, DeepSpeed's fp32 master
    copies of them in bf16/fp16), which take them directly.
    Then AdamW's step count, the LR schedule and DeepSpeed's counters. (DeepSpeed's own `load_universal` needs a
    config switch at start-up, and in 0.19.8 a ZeRO-1/2 conversion does not load under ZeRO-3.)

    Frozen parameters are not the run's state: they come from their source on every start."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    from common.toggles import unwrapped_name

    # to_universal names the folders by unwrapped name; DeepSpeed's own ds_to_universal names each parameter as the
    # writing run's module did (AC's and compile's wrapper prefixes in it): read either.
    saved_names = _unwrapped({f.name: f.name for f in (folder / "zero").iterdir() if f.is_dir()})

    def part(name: str, key: str, p: torch.nn.Parameter) -> torch.Tensor:
        return universal_state(folder, name, key, getattr(p, "ds_shape", p.shape)).to(p.device)

    whole = _zero0_masters(engine) if engine.zero_optimization_stage() == 0 else {}
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # torch's AdamW (over ZeRO's flat partitions)
    # ZeRO-3 lends AdamW its flat fp32 partitions only for the step: between steps its groups are empty.
    flat = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    _init_adam_state(inner, [[p] for p in flat] if flat is not None else [g["params"] for g in inner.param_groups])
    if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2, bf16: link the setters to it
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    trained = [(saved_names[unwrapped_name(n)], p) for n, p in engine.module.named_parameters() if p.requires_grad]
    step = adam_step(folder, [name for name, _ in trained])
    for name, p in trained:
        fp32 = part(name, "fp32", p)
        if p in whole:  # ZeRO-0: AdamW's own tensors, whole
            whole[p].data.copy_(fp32)
            inner.state[whole[p]].update({key: part(name, key, p) for key in _STATES})
            p.data.copy_(fp32.to(p.dtype))  # bf16/fp16: the rounded copy the forward reads (fp32: `p` is the master)
            continue
        safe_set_full_fp32_param(p, fp32)
        for key in _STATES:
            safe_set_full_optimizer_state(p, part(name, key, p), key)
        with gathered_one(p, engine.zero_optimization_stage()):  # the compute-dtype weights the forward reads
            p.data.copy_(fp32.to(p.dtype))
    for state in inner.state.values():
        if "step" in state:
            state["step"] = torch.full_like(state["step"], step) if torch.is_tensor(state["step"]) else int(step)
    states = torch.load(next(folder.glob("*model_states.pt")), map_location="cpu", weights_only=False)
    engine.lr_scheduler.load_state_dict(states["lr_scheduler"])
    # The schedule's state holds the last LR, but the optimizer's groups still have the first one until its
    # next step (DeepSpeed's native load restores them with the optimizer's state dict).
    for group, lr in zip(engine.lr_scheduler.optimizer.param_groups, engine.lr_scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    engine.global_steps, engine.skipped_steps = states["global_steps"], states["skipped_steps"]
    engine.global_samples = states.get("global_samples", engine.global_steps * engine.train_batch_size())


def _zero0_masters(engine) -> dict[torch.nn.Parameter, torch.Tensor]:
    """ZeRO-0: each trained parameter -> the tensor torch's AdamW steps. In fp32 the parameter itself; in bf16/fp16
    the fp32 master copy DeepSpeed's FP16_UnfusedOptimizer keeps of it (no `deepspeed.utils.safe_set_full_*` there)."""
    opt = engine.optimizer
    if hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups"):
        return {
            lp: hp
            for lps, hps in zip(opt.fp16_groups, opt.fp32_groups, strict=True)
            for lp, hp in zip(lps, hps, strict=True)
        }
    return {p: p for group in opt.param_groups for p in group["params"]}


def universal_state(folder: Path, name: str, key: str, shape) -> torch.Tensor:
    """Parameter `name`'s whole `key` state (fp32, exp_avg, exp_avg_sq) in a universal checkpoint, in `shape`.
    `ds_to_universal` writes it in two forms: `{"param": tensor}` in the parameter's shape from ZeRO-1/2 sources
    (and Kiln's own from ZeRO-0), a bare flat tensor (ZeRO-3's partitions concatenated, padding cut) from ZeRO-3."""
    path = folder / "zero" / name / f"{key}.pt"
    saved = torch.load(path, map_location="cpu", weights_only=False)
    tensor = saved["param"] if isinstance(saved, dict) else saved
    if tensor.numel() != math.prod(shape):
        raise ValueError(f"{path} holds {tensor.numel()} values; the parameter has shape {tuple(shape)}")
    return tensor.reshape(shape)


def adam_step(folder: Path, names: list[str]) -> float:
    """AdamW's step count in a universal checkpoint (the optimizer's own: skipped steps do not count). From ZeRO-0/1/2
    sources each parameter's step.pt holds it; from ZeRO-3 there is none, and the count is in the optimizer state
    dict DeepSpeed keeps beside the parameters (zero/optimizer_state.pt: rank 0's AdamW state over its flat
    partition, one entry per sub-group, all stepped together)."""
    steps = folder / "zero" / names[0] / "step.pt" if names else None
    if steps is not None and steps.exists():
        return float(torch.load(steps, weights_only=False))
    saved = torch.load(folder / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=False)
    counts = {float(s["step"]) for s in saved["optimizer_state_dict"]["state"].values() if "step" in s}
    if len(counts) != 1:
        raise ValueError(f"its ZeRO-3 optimizer state holds no single AdamW step count (found {sorted(counts)})")
    return counts.pop()


def _init_adam_state(optimizer: torch.optim.Optimizer, params: list[list[torch.Tensor]]) -> None:
    """AdamW's state for `params` (by group) as its first step creates it (zeros), where it has none yet:
    DeepSpeed's ZeRO optimizers create it lazily, and the universal checkpoint's moments are written into it."""
    for group, tensors in zip(optimizer.param_groups, params, strict=True):
        on_device = group.get("fused") or group.get("capturable")
        for p in tensors:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                for key in _STATES:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


def gathered_one(p: torch.nn.Parameter, zero_stage: int):
    """`p` whole for the duration, and what is written into it partitioned again on exit (ZeRO-3)."""
    if zero_stage < 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([p], modifier_rank=0)


def gathered(model: torch.nn.Module, zero_stage: int):
    """Full weights on every rank for the duration (ZeRO-3 partitions them)."""
    if zero_stage < 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)


def optimizer_kind(engine) -> str:
    """What steps the weights, for memory.json: DeepSpeed's wrapper (ZeRO's, or its bf16/fp16 optimizer at ZeRO-0) and
    the torch optimizer inside it with its kernel, e.g. "BF16_Optimizer > AdamW (fused)"."""
    outer = engine.optimizer
    inner = getattr(outer, "optimizer", outer)
    defaults = getattr(inner, "defaults", {})
    kernel = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "torch's default kernel"
    wrapper = f"{type(outer).__name__} > " if inner is not outer else ""
    return f"{wrapper}{type(inner).__name__} ({kernel})"


def record_state_bytes(engine, cfg: TrainConfig, dist: DistInfo, dp: int, path: Path) -> None:
    """memory.json: measured per-rank weight + optimizer-state bytes beside the memory model's
    prediction (common/memory.py: the bytes DeepSpeed allocates at this stage and precision, frozen
    weights in the compute dtype; the numbers run.dry_run and scripts/plan.py use).

    Collective; call after the first optimizer step (Adam state is created lazily)."""
    import torch.distributed as tdist

    measured = [None] * dist.world_size
    tdist.all_gather_object(measured, local_state_bytes(engine))
    if dist.is_main:
        params = list(engine.module.parameters())
        n = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params)
        trainable = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params if p.requires_grad)
        stage, precision = engine.zero_optimization_stage(), cfg.toggles.precision  # 0 on one rank
        states = model_state_bytes(trainable, stage, dp, deepspeed_state_bytes(stage, precision))
        frozen = (n - trainable) * (4 if precision == "fp32" else 2) / (dp if stage == 3 else 1)
        info = {
            "zero_stage": stage,
            "world_size": dist.world_size,
            "dp": dp,
            "num_params": n,
            "trainable_params": trainable,
            "per_rank_state_bytes": measured,
            "predicted_weights_plus_optimizer_bytes": states["weights"] + states["optimizer"] + frozen,
            "optimizer": optimizer_kind(engine),
        }
        path.write_text(json.dumps(info, indent=2))
