"""The DeepSpeed config dict, derived from the Hydra config in this one place (no JSON files)."""

from __future__ import annotations

from typing import Any

from common.config import TrainConfig


def build_deepspeed_config(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    t, o = cfg.trainer, cfg.optim
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch_size * t.grad_accum * world_size,
        "gradient_clipping": o.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": o.lr,
                "betas": [o.beta1, o.beta2],
                "eps": o.eps,
                "weight_decay": o.weight_decay,
                # torch's AdamW: no compiled DeepSpeed op needed (CPU, or a GPU without build tools)
                "torch_adam": True,
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


def zero_state_bytes(num_params: int, stage: int, dp: int, precision: str) -> dict[str, float]:
    """Per-rank bytes of weights, gradients and Adam state under ZeRO (Rajbhandari et al. 2020).

    Mixed precision keeps 2-byte weights and gradients plus a 12-byte fp32 copy, momentum
    and variance per parameter (K=12); fp32 keeps 4 + 4 + 8.
    """
    w, g, k = (2, 2, 12) if precision in ("bf16", "fp16", "fp8") else (4, 4, 8)
    weights = num_params * w / (dp if stage >= 3 else 1)
    grads = num_params * g / (dp if stage >= 2 else 1)
    optim = num_params * k / (dp if stage >= 1 else 1)
    return {"weights": weights, "grads": grads, "optimizer": optim, "total": weights + grads + optim}


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
