"""DeepSpeed-Ulysses for the DiT (parallel.cp, common/ulysses.py) on 2 gloo ranks, against the unsplit computation:
DistributedAttention around SDPA equals torch's SDPA on the whole sequence (outputs and q/k/v gradients), and a
diffusers DiTTransformer2DModel with its tokens split (recipes/dit/parallelize.py) gives diffusers' own output and,
summed over the cp ranks as DeepSpeed sums them, its weight gradients. The training runs (losses and gradient norms
equal one process's, resume across cp) are in test_ds_any_layout.py."""

from __future__ import annotations

import pytest
import torch

from common.tools.launcher import spawn_ranks

pytestmark = pytest.mark.distributed
CP = 2
B, S, H, D = 2, 12, 4, 8  # batch, tokens, heads, head size: S and H divisible by CP


def _attention_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, S, H, D, generator=g) for _ in range(4)]  # q, k, v and the upstream gradient


def _tiny_dit():
    from recipes.dit.config import DiTModelConfig
    from recipes.dit.model import build_model

    torch.manual_seed(0)
    cfg = DiTModelConfig(num_layers=2, num_attention_heads=4, attention_head_dim=8, patch_size=2, norm_num_groups=8)
    return build_model(cfg, sample_size=8, in_channels=1)  # 16 patch tokens


def _dit_inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 1, 8, 8, generator=g)
    return x, torch.tensor([3, 500, 999]), torch.tensor([0, 7, 10]), torch.randn(3, 1, 8, 8, generator=g)


def _on_each_rank() -> dict:
    """This rank's share of the split attention (its tokens' outputs and q/k/v gradients, in its rows) and the max
    differences of the split DiT from the unsplit one, computed here (both models from the same seed)."""
    import torch.distributed as tdist

    from common.ulysses import UlyssesGroups, shard_tokens, ulysses_kernel
    from recipes.dit.parallelize import sdpa_kernel, set_attention, split_sequence

    groups = UlyssesGroups(1, CP, "cpu")
    q, k, v, upstream = _attention_inputs()
    mine = [shard_tokens(t, CP, groups.cp_rank).clone().requires_grad_() for t in (q, k, v)]
    out = ulysses_kernel(sdpa_kernel, groups.cp_group)(*mine)
    (out * shard_tokens(upstream, CP, groups.cp_rank)).sum().backward()
    result = {"attention_out": out.detach().tolist(), "attention_grads": [t.grad.tolist() for t in mine]}

    reference, split = _tiny_dit(), _tiny_dit()  # diffusers' own processor (AttnProcessor2_0) / Ulysses
    set_attention(split, "sdpa", groups)
    split_sequence(split, groups)
    x, t, labels, weight = _dit_inputs()
    outputs = {}
    for name, model in (("reference", reference), ("split", split)):
        outputs[name] = model(x, timestep=t, class_labels=labels).sample
        (outputs[name] * weight).sum().backward()
    result["dit_out_err"] = (outputs["split"] - outputs["reference"]).abs().max().item()
    # Relative to the largest gradient of the model: a key projection's bias has a zero gradient in exact arithmetic
    # (softmax ignores a shift shared by every key), so each rank's share of it is cancelling noise.
    scale = max(p.grad.abs().max().item() for p in reference.parameters())
    worst = 0.0
    for p, mine_p in zip(reference.parameters(), split.parameters(), strict=True):
        grad = mine_p.grad.clone()
        tdist.all_reduce(grad, group=groups.cp_group)  # what DeepSpeed does over the cp ranks
        worst = max(worst, (grad - p.grad).abs().max().item() / scale)
    result["dit_grad_rel_err"] = worst
    result["dit_out_max"] = outputs["reference"].abs().max().item()
    return result


def test_ulysses_attention_and_split_dit_equal_the_unsplit_ones(tmp_path):
    q, k, v, upstream = _attention_inputs()
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in whole)).transpose(1, 2)
    (expected * upstream).sum().backward()

    ranks = spawn_ranks(_on_each_rank, (), CP, tmp_path)
    got = torch.cat([torch.tensor(r["attention_out"]) for r in ranks], dim=1)  # rank 0's tokens first
    grads = [torch.cat([torch.tensor(r["attention_grads"][i]) for r in ranks], dim=1) for i in range(3)]
    errors = {"out": (got - expected.detach()).abs().max().item()}
    errors |= {f"grad_{n}": (g - t.grad).abs().max().item() for n, g, t in zip("qkv", grads, whole, strict=True)}
    print(f"Ulysses cp={CP} vs SDPA on the whole sequence, max |diff|: {errors}")
    assert all(err <= 1e-6 for err in errors.values()), errors
    for r in ranks:
        print(
            f"split DiT vs diffusers: output max |diff| {r['dit_out_err']:.1e} (of {r['dit_out_max']:.1e}), "
            f"weight gradients max |diff| / max |gradient| {r['dit_grad_rel_err']:.1e}"
        )
        assert r["dit_out_err"] <= 1e-5 and r["dit_grad_rel_err"] <= 1e-5
