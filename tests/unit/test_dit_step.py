"""The DiT's GPU step, on what a CPU can check: one rank runs ZeRO-0 (nothing to partition), the presets' latent cache
default (data.latents=auto), and Kiln's FLOP count of DiT-XL/2 against the DiT paper's. On CUDA (gpu-marked): torch's
FlashAttention runs the DiT's attention in bf16."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from common.deepspeed import build_deepspeed_config, single_rank_note
from common.diffusion import latents
from common.errors import ConfigError
from scripts.kiln.launch import compose

# Peebles & Xie 2023, Table 1: DiT-XL/2 at 256x256 (32x32x4 latents, 256 tokens) costs 118.6 Gflops a forward pass,
# counted as multiply-adds (fvcore's convention: one per MAC). Kiln counts 2 FLOPs per multiply-add (torch's
# FlopCounterMode, common/flops.py): the same forward is 2 x 118.6e9 FLOPs in Kiln's convention.
DIT_PAPER_XL2_GMACS = 118.6


def xl2_forward_macs(layers=28, hidden=1152, tokens=256, patch=2, channels=4) -> float:
    """DiT-XL/2's forward multiply-adds by hand: per block q, k, v, out (4 d^2) and the 4x MLP (8 d^2) on every token,
    Q K^T and P V (2 T^2 d), adaLN's 6 d^2 on one conditioning vector per image; the patch embedding and the final
    layer's projection per token, its adaLN (2 d^2) once; the timestep MLP (256 d + d^2) once."""
    d, t = hidden, tokens
    blocks = layers * (12 * t * d * d + 2 * t * t * d + 6 * d * d)
    ends = t * patch * patch * channels * d * 2 + 2 * d * d + 256 * d + d * d
    return blocks + ends


def test_one_rank_runs_zero0_and_says_so():
    cfg = compose(["recipe=dit_xl2"])
    assert cfg.parallel.zero_stage == 2
    assert build_deepspeed_config(cfg, 1)["zero_optimization"]["stage"] == 0  # one GPU: no partitioning
    assert build_deepspeed_config(cfg, 2)["zero_optimization"]["stage"] == 2  # two: ZeRO-2 as configured
    note = single_rank_note(cfg, 1)
    assert note.startswith("kiln: parallel.zero_stage=2 on one rank") and "\n" not in note
    assert single_rank_note(cfg, 2) is None
    cp = compose(["recipe=dit_xl2", "parallel.cp=2"])  # one dp group of 2 cp ranks: ZeRO still splits over them
    assert build_deepspeed_config(cp, 1)["zero_optimization"]["stage"] == 2 and single_rank_note(cp, 1) is None


def test_kiln_counts_dit_xl2_at_twice_the_papers_multiply_adds():
    from common.flops import FlopCounter
    from recipes.dit.model import build_model

    cfg = compose(["recipe=dit_xl2"])
    with torch.device("meta"):
        model = build_model(cfg.model, 32, 4)  # 256 px through SD's VAE: 4 x 32 x 32 latents
        z, t, y = torch.empty(1, 4, 32, 32), torch.zeros(1), torch.zeros(1, dtype=torch.long)
        with FlopCounter() as forward:
            out = model(z, timestep=t, class_labels=y).sample
        with FlopCounter() as backward:
            out.float().square().mean().backward()
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(675e6, rel=0.001)  # the paper's 675M
    by_hand = xl2_forward_macs()
    assert by_hand == pytest.approx(DIT_PAPER_XL2_GMACS * 1e9, rel=0.001)
    # The counter on the real model: 2 FLOPs per multiply-add, within 0.1% of both (diffusers' per-block embedding
    # tables and final-layer shapes differ from the paper's by less).
    assert forward.flops == pytest.approx(2 * by_hand, rel=0.001)
    assert forward.flops == pytest.approx(2 * DIT_PAPER_XL2_GMACS * 1e9, rel=0.001)
    # Backward: two matmuls per forward one (input and weight gradients). On the meta device SDPA runs as two bmm
    # (4 backward); a fused kernel's backward counts the recomputed Q K^T too (torch's formula), +0.6% of the step.
    assert (forward.flops + backward.flops) / forward.flops == pytest.approx(3.0, abs=0.001)


def _cache(folder):
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"source": "latents"}))
    return folder


def test_auto_latents_takes_the_cache_beside_the_images_or_says_it_encodes(tmp_path, capsys):
    data = SimpleNamespace(root=str(tmp_path / "images"), latents="auto", buckets=False)
    cfg = SimpleNamespace(data=data, recipe=SimpleNamespace(name="dit_xl2"))
    latents.resolve(cfg, note=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert data.latents == "" and len(err) == 1
    assert err[0].startswith("kiln: note: data.latents=auto: encoding every batch")
    assert f"no latent cache at {tmp_path}/images_latents" in err[0]
    cache = _cache(tmp_path / "images_latents")
    data.latents = "auto"
    latents.resolve(cfg, note=True)
    assert data.latents == str(cache) and capsys.readouterr().err == ""
    data.latents, data.buckets = "auto", True  # a cache holds square images only
    latents.resolve(cfg, note=False)
    assert data.latents == "" and capsys.readouterr().err == ""
    # An explicit folder: taken as given; one line when it holds no cache.
    data.latents = str(tmp_path / "nowhere")
    assert latents.missing_cache(cfg).startswith(f"data.latents={tmp_path}/nowhere holds no latent cache")
    data.latents = str(cache)
    assert latents.missing_cache(cfg) is None


def test_presets_default_to_the_cache_and_refuse_a_missing_one(tmp_path):
    root = tmp_path / "images"
    for recipe in ("dit_xl2", "dit_2b"):
        assert compose([f"recipe={recipe}", f"data.root={root}"], 1).data.latents == ""  # none yet: on the fly
    cache = _cache(tmp_path / "images_latents")
    assert compose(["recipe=dit_xl2", f"data.root={root}"], 1).data.latents == str(cache)
    assert compose(["recipe=dit_xl2", f"data.root={root}", "data.latents="], 1).data.latents == ""  # opted out
    with pytest.raises(ConfigError, match="holds no latent cache"):
        compose(["recipe=dit_xl2", f"data.root={root}", f"data.latents={tmp_path}/other"], 1)
    for recipe in ("sd35_medium", "flux_dev"):
        assert compose([f"recipe={recipe}"]).data.latents == ""  # text-to-image alike: no data/captioned_latents here


@pytest.mark.gpu
def test_dit_attention_runs_on_torchs_flash_kernel_in_bf16():
    """toggles.attention=sdpa (diffusers' AttnProcessor2_0) on DiT-XL/2's heads (16 x 72) in bf16: torch's
    FlashAttention kernel takes it (restricted to that one backend, any other would raise), forward and backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from recipes.dit.model import build_model

    cfg = compose(["recipe=dit_xl2", "model.num_layers=2"])
    model = build_model(cfg.model, 32, 4).to("cuda", torch.bfloat16)
    z = torch.randn(4, 4, 32, 32, device="cuda", dtype=torch.bfloat16)
    t, y = torch.randint(0, 1000, (4,), device="cuda"), torch.randint(0, 1000, (4,), device="cuda")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = model(z, timestep=t, class_labels=y).sample
        out.float().square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert torch.isfinite(out).all() and grads and all(torch.isfinite(g).all() for g in grads)


def test_planner_fills_one_gpu_with_the_largest_micro_batch_that_fits():
    """plan.py --fill: the largest multiple of 8 whose estimate fits the headroom, the next one not; DiT-XL/2 on one
    H100 fits far more than its preset's 32 (which uses a third of the GPU)."""
    import dataclasses

    from common.memory import estimate
    from scripts.kiln.planner import GPUS, fill_micro_batch, plan
    from scripts.plan import model_spec

    spec = model_spec(compose(["recipe=dit_xl2", "run.dry_run=true"]))
    gpu = GPUS["h100_80gb"]
    best = plan(spec, 1, gpu)[0]["layout"]
    micro = fill_micro_batch(spec, best, gpu)
    total = {m: estimate(dataclasses.replace(spec, micro_batch=m), best)["total"] for m in (micro, micro + 8)}
    assert micro > 4 * spec.micro_batch and micro % 8 == 0
    assert total[micro] <= 0.9 * gpu.memory < total[micro + 8]


@pytest.mark.gpu
def test_one_gpu_steps_the_weights_with_fused_adamw_at_zero0(tmp_path):
    """A one-process bf16 run asking for ZeRO-2 on CUDA: ZeRO-0, DeepSpeed's bf16 wrapper over torch's fused AdamW
    (run.dir/memory.json names what stepped), one note line, and the loss stays finite."""
    from tests.conftest import FAST_DIT, losses
    from tests.support.launcher import run_train

    proc = run_train(
        [
            *FAST_DIT,
            f"run.dir={tmp_path}",
            "trainer.max_steps=3",
            "trainer.eval=false",
            "checkpoint.final=false",
            "toggles.precision=bf16",
            "parallel.zero_stage=2",
        ]
    )
    assert proc.stdout.count("kiln: parallel.zero_stage=2 on one rank") == 1
    memory = json.loads((tmp_path / "memory.json").read_text())
    assert memory["zero_stage"] == 0 and memory["optimizer"].endswith("AdamW (fused)")
    assert all(v == v and abs(v) < 1e3 for v in losses(tmp_path).values())
