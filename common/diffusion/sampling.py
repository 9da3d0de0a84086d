"""Conditional sampling with classifier-free guidance (DDIM for DDPM models, Euler for flow models), and
sample grids."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from common.diffusion.objective import scheduler_from_config

GRID_MAX_CLASSES = 32  # sample grids show one row per class, for the first this many classes


@torch.no_grad()
def sample_images(
    model: torch.nn.Module,
    scheduler_config: dict,
    labels: torch.Tensor,
    *,
    null_class: int,
    **kwargs,
) -> torch.Tensor:
    """Images in [-1, 1] for the class ids in `labels` (deterministic given `generator`): `sample` with the
    class-conditional DiT's conditioning, `class_labels`, and the null class as the unconditional one."""
    return sample(
        model,
        scheduler_config,
        {"class_labels": labels},
        {"class_labels": torch.tensor([null_class], dtype=labels.dtype)},
        **kwargs,
    )


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    scheduler_config: dict,
    conditions: dict[str, torch.Tensor],
    unconditional: dict[str, torch.Tensor] | None,
    *,
    image_size: int = 0,
    in_channels: int = 0,
    shape: tuple[int, ...] = (),
    steps: int,
    guidance_scale: float | torch.Tensor,
    generator: torch.Generator | None = None,
    device: torch.device,
    noise: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    batch_size: int = 512,
    progress: str | None = None,
    decode: Callable[[torch.Tensor], torch.Tensor] | None = None,
    forward: Callable[..., torch.Tensor] | None = None,
    set_timesteps: Callable[[object, int], None] | None = None,
) -> torch.Tensor:
    """Images in [-1, 1], one per row of `conditions`, with classifier-free guidance (deterministic given
    `generator`); the one sampler of every diffusion recipe, whatever conditions its transformer.

    `conditions` are the model's conditioning keyword arguments, one row per image (the DiT's `class_labels`; a
    text-to-image transformer's `encoder_hidden_states` and `pooled_projections`); `unconditional` the same keys
    with one row (the null class; the empty prompt's embeddings), paired with every image for guidance; None: no
    pair, one model call per step (a guidance-distilled model, which reads the scale itself, or an unguided one).
    The model is called as `model(x, timestep=t, **conditioning).sample` on the conditional and unconditional halves
    at once, or as `forward(x, t, conditioning, scales)` (a transformer that takes its inputs otherwise: FLUX.1's
    packed tokens; `scales`: each row's guidance scale), and the schedule set by `scheduler.set_timesteps(steps)`,
    or `set_timesteps(scheduler, steps)`.
    It works on `in_channels` x `image_size`^2 inputs (pixels, or VAE latents), or on inputs of `shape` per sample
    (a video's [C, F, h, w] latents); the scheduler (`scheduler_config`: DDPM/DDIM, FlowMatchEulerDiscrete or a
    flow-prediction UniPC, see common.diffusion.objective) picks the sampler. `decode` maps each chunk of final
    model-space samples to images (a VAE's decoder); None: they are pixels, clamped to [-1, 1].
    `progress`: a progress bar label (None: silent). The starting noise is drawn from `generator` chunk by
    chunk, or given whole as `noise` [N, C, S, S] (an images server batches requests that each drew their own).
    `guidance_scale` is one scale, or one per image."""
    from tqdm.auto import tqdm

    if (noise is None) == (generator is None):
        raise ValueError("sample needs a generator or the starting noise, not both")
    scheduler = scheduler_from_config(scheduler_config)
    if forward is None:

        def forward(x, t, conditioning, scales):
            return model(x, timestep=t, **conditioning).sample

    pairs = 1 if unconditional is None else 2  # rows per image in a model call
    total = next(iter(conditions.values())).shape[0]
    starts = range(0, total, batch_size)
    shape = tuple(shape) or (in_channels, image_size, image_size)
    scales = torch.as_tensor(guidance_scale, dtype=torch.float32).expand(total).reshape(-1, *[1] * len(shape))
    bar = tqdm(total=len(starts) * steps, desc=progress, unit="step", disable=progress is None, dynamic_ncols=True)
    out = []
    for start in starts:
        scale = scales[start : start + batch_size].to(device)
        # (Re)setting the timesteps also resets the flow scheduler's step index.
        scheduler.set_timesteps(steps) if set_timesteps is None else set_timesteps(scheduler, steps)
        n = scale.shape[0]
        x = (torch.randn((n, *shape), generator=generator) if noise is None else noise[start : start + n]).to(device)
        cond = _chunk_conditions(conditions, unconditional, start, n, device=device, dtype=dtype)
        for t in scheduler.timesteps:
            # DDIM's timesteps are integers, the flow scheduler's floats (sigma * T): the DiT's
            # sinusoidal embedding takes either.
            t_batch = t.to(device).expand(pairs * n)
            row_scales = scale.view(-1).repeat(pairs)
            pred = forward(torch.cat([x] * pairs).to(dtype), t_batch, cond, row_scales).float()
            guided = pred if unconditional is None else _guided(pred, scale)
            x = scheduler.step(guided, t, x).prev_sample
            bar.update()
        out.append((decode(x) if decode is not None else x.clamp(-1, 1)).float().cpu())
    bar.close()
    return torch.cat(out)


def _chunk_conditions(
    conditions: dict[str, torch.Tensor],
    unconditional: dict[str, torch.Tensor] | None,
    start: int,
    n: int,
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Rows ``start .. start+n`` of the conditions, followed by ``n`` unconditional rows when guided; on ``device``,
    floating ones in ``dtype``."""
    cond = {
        key: (
            value[start : start + n]
            if unconditional is None
            else torch.cat([value[start : start + n], unconditional[key].expand(n, *value.shape[1:])])
        ).to(device)
        for key, value in conditions.items()
    }
    return {key: value.to(dtype) if value.is_floating_point() else value for key, value in cond.items()}


def _guided(pred: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance of a prediction on the conditional rows, then the unconditional ones."""
    pred_cond, pred_uncond = pred.chunk(2)
    return pred_uncond + scale * (pred_cond - pred_uncond)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """[-1, 1] float [N, C, S, S] -> uint8 [N, S, S] (one channel) or [N, S, S, C] (RGB)."""
    pix = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return pix[:, 0].numpy() if pix.shape[1] == 1 else pix.permute(0, 2, 3, 1).numpy()


def save_grid(images: torch.Tensor, rows: int, path: str | Path, scale: int = 4) -> None:
    """A PNG with `rows` rows (one per class), images upscaled `scale`x with a 1-pixel gap."""
    pix = to_uint8(images)
    n, s = pix.shape[:2]
    channels = pix.shape[3:]  # () for grayscale, (3,) for RGB
    cols = n // rows
    cell = s * scale + 1
    grid = np.full((rows * cell + 1, cols * cell + 1, *channels), 64, dtype=np.uint8)
    for i in range(rows * cols):
        r, c = divmod(i, cols)
        big = pix[i].repeat(scale, axis=0).repeat(scale, axis=1)
        grid[1 + r * cell : 1 + r * cell + s * scale, 1 + c * cell : 1 + c * cell + s * scale] = big
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid).save(path)
