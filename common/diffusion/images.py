"""Images in and out of the diffusion models' space: PNG bytes from a shard to uint8 arrays, uint8 to [-1, 1]."""

from __future__ import annotations

import io

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image


def to_model_space(images_u8: torch.Tensor, image_size: int) -> torch.Tensor:
    """uint8 [N, H, W] (grayscale) or [N, H, W, C] -> float [N, C, S, S] in [-1, 1]. Bilinear resizing
    (8x8 digits are upscaled; a larger source is downscaled with antialiasing)."""
    x = images_u8.float().div(127.5).sub(1.0)
    x = x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2)
    if x.shape[-1] != image_size:
        x = F.interpolate(
            x, size=(image_size, image_size), mode="bilinear", align_corners=False, antialias=x.shape[-1] > image_size
        )
    return x.clamp(-1.0, 1.0)


def decode_png(data: bytes, channels: int = 1) -> np.ndarray:
    """A shard's PNG bytes -> uint8 image [H, W] (channels=1) or [H, W, 3]."""
    with Image.open(io.BytesIO(data)) as im:
        return np.array(im.convert("L" if channels == 1 else "RGB"), dtype=np.uint8)  # a writable copy
