"""The text-to-image images server (scripts/serve.py on a text-to-image export): OpenAI's /v1/images/generations
through the shared server (common/diffusion/server.py), where the prompt is text, drawn by recipes/t2i/sampling.py's
PromptSampler in fp32.

A seeded request of n images returns what diffusers' StableDiffusion3Pipeline on the export draws for that prompt
with `generator=torch.Generator().manual_seed(seed)`, `num_images_per_prompt=n` and the export's kiln.json size and
max_sequence_length, whatever else shares its batch. A prompt longer than every text encoder reads is refused (400):
diffusers would drop its end silently but for a warning; one that only some encoders truncate (CLIP's 77 tokens
under SD3's longer T5 window) is drawn as diffusers draws it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from common.diffusion.server import IMAGES, PromptSampled, RequestError
from recipes.t2i.sampling import PromptSampler


class PromptImages(PromptSampled):
    """A text-to-image export as the images server serves it (common/diffusion/server.py's ServedImages)."""

    media = IMAGES

    def __init__(self, sampler: PromptSampler, info: dict):
        self.sampler = sampler
        self.image_size = int(info["image_size"])
        self.size = f"{self.image_size}x{self.image_size}"
        self.sample_steps = int(info["sample_steps"])
        self.guidance_scale = float(info["guidance_scale"])
        self.card = {}
        encode = sampler.encode
        windows = [(f"CLIP ({i + 1})", tok, encode.clip_length) for i, (tok, enc) in enumerate(encode.clip) if enc]
        if encode.t5[1] is not None:
            windows.append(("T5", encode.t5[0], encode.max_sequence_length))
        self.windows = windows  # (name, tokenizer, tokens it reads) per text encoder

    def condition(self, prompt: str) -> str:
        counts = [
            (name, len(tokenizer(prompt, verbose=False).input_ids), window) for name, tokenizer, window in self.windows
        ]
        if all(count > window for _, count, window in counts):
            read = ", ".join(f"{name} {window}" for name, _, window in counts)
            raise RequestError(
                f"prompt is {max(c for _, c, _ in counts)} tokens, longer than every text encoder of this model reads "
                f"(tokens: {read}); shorten it",
                "prompt",
            )
        return prompt


def load(export: str | Path, device: str | None) -> PromptImages:
    """The text-to-image export on `device` (None: the CPU)."""
    info = json.loads((Path(export) / "kiln.json").read_text())
    sampler = PromptSampler.from_export(
        export, image_size=int(info["image_size"]), device=torch.device(device or "cpu")
    )
    return PromptImages(sampler, info)


def load_export(export: str | Path, engine: str, device: str | None) -> PromptImages:
    """What scripts/serve.py's images server serves (the registry's server_module): load() (engine: torch, the one)."""
    return load(export, device)
