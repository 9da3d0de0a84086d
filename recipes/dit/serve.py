"""The DiT's images server (scripts/serve.py on a DiT export): OpenAI's /v1/images/generations through the shared
server (common/diffusion/server.py), where the prompt is a class name from the export's kiln.json (or a class id).

A seeded request returns the images `scripts/sample_dit.py classes=<prompt> per_class=<n> seed=<seed>` gives on the
same backend (TensorRT, onnxruntime or PyTorch: recipes/dit/onnx.py's ExportSampler)."""

from __future__ import annotations

import torch

from common.diffusion.server import IMAGES, RequestError
from recipes.dit.onnx import ExportSampler


def resolve_class(prompt: str, classes: list[str]) -> int:
    text = prompt.strip()
    if text in classes:
        return classes.index(text)
    folded = [c.casefold() for c in classes]
    if text.casefold() in folded:
        return folded.index(text.casefold())
    if text.isdigit() and int(text) < len(classes):
        return int(text)
    shown = ", ".join(repr(c) for c in classes[:8]) + (", ..." if len(classes) > 8 else "")
    raise RequestError(
        f"prompt {prompt[:80]!r} is not a class of this model; the prompt is a class name or id "
        f"(0..{len(classes) - 1}), e.g. {shown}",
        "prompt",
    )


class ClassImages:
    """A DiT export as the images server serves it (common/diffusion/server.py's ServedImages)."""

    media = IMAGES

    def __init__(self, sampler: ExportSampler):
        self.sampler = sampler
        self.image_size = sampler.image_size
        self.size = f"{self.image_size}x{self.image_size}"
        self.sample_steps = int(sampler.info["sample_steps"])
        self.guidance_scale = float(sampler.info["guidance_scale"])
        self.card = {"classes": sampler.classes}

    def condition(self, prompt: str) -> int:
        return resolve_class(prompt, self.sampler.classes)

    def noise(self, n: int, seed: int) -> torch.Tensor:
        return self.sampler.noise(n, seed)

    def draw(self, labels: list[int], noise: torch.Tensor, steps: int, guidance_scale: torch.Tensor) -> torch.Tensor:
        return self.sampler(
            torch.tensor(labels), noise=noise, steps=steps, guidance_scale=guidance_scale, batch_size=len(labels)
        )


def load(export, engine: str, device: str | None) -> ClassImages:
    """The DiT export on backend `engine` (tensorrt, onnxruntime or torch); `device` None: the backend's default."""
    return ClassImages(ExportSampler(export, engine, **({} if engine == "onnxruntime" else {"device": device})))


def load_export(export, engine: str, device: str | None) -> ClassImages:
    """What scripts/serve.py's images server serves (the registry's server_module): load()."""
    return load(export, engine, device)
