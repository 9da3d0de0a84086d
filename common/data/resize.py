"""Resize to cover a shape and center-crop to it (never squashed, never padded): the caption builder's images and the
video builder's and loaders' frames, one code path."""

from __future__ import annotations


def cover_crop(image, width: int, height: int):
    """`image` (PIL) resized (box-halved while twice the target, then bicubic) to cover width x height,
    center-cropped. An image of that size already comes back unchanged (PIL's resize to its own size is a copy)."""
    from PIL import Image

    while image.size[0] >= 2 * width and image.size[1] >= 2 * height:
        image = image.resize(tuple(x // 2 for x in image.size), resample=Image.BOX)
    scale = max(width / image.size[0], height / image.size[1])
    size = (max(width, round(image.size[0] * scale)), max(height, round(image.size[1] * scale)))
    image = image.resize(size, resample=Image.BICUBIC)
    left, top = (size[0] - width) // 2, (size[1] - height) // 2
    return image.crop((left, top, left + width, top + height))
