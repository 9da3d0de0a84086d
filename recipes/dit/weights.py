"""Pretrained DiT weights in (`model.init_from`): a diffusers DiTTransformer2DModel folder, found in a DiTPipeline
folder (its transformer/), a Kiln DiT export or run dir, or given itself. Its config.json sets the architecture
(`model.*`, in `complete`); the weights are loaded into the model the recipe builds, strictly."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from common.errors import ConfigError
from common.weights import check_folder

# model.* keys and the DiTTransformer2DModel config.json entries they come from.
CHECKPOINT_KEYS = {
    "num_layers": "num_layers",
    "num_attention_heads": "num_attention_heads",
    "attention_head_dim": "attention_head_dim",
    "patch_size": "patch_size",
    "in_channels": "in_channels",
    "num_classes": "num_embeds_ada_norm",
    "norm_num_groups": "norm_num_groups",
    "dropout": "dropout",
}


def transformer_folder(init_from: str) -> Path:
    """The DiTTransformer2DModel folder `model.init_from` names (one line if none, or if a weight file is damaged)."""
    path = Path(init_from).expanduser().absolute()
    for candidate in (path / "export" / "transformer", path / "transformer", path):
        config = candidate / "config.json"
        if config.exists() and json.loads(config.read_text()).get("_class_name") == "DiTTransformer2DModel":
            if not any(candidate.glob("*.safetensors")):
                raise ConfigError(f"model.init_from={init_from}: no *.safetensors weights in {candidate}")
            check_folder(candidate, f"model.init_from={init_from}")  # one line for a file cut short
            return candidate
    raise ConfigError(
        f"model.init_from={init_from}: no diffusers DiTTransformer2DModel there (a DiTPipeline folder, a "
        "Kiln DiT export or run dir, or a transformer folder with config.json)"
    )


def base_config(folder: Path) -> dict:
    """The base's config.json, refusing what Kiln's DiT does not implement."""
    config = json.loads((folder / "config.json").read_text())
    out = config.get("out_channels") or config["in_channels"]
    if out != config["in_channels"]:
        raise ConfigError(
            f"model.init_from={folder}: out_channels={out} != in_channels={config['in_channels']} (a learned "
            "variance head, as in DiT-XL-2's release); Kiln's DiT predicts one value per input channel"
        )
    if not config.get("num_embeds_ada_norm"):
        raise ConfigError(f"model.init_from={folder}: not a class-conditional DiT (no num_embeds_ada_norm)")
    return config


def load_weights(model: torch.nn.Module, folder: Path) -> int:
    """The base's tensors into `model` (built from the same config), strictly; returns how many."""
    from safetensors.torch import load_file

    state = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    model.load_state_dict(state)
    return len(state)
