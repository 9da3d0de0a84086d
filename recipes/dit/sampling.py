"""Class-conditional DDIM sampling with classifier-free guidance, and sample-grid images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from diffusers import DDIMScheduler
from PIL import Image


@torch.no_grad()
def sample_images(
    model: torch.nn.Module,
    scheduler_config: dict,
    labels: torch.Tensor,
    *,
    null_class: int,
    image_size: int,
    in_channels: int,
    steps: int,
    guidance_scale: float,
    generator: torch.Generator,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    batch_size: int = 512,
    progress: str | None = None,
) -> torch.Tensor:
    """Images in [-1, 1], shape [N, C, S, S], for the class ids in `labels` (deterministic, eta=0).
    `progress`: show a progress bar over the denoising steps with this label (None: silent)."""
    from tqdm.auto import tqdm

    scheduler = DDIMScheduler.from_config(scheduler_config)
    scheduler.set_timesteps(steps)
    chunks = labels.split(batch_size)
    bar = tqdm(total=len(chunks) * steps, desc=progress, unit="step", disable=progress is None, dynamic_ncols=True)
    out = []
    for chunk in chunks:
        n = chunk.shape[0]
        x = torch.randn((n, in_channels, image_size, image_size), generator=generator).to(device)
        cond = torch.cat([chunk, torch.full_like(chunk, null_class)]).to(device)
        for t in scheduler.timesteps:
            t_batch = torch.full((2 * n,), int(t), device=device, dtype=torch.long)
            pred = model(torch.cat([x, x]).to(dtype), timestep=t_batch, class_labels=cond).sample.float()
            pred_cond, pred_uncond = pred.chunk(2)
            guided = pred_uncond + guidance_scale * (pred_cond - pred_uncond)
            x = scheduler.step(guided, t, x).prev_sample
            bar.update()
        out.append(x.clamp(-1, 1).cpu())
    bar.close()
    return torch.cat(out)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """[-1, 1] float [N, 1, S, S] -> uint8 [N, S, S]."""
    return ((images[:, 0].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()


def save_grid(images: torch.Tensor, rows: int, path: str | Path, scale: int = 4) -> None:
    """A PNG with `rows` rows (one per class), images upscaled `scale`x with a 1-pixel gap."""
    pix = to_uint8(images)
    n, s, _ = pix.shape
    cols = n // rows
    cell = s * scale + 1
    grid = np.full((rows * cell + 1, cols * cell + 1), 64, dtype=np.uint8)
    for i in range(rows * cols):
        r, c = divmod(i, cols)
        big = np.kron(pix[i], np.ones((scale, scale), dtype=np.uint8))
        grid[1 + r * cell : 1 + r * cell + s * scale, 1 + c * cell : 1 + c * cell + s * scale] = big
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid, mode="L").save(path)
