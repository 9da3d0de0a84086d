"""parallel.cp for the VLM (recipes/vlm/context_parallel.py) on 2 gloo ranks, against the unsplit model: a tiny
transformers LLaVA with its language model split over the cp ranks gives the unsplit forward's logits and loss on a
packed batch with images (documents of different lengths in one row, images in two of them), and its weight
gradients, summed over the cp ranks as DeepSpeed sums them, the unsplit ones; under toggles.attention=sdpa (the rows'
4D mask) and flash (the flattened row's cu_seqlens, through tests/fixtures/varlen.py's CPU stand-in for torch's
CUDA-only kernel), each against the unsplit SDPA forward. The training runs are test_vlm_zero2.py's cp=2 (LLaVA) and
test_vlm_qwen_cp.py's (Qwen2.5-VL)."""

from __future__ import annotations

import copy

import pytest
import torch

from common.tools.launcher import spawn_ranks
from recipes.vlm.context_parallel import ULYSSES_PREFIX

pytestmark = pytest.mark.distributed
CP = 2
VOCAB = 64


def _tiny_llava():
    from recipes.vlm.model import build_model, llava_config, tower_image_tokens
    from recipes.vlm.schema import VLMModelConfig

    m = VLMModelConfig(
        vision="siglip",
        image_size=16,
        vision_patch_size=4,
        vision_hidden_size=32,
        vision_layers=1,
        vision_heads=2,
        vision_intermediate_size=64,
        text_hidden_size=64,
        text_layers=2,
        text_heads=4,
        text_kv_heads=2,  # GQA: two query heads per key/value head, one group per cp rank
        text_intermediate_size=128,
        max_seq_len=128,
    )
    config = llava_config(m, vocab_size=VOCAB, image_token_id=VOCAB - 1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return build_model(config, "sdpa").float(), tower_image_tokens(config)


def _packed_batch(image_tokens: int):
    """Two packed rows of 48 tokens: four documents (two with an image each) and padding tails; their images."""
    from common.data.packing import pack_samples

    g = torch.Generator().manual_seed(3)
    samples, images = [], []
    for n, has_image in ((30, True), (14, False), (25, True), (9, False)):
        text = torch.randint(3, VOCAB - 1, (n,), generator=g)
        prompt = torch.tensor([1] + [VOCAB - 1] * image_tokens) if has_image else torch.tensor([1])
        ids = torch.cat([prompt, text])
        labels = torch.cat([torch.full_like(prompt, -100), text])
        samples.append({"input_ids": ids, "labels": labels})
        images.append([torch.randn(3, 16, 16, generator=g)] if has_image else [])
    packed = pack_samples(samples, 48, pad_id=0)
    return packed, torch.stack([image for i in packed.order for image in images[i]])


def _on_each_rank() -> dict:
    import torch.distributed as tdist

    from common import varlen
    from common.ulysses import UlyssesGroups
    from recipes.vlm.attention import VARLEN_ATTENTION, eval_attention, register_varlen_attention
    from recipes.vlm.context_parallel import split_language_model
    from tests.fixtures.varlen import cpu_kernel

    varlen._kernel = cpu_kernel  # torch's varlen kernel is CUDA only: its CPU stand-in, in this rank's process
    register_varlen_attention()
    groups = UlyssesGroups(1, CP, "cpu")
    reference, image_tokens = _tiny_llava()
    packed, pixel_values = _packed_batch(image_tokens)
    reference.train()
    want = reference(**packed.model_inputs("sdpa"), pixel_values=pixel_values, use_cache=False)
    want.loss.backward()
    scale = max(p.grad.abs().max().item() for p in reference.parameters() if p.grad is not None)
    result = {"rows": list(packed.input_ids.shape), "logits_max": want.logits.abs().max().item()}
    for attention in ("sdpa", "flash"):
        split = copy.deepcopy(reference)
        split.zero_grad()
        if attention == "flash":  # the whole batch as one flattened row, with its cu_seqlens
            split.set_attn_implementation({"text_config": VARLEN_ATTENTION})
        split_language_model(split, groups)
        seen = []  # the tokens a decoder layer of the split model holds: 1/cp of each row
        split.model.language_model.layers[0].register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape))
        got = split(**packed.model_inputs(attention), pixel_values=pixel_values, use_cache=False)
        got.loss.backward()
        worst = 0.0
        for p, mine in zip(reference.parameters(), split.parameters(), strict=True):
            if p.grad is None:  # the tower's parts LLaVA's features never reach
                assert mine.grad is None
                continue
            grad = mine.grad.clone()
            tdist.all_reduce(grad, group=groups.cp_group)  # DeepSpeed's sum over cp
            worst = max(worst, (grad - p.grad).abs().max().item() / scale)
        with eval_attention(split, attention):  # generation's kernel, then training's: the wrapped one again
            pass
        result[attention] = {
            "after_eval": split.config.text_config._attn_implementation,
            "layer_tokens": [list(shape[:2]) for shape in seen],
            "logits_err": (got.logits.view_as(want.logits) - want.logits).abs().max().item(),
            "loss_err": abs(got.loss.item() - want.loss.item()),
            "grad_rel_err": worst,
        }
    return result


def test_split_llava_equals_the_unsplit_forward_and_gradients(tmp_path):
    for r in spawn_ranks(_on_each_rank, (), CP, tmp_path):
        rows, length = r["rows"]
        # sdpa: each of the rows split; flash: the one flattened row (rows x length tokens) split
        tokens = {"sdpa": [rows, length // CP], "flash": [1, rows * length // CP]}
        for attention, layer_tokens in tokens.items():
            e = r[attention]
            print(
                f"LLaVA cp={CP} {attention} vs unsplit sdpa on packed rows {r['rows']}: logits max |diff| "
                f"{e['logits_err']:.1e} (of {r['logits_max']:.1e}), loss |diff| {e['loss_err']:.1e}, weight "
                f"gradients max |diff| / max |grad| {e['grad_rel_err']:.1e}"
            )
            assert e["layer_tokens"] == [layer_tokens] and e["after_eval"].startswith(ULYSSES_PREFIX)
            assert e["logits_err"] <= 1e-5 and e["loss_err"] <= 1e-6 and e["grad_rel_err"] <= 1e-5, e
