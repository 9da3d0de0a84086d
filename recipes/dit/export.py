"""A DiT run's export/ rebuilt from any of its DeepSpeed checkpoints (scripts/export.py), in bounded memory: the
folder the end of the run writes (DiTTrainer.export), tensor for tensor, for the checkpoint's step.

The end of a run exports the EMA weights in the module's dtype, in diffusers' per-block layout: here they come
from the checkpoint's TrainState (the whole EMA by parameter name), anything the EMA does not track (buffers)
from DeepSpeed's model states, one safetensors shard at a time (common/ds_export.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.config import TrainConfig
from common.data.dataset import load_dataset_meta
from common.ds_export import ZeroCheckpoint, saved_ema, write_safetensors
from recipes.dit import vae as vae_lib
from recipes.dit.data import class_names
from recipes.dit.model import build_model, null_class
from recipes.dit.train import model_geometry, write_export_files


def export_checkpoint(cfg: TrainConfig, ckpt: ZeroCheckpoint, out: Path, *, step: int, max_shard_size) -> int:
    """Write the export of checkpoint `ckpt` (of step `step`) to `out`; returns the weight bytes written."""
    classes = class_names(load_dataset_meta(cfg.data.root))
    in_channels, sample_size, geometry = model_geometry(cfg)
    vae = None
    if geometry is not None:
        geometry = vae_lib.vae_geometry(cfg.diffusion.vae, cfg.data.image_size)  # the folder must be here
        vae = vae_lib.load_vae(geometry, torch.device("cpu"))
    with torch.device("meta"):
        model = build_model(cfg.model, sample_size, in_channels)
    # The EMA's names: the trainable parameters of model.named_parameters() (a shared embedding once).
    ema_name = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    # The saved layout: every state-dict key, a shared embedding under each block (untied()'s layout).
    tensors = model.state_dict(keep_vars=True)
    layout = {k: torch.empty(v.shape, dtype=ckpt.dtype if v.is_floating_point() else v.dtype, device="meta")
              for k, v in tensors.items()}

    def fetch(names: list[str]) -> dict[str, torch.Tensor]:
        from_ema = {n: ema_name[id(tensors[n])] for n in names if id(tensors[n]) in ema_name}
        got = ckpt.tensors([n for n in names if n not in from_ema])
        if from_ema:
            ema = saved_ema(ckpt.trainer_state())
            for n, name in from_ema.items():
                got[n] = ema[name].to(ckpt.dtype)
        return got

    folder = out / "transformer"
    written = write_safetensors(folder, "diffusion_pytorch_model.safetensors", layout, fetch, max_shard_size)
    model.save_config(folder)
    write_export_files(out, cfg, geometry, classes, vae=vae, step=step, null_class=null_class(model),
                       sample_size=sample_size)
    return written
