"""Memory arithmetic for dry runs: ZeRO model states and transformer activations per device."""

from __future__ import annotations

GIB = 2**30


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


def activation_bytes(*, seq: int, batch: int, hidden: int, layers: int, recompute: str, precision: str) -> float:
    """Korthikanti et al. (2022): s·b·h·(34 + 5·a·s/h) bytes per layer in 16-bit. Flash/SDPA
    kernels do not keep the a·s² score matrices, so the 5·a·s/h term is dropped; full
    recomputation keeps only each layer's 2·s·b·h input. fp32 doubles everything."""
    per_layer = (2 if recompute == "full" else 34) * seq * batch * hidden
    return per_layer * layers * (2.0 if precision == "fp32" else 1.0)


def print_estimate(title: str, num_params: int, states: dict[str, float], activations: float, note: str,
                   frozen_bytes: float = 0.0) -> None:
    print(f"{title}: {num_params:,} parameters ({num_params / 1e9:.2f}B)")
    rows = [("weights", states["weights"] + frozen_bytes), ("grads", states["grads"]),
            ("optimizer", states["optimizer"]), ("activations", activations)]
    for key, value in rows:
        print(f"  {key:<14}{value / GIB:10.2f} GiB")
    print(f"  {'total':<14}{sum(v for _, v in rows) / GIB:10.2f} GiB   {note}")
