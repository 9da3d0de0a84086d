"""DeepSpeed for the ZeRO recipes (DiT, VLM): the config dict derived from the Hydra config in
this one place (no JSON files), engine creation, checkpoints, gradient norm, state bytes."""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import Any

import torch

from common.checkpoint import read_meta
from common.config import TrainConfig
from common.distributed import DistInfo
from common.errors import ConfigError
from common.memory import deepspeed_state_bytes, model_state_bytes
from common.optim import lr_factor


def build_deepspeed_config(cfg: TrainConfig, dp: int) -> dict[str, Any]:
    t, o = cfg.trainer, cfg.optim
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
            "stage": cfg.parallel.zero_stage,
            "contiguous_gradients": True,
            "overlap_comm": cfg.parallel.zero_stage >= 2,
            # Resume restores Adam state from the fp32 partitions: bitwise continuation.
            "load_from_fp32_weights": True,
        },
        "steps_per_print": 10**9,  # Kiln logs; keep DeepSpeed's own step logs quiet
        "wall_clock_breakdown": False,
    }
    if cfg.parallel.zero_stage == 3:
        # Gather full weights for export/eval (stage3_gather_16bit_weights_on_model_save).
        ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        # Every parameter partitioned (none kept whole): common/ema.py tracks partitions.
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if cfg.toggles.precision in ("bf16", "fp8"):
        ds["bf16"] = {"enabled": True}
    elif cfg.toggles.precision == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return ds


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


def initialize(model: torch.nn.Module, cfg: TrainConfig, dp: int):
    """A DeepSpeed engine over `model`'s trainable parameters, with Kiln's LR schedule."""
    import deepspeed

    schedule = functools.partial(lr_factor, cfg=cfg.optim, max_steps=cfg.trainer.max_steps)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=build_deepspeed_config(cfg, dp),
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


def load_checkpoint(engine, path: Path, *, load_optimizer: bool = True, strict: bool = True) -> None:
    """Restore the engine (model, optimizer, LR schedule; ZeRO shards per rank) from `path`. `strict=False`: the
    checkpoint holds the trainable parameters only (saved with exclude_frozen_parameters)."""
    import torch.distributed as tdist

    meta = read_meta(path)
    world = tdist.get_world_size() if tdist.is_initialized() else 1
    if load_optimizer and meta["world_size"] != world:
        raise ConfigError(
            f"run.resume: {path} was written by {meta['world_size']} ranks; this run has {world} "
            "(resume with the same number of ranks)"
        )
    engine.load_checkpoint(
        str(path.parent), tag=path.name, load_optimizer_states=load_optimizer,
        load_lr_scheduler_states=load_optimizer, load_module_only=not load_optimizer, load_module_strict=strict,
    )


def gathered(model: torch.nn.Module, zero_stage: int):
    """Full weights on every rank for the duration (ZeRO-3 partitions them)."""
    if zero_stage < 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)


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
        stage, precision = cfg.parallel.zero_stage, cfg.toggles.precision
        states = model_state_bytes(trainable, stage, dp, deepspeed_state_bytes(stage, precision))
        frozen = (n - trainable) * (4 if precision == "fp32" else 2) / (dp if stage == 3 else 1)
        info = {
            "zero_stage": stage, "world_size": dist.world_size, "dp": dp,
            "num_params": n, "trainable_params": trainable, "per_rank_state_bytes": measured,
            "predicted_weights_plus_optimizer_bytes": states["weights"] + states["optimizer"] + frozen,
        }
        path.write_text(json.dumps(info, indent=2))
