"""Video sampling: prompts -> clips with the shared sampler (common/diffusion/sampling.py: the folder's flow scheduler,
Wan 2.1's UniPC; classifier-free guidance against the empty prompt, as WanPipeline's default negative prompt), for a
training run's model and for an export folder (the parity tests, a server); and the clips written out as an MP4 and a
contact sheet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from common.diffusion.sampling import sample, save_grid, to_uint8
from recipes.video.weights import PromptEncoder, VideoVae, load_transformer, load_vae, scheduler_config


class VideoSampler:
    """A Wan transformer, its UMT5 prompt encoder, its VAE and scheduler: `__call__(prompts, generator)` -> clips in
    [-1, 1] [N, 3, F, H, W], deterministic given the generator (the starting noise is drawn from it as WanPipeline
    draws its own: one [N, C, f, h, w] normal on the CPU)."""

    def __init__(self, model, encode, vae, geometry: VideoVae, sampler_config: dict, clip: tuple[int, int, int]):
        self.model, self.encode, self.vae, self.geometry = model, encode, vae, geometry
        self.sampler_config, self.clip = sampler_config, clip
        self.empty = encode([""])  # the unconditional prompt (caption dropout trains on it)

    @classmethod
    def from_export(cls, folder: str | Path, *, device=torch.device("cpu"), clip=None, max_sequence_length=None):
        """The sampler of a video export (or any WanPipeline folder), in fp32; `clip` (frames, height, width) and
        the prompt length default to the export's kiln.json."""
        folder = Path(folder)
        info = json.loads((folder / "kiln.json").read_text()) if (folder / "kiln.json").exists() else {}
        clip = clip or (info["num_frames"], info["height"], info["width"])
        encode = PromptEncoder(
            folder,
            device=device,
            dtype=torch.float32,
            max_sequence_length=max_sequence_length or info.get("max_sequence_length", 512),
        )
        model = load_transformer(folder).eval().to(device)
        return cls(model, encode, load_vae(folder, device), VideoVae.of(folder), scheduler_config(folder), clip)

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        return self.geometry.latent_shape(*self.clip)

    def noise(self, n: int, seed: int) -> torch.Tensor:
        """The starting noise of n clips drawn from a generator seeded with `seed`: what `__call__` draws from that
        generator, and WanPipeline's for n videos of one prompt (`num_videos_per_prompt=n`)."""
        return torch.randn((n, *self.latent_shape), generator=torch.Generator().manual_seed(seed))

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
        device = self.empty["encoder_hidden_states"].device
        return sample(
            self.model,
            self.sampler_config,
            self.encode(prompts),
            self.empty,
            shape=self.latent_shape,
            steps=steps,
            guidance_scale=guidance_scale,
            generator=generator,
            noise=noise,
            device=device,
            dtype=dtype,
            decode=lambda x: self.geometry.decode(self.vae, x),
        )


def save_contact_sheet(videos: torch.Tensor, path: str | Path, scale: int = 4) -> None:
    """A PNG of clips [N, 3, F, H, W] in [-1, 1]: one row per clip, its frames left to right."""
    n, c, f, h, w = videos.shape
    save_grid(videos.permute(0, 2, 1, 3, 4).reshape(n * f, c, h, w), rows=n, path=path, scale=scale)


def write_mp4(video: torch.Tensor, path: str | Path | BinaryIO, fps: int = 16) -> None:
    """One clip [3, F, H, W] in [-1, 1] as an H.264 MP4 (PyAV; sides padded to even sizes, as yuv420p needs), to a
    file or to a binary file object (a BytesIO: the video server's response)."""
    import av

    frames = to_uint8(video.permute(1, 0, 2, 3))  # [F, H, W, 3]
    h, w = frames.shape[1:3]
    frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)))
    if isinstance(path, (str, Path)):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        target, options = str(path), {}
    else:  # a file object has no suffix to name the container
        target, options = path, {"format": "mp4"}
    with av.open(target, mode="w", **options) as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
