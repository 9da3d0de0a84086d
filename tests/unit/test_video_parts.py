"""The video family's parts against diffusers' own, without training: UMT5's prompt embeddings equal
WanPipeline.encode_prompt's; the config's refusals are one line each (Wan 2.2 layouts, clip shapes the VAE or the
patches cannot take, a cp the heads or tokens cannot split, the DiT-only diffusion keys); the LoRA export loads with
WanPipeline.load_lora_weights (and merged) and gives the adapted transformer's output."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from common.errors import ConfigError
from scripts.kiln.launch import compose


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    from data.tiny_bases import make_wan_pipeline

    # Random parts, the smallest transformer and VAE (the demo's pretrained parts are no part of what these check).
    return make_wan_pipeline(
        tmp_path_factory.mktemp("wan") / "wan",
        num_layers=2,
        num_attention_heads=2,
        attention_head_dim=16,
        base_dim=8,
        pretrained=False,
    )


def test_prompt_embeddings_equal_wanpipeline_encode_prompt(wan):
    from diffusers import WanPipeline

    from recipes.video.weights import PromptEncoder

    prompts = ["the digit 3 moving left", "a handwritten  seven drifting to the right", ""]
    ours = PromptEncoder(wan, device="cpu", dtype=torch.float32, max_sequence_length=16)(prompts)
    pipe = WanPipeline.from_pretrained(wan)
    theirs, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=16, device="cpu")
    assert ours["encoder_hidden_states"].shape == theirs.shape == (3, 16, 32)
    torch.testing.assert_close(ours["encoder_hidden_states"], theirs, rtol=0, atol=1e-5)
    assert (theirs[2, 1:] == 0).all() and theirs[0].abs().sum() > 0  # padding is zeros: the comparison can fail


def test_video_config_refusals(wan, tmp_path):
    base = ["recipe=video_tiny", f"model.init_from={wan}"]
    cfg = compose(base)
    assert cfg.diffusion.flow_shift == 3.0 and cfg.lora.targets == []  # the folder's UniPC flow_shift
    for override, message in [
        ("data.num_frames=8", "data.num_frames=8 must be 4k+1"),
        ("data.height=36", "data.height=36 must be a multiple of 8"),
        ("parallel.cp=4", "parallel.cp=4 must divide the 2 attention heads"),
        ("diffusion.vae=x", "diffusion.vae is not read by the video recipe"),
        ("diffusion.flow_shift=5.0", "diffusion.flow_shift=5.0 disagrees with model.init_from"),
        ("toggles.attention=eager", "toggles.attention=eager is not offered by the video recipe"),
    ]:
        with pytest.raises(ConfigError, match="^" + re.escape(message)):
            compose([*base, override])
    two_experts = tmp_path / "wan22"
    shutil.copytree(wan, two_experts)
    index = json.loads((two_experts / "model_index.json").read_text())
    (two_experts / "model_index.json").write_text(
        json.dumps({**index, "transformer_2": index["transformer"], "boundary_ratio": 0.875})
    )
    with pytest.raises(ConfigError, match="is a two-expert Wan 2.2 pipeline"):
        compose(["recipe=video_tiny", f"model.init_from={two_experts}"])
    with pytest.raises(ConfigError, match="trains WanPipeline folders"):
        index["_class_name"] = "StableDiffusion3Pipeline"
        (two_experts / "model_index.json").write_text(json.dumps(index))
        compose(["recipe=video_tiny", f"model.init_from={two_experts}"])


def test_video_lora_export_loads_in_wanpipeline(wan, tmp_path):
    """finetune=lora: the self- and cross-attention's linears adapted, the export written as the end of a run writes
    it; WanPipeline.load_lora_weights on the base, and the merged folder, give the adapted transformer's velocity."""
    from diffusers import WanPipeline

    from common.diffusion import release
    from recipes.video import weights

    cfg = compose(["recipe=video_tiny", f"model.init_from={wan}", "finetune=lora", "export.merge_lora=true"])
    assert cfg.lora.targets == ["to_q", "to_k", "to_v", "to_out.0"]
    model = release.adapted_model(weights, cfg, wan).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained adapter's stand-in (B starts at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    adapted = {n for n, _ in model.named_parameters() if "lora_A" in n}
    assert (
        "blocks.0.attn1.to_q.lora_A.default.weight" in adapted
        and "blocks.1.attn2.to_out.0.lora_A.default.weight" in adapted
    )
    out = tmp_path / "export"
    out.mkdir()
    release.write_lora_export(weights, model, cfg, out, base=wan, step=1)

    x = torch.randn(2, 16, 3, 8, 8, generator=generator)
    text = torch.randn(2, 32, 32, generator=generator)
    t = torch.tensor([700.0, 200.0])
    with torch.no_grad():
        velocity = lambda m: m.eval()(x, timestep=t, encoder_hidden_states=text).sample  # noqa: E731
        ours = velocity(model)
        pipe = WanPipeline.from_pretrained(wan)
        pipe.load_lora_weights(out)
        theirs = velocity(pipe.transformer)
        merged = velocity(WanPipeline.from_pretrained(out / "merged").transformer)
        plain = velocity(weights.load_transformer(wan))
    print(
        f"video LoRA: load_lora_weights vs Kiln's adapted transformer {(theirs - ours).abs().max():.1e}, merged "
        f"{(merged - ours).abs().max():.1e} (max abs velocity difference)"
    )
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(merged, ours, rtol=0, atol=1e-5)
    assert (plain - ours).abs().max() > 1e-2  # the adapter changes the output: the comparisons can fail
