"""What the video recipe knows of a Wan pipeline's shape without loading it: its transformer's config.json and its
VAE's compression, from the folder, or for a released pipeline not on this machine, from RELEASED below (sizing a
run before downloading it: run.dry_run, scripts/plan.py). The clip checks (frames 4k+1, sides a multiple of the VAE's
compression x the patch) and the context-parallel checks read it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from common.errors import ConfigError


@dataclass(frozen=True)
class Architecture:
    source: str  # for messages: the folder, or the release it was taken from
    transformer: dict
    vae_temporal: int
    vae_spatial: int

    @property
    def patch(self) -> tuple[int, int, int]:
        return tuple(self.transformer["patch_size"])

    def tokens(self, num_frames: int, height: int, width: int) -> int:
        """Patch tokens of one num_frames x height x width clip."""
        pt, ph, pw = self.patch
        frames = (num_frames - 1) // self.vae_temporal + 1
        return (frames // pt) * (height // self.vae_spatial // ph) * (width // self.vae_spatial // pw)

    def check_clip(self, num_frames: int, height: int, width: int) -> None:
        """One line unless num_frames x height x width clips fit the VAE and the transformer's patches."""
        if (num_frames - 1) % self.vae_temporal:
            raise ConfigError(
                f"data.num_frames={num_frames} must be {self.vae_temporal}k+1 (the VAE in {self.source} keeps the "
                f"first frame and compresses the rest {self.vae_temporal} to 1), e.g. "
                f"{(num_frames - 1) // self.vae_temporal * self.vae_temporal + 1}"
            )
        pt, ph, pw = self.patch
        if ((num_frames - 1) // self.vae_temporal + 1) % pt:
            raise ConfigError(f"data.num_frames={num_frames}: its latent frames do not divide into patches of {pt}")
        for key, side, p in (("height", height, ph), ("width", width, pw)):
            if side % (self.vae_spatial * p):
                raise ConfigError(
                    f"data.{key}={side} must be a multiple of {self.vae_spatial * p} (the VAE's {self.vae_spatial}x "
                    f"x the transformer's patch {p}) for {self.source}"
                )

    def check_cp(self, cfg) -> None:
        """parallel.cp (Ulysses over the video tokens): cp divides the heads and a clip's tokens."""
        from common import ulysses

        if cfg.parallel.cp == 1:
            return
        d = cfg.data
        ulysses.check_layout(
            cfg,
            heads=self.transformer["num_attention_heads"],
            tokens=self.tokens(d.num_frames, d.height, d.width),
            heads_from="model.init_from's transformer",
            tokens_from=f"data.num_frames={d.num_frames} x data.height={d.height} x data.width={d.width} through "
            f"the VAE and patches {list(self.patch)}",
        )


# Released pipelines, for sizing without their folders: transformer/config.json's keys (Wan-AI/Wan2.1-T2V-1.3B-Diffusers
# and -14B-Diffusers) and the VAE's compression (4 in time, 8 a side, both releases).
RELEASED = {
    "Wan2.1-T2V-1.3B-Diffusers": {
        "_class_name": "WanTransformer3DModel",
        "patch_size": [1, 2, 2],
        "num_attention_heads": 12,
        "attention_head_dim": 128,
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": 4096,
        "freq_dim": 256,
        "ffn_dim": 8960,
        "num_layers": 30,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-06,
        "rope_max_seq_len": 1024,
    },
    "Wan2.1-T2V-14B-Diffusers": {
        "_class_name": "WanTransformer3DModel",
        "patch_size": [1, 2, 2],
        "num_attention_heads": 40,
        "attention_head_dim": 128,
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": 4096,
        "freq_dim": 256,
        "ffn_dim": 13824,
        "num_layers": 40,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-06,
        "rope_max_seq_len": 1024,
    },
}


def architecture(init_from: str) -> Architecture:
    """The shape of model.init_from: its folder's configs, or a release's (by the folder's name) when the folder is
    not here; one line for neither."""
    folder = Path(init_from).expanduser()
    if folder.exists():
        from recipes.video.weights import pipeline_folder

        folder = pipeline_folder(init_from)
        transformer = json.loads((folder / "transformer" / "config.json").read_text())
        vae = json.loads((folder / "vae" / "config.json").read_text())
        return Architecture(
            str(folder), transformer, vae.get("scale_factor_temporal", 4), vae.get("scale_factor_spatial", 8)
        )
    if folder.name in RELEASED:
        source = f"{folder.name} (the release's shape: model.init_from is not on this machine)"
        return Architecture(source, RELEASED[folder.name], 4, 8)
    raise ConfigError(
        f"model.init_from={init_from}: no such folder, and not a release the video recipe knows the shape of "
        f"({', '.join(RELEASED)})"
    )
