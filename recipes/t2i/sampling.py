"""Text-to-image sampling: prompts -> images with the shared sampler (common/diffusion/sampling.py: Euler on the flow's
velocity; classifier-free guidance against the empty prompt, or a guidance-distilled model's embedded scale), through
the pipeline's adapter (recipes/t2i/weights.py), for a training run's model and for an export folder (the parity
tests, sample scripts, a server)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from common.diffusion import vae as vae_lib
from common.diffusion.sampling import sample
from recipes.t2i.weights import Adapter, PromptEncoder, adapter, scheduler_config


class PromptSampler:
    """A transformer, its pipeline's adapter, prompt encoder, VAE and scheduler: `__call__(prompts, generator)` ->
    images in [-1, 1] [N, 3, S, S], deterministic given the generator (the starting noise is drawn from it as
    diffusers' pipelines draw theirs: one [N, C, h, w] normal on the CPU, before FluxPipeline packs it)."""

    def __init__(
        self,
        model,
        encode: PromptEncoder,
        vae,
        geometry: vae_lib.VaeGeometry,
        sampler_config: dict,
        adapter: Adapter,
    ):
        self.model, self.encode, self.vae, self.geometry = model, encode, vae, geometry
        self.sampler_config, self.adapter = sampler_config, adapter
        self.empty = encode([""])  # the unconditional prompt (caption dropout trains on it)

    @classmethod
    def from_export(cls, folder: str | Path, *, image_size: int, device=torch.device("cpu"), max_sequence_length=None):
        """The sampler of a text-to-image export (or any pipeline folder Kiln trains), in fp32."""
        from recipes.t2i.weights import load_transformer

        folder = Path(folder)
        info = json.loads((folder / "kiln.json").read_text()) if (folder / "kiln.json").exists() else {}
        model = load_transformer(folder).eval().to(device)
        spec = adapter(folder)
        encode = spec.prompt_encoder(
            device=device,
            dtype=torch.float32,
            max_sequence_length=max_sequence_length or info.get("max_sequence_length", 256),
        )
        geometry = vae_lib.vae_geometry(folder / "vae", image_size)
        return cls(model, encode, vae_lib.load_vae(geometry, device), geometry, scheduler_config(folder), spec)

    def noise(self, n: int, seed: int) -> torch.Tensor:
        """The starting noise of n images drawn from a generator seeded with `seed`: what `__call__` draws from that
        generator, and diffusers' pipeline for n images of one prompt (`num_images_per_prompt=n`)."""
        shape = (n, self.geometry.latent_channels, self.geometry.latent_size, self.geometry.latent_size)
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed))

    def __call__(
        self,
        prompts: list[str],
        generator: torch.Generator | None = None,
        *,
        steps: int,
        guidance_scale: float | torch.Tensor,
        noise: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Images for `prompts`, from `generator` or the given starting `noise` (an images server's batch of
        requests that each drew their own); `guidance_scale`: one, or one per prompt."""
        device = self.empty["pooled_projections"].device
        spec = self.adapter
        return sample(
            self.model,
            self.sampler_config,
            self.encode(prompts),
            self.empty if spec.classifier_free else None,
            image_size=self.geometry.latent_size,
            in_channels=self.geometry.latent_channels,
            steps=steps,
            guidance_scale=guidance_scale,
            generator=generator,
            noise=noise,
            device=device,
            dtype=dtype,
            decode=functools.partial(vae_lib.decode, self.vae, geometry=self.geometry),
            forward=functools.partial(spec.forward, self.model),
            set_timesteps=functools.partial(spec.set_timesteps, latent_size=self.geometry.latent_size),
        )
