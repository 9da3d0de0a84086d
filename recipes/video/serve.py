"""The text-to-video server (scripts/serve.py on a video export): the images server's API at
`POST /v1/videos/generations` (common/diffusion/server.py: the same auth, validation, seeds and batching), where the
prompt is text, drawn by recipes/video/sampling.py's VideoSampler in fp32 and answered as H.264 MP4 clips (write_mp4).

A seeded request of n clips returns what diffusers' WanPipeline on the export draws for that prompt with
`generator=torch.Generator().manual_seed(seed)`, `num_videos_per_prompt=n` and the export's kiln.json clip
(num_frames, height, width) and max_sequence_length, whatever else shares its batch, within the MP4's H.264 loss.
A prompt longer than UMT5 reads (max_sequence_length tokens) is refused (400): diffusers would drop its end."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

from common.diffusion.server import Media, PromptSampled, RequestError
from recipes.video.sampling import VideoSampler, write_mp4

FPS = 16  # Wan 2.1's frame rate (diffusers' export_to_video in its examples; the training samples' MP4s)


def mp4_bytes(clip: torch.Tensor) -> bytes:
    """One clip [3, F, H, W] in [-1, 1] as MP4 file bytes."""
    buffer = io.BytesIO()
    write_mp4(clip, buffer, fps=FPS)
    return buffer.getvalue()


class PromptVideos(PromptSampled):
    """A video export as the videos server serves it (common/diffusion/server.py's ServedImages)."""

    def __init__(self, sampler: VideoSampler, info: dict):
        self.sampler = sampler
        self.num_frames, height, width = (int(info[k]) for k in ("num_frames", "height", "width"))
        self.size = f"{width}x{height}"
        self.sample_steps = int(info["sample_steps"])
        self.guidance_scale = float(info["guidance_scale"])
        self.media = Media("videos", "mp4", mp4_bytes, {"num_frames": self.num_frames, "fps": FPS})
        self.card = {"num_frames": self.num_frames, "fps": FPS, "size": self.size}

    def condition(self, prompt: str) -> str:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        encode = self.sampler.encode
        count = len(encode.tokenizer(prompt_clean(prompt), verbose=False).input_ids)  # as PromptEncoder tokenizes
        if count > encode.max_sequence_length:
            raise RequestError(
                f"prompt is {count} tokens, longer than this model's text encoder reads (UMT5: "
                f"{encode.max_sequence_length} tokens, the export's max_sequence_length); shorten it",
                "prompt",
            )
        return prompt


def load(export: str | Path, device: str | None) -> PromptVideos:
    """The video export on `device` (None: the CPU)."""
    info = json.loads((Path(export) / "kiln.json").read_text())
    return PromptVideos(VideoSampler.from_export(export, device=torch.device(device or "cpu")), info)


def load_export(export: str | Path, engine: str, device: str | None) -> PromptVideos:
    """What scripts/serve.py's videos server serves (the registry's server_module): load() (engine: torch, the one)."""
    return load(export, device)
