"""Packing changes speed, not math: packed logits/loss equal per-sample ones for tiny Llama and Llava models."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlavaConfig, LlavaForConditionalGeneration, SiglipVisionConfig

from common.data.packing import IGNORE_INDEX, pack_samples, pad_samples

VOCAB = 128
PAD_ID = 0
IMAGE_TOKEN_ID = 127
IMAGE_TOKENS = 16  # SigLIP 16x16 image, 4x4 patches, "full" strategy (SigLIP has no CLS token)
MAX_SEQ_LEN = 64


def _text_config(attn: str) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD_ID,
        attn_implementation=attn,
    )


def tiny_llama(attn: str, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(_text_config(attn)).to(dtype).eval()


def tiny_llava(attn: str, dtype: torch.dtype = torch.float32) -> LlavaForConditionalGeneration:
    torch.manual_seed(0)
    vision = SiglipVisionConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=_text_config(attn),
        image_token_id=IMAGE_TOKEN_ID,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        attn_implementation=attn,
    )
    return LlavaForConditionalGeneration(config).to(dtype).eval()


def text_samples(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(2, 40, (), generator=g))
        ids = torch.randint(1, IMAGE_TOKEN_ID, (length,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(0, length // 2 + 1, (), generator=g))] = IGNORE_INDEX  # a masked prompt
        out.append({"input_ids": ids, "labels": labels})
    return out


def image_samples(n: int, seed: int) -> tuple[list[dict], torch.Tensor]:
    """LLaVA-style samples: [bos, <image> x 16, prompt, answer]; labels only on the answer."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(1, IMAGE_TOKEN_ID, (int(torch.randint(1, 8, (), generator=g)),), generator=g)
        answer = torch.randint(1, IMAGE_TOKEN_ID, (int(torch.randint(1, 20, (), generator=g)),), generator=g)
        ids = torch.cat([torch.tensor([1]), torch.full((IMAGE_TOKENS,), IMAGE_TOKEN_ID), prompt, answer])
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[-len(answer) :] = answer
        out.append({"input_ids": ids, "labels": labels})
    pixel_values = torch.randn(n, 3, 16, 16, generator=g)
    return out, pixel_values


def _assert_packed_matches_alone(model, samples, attn: str, pixel_values=None) -> None:
    batch = pack_samples(samples, MAX_SEQ_LEN, PAD_ID)
    assert batch.num_rows < len(samples), "the test should actually pack several samples per row"
    extra = {} if pixel_values is None else {"pixel_values": pixel_values[batch.order]}
    with torch.no_grad():
        packed = model(**batch.model_inputs(attn), **extra).logits
        it = iter(batch.order)
        for r, lens in enumerate(batch.seq_lens):
            start = 0
            for n in lens:
                i = next(it)
                alone_extra = {} if pixel_values is None else {"pixel_values": pixel_values[i : i + 1]}
                alone = model(input_ids=samples[i]["input_ids"][None], **alone_extra).logits[0]
                torch.testing.assert_close(packed[r, start : start + n], alone, atol=1e-5, rtol=0)
                start += n


def _assert_loss_on_equals_off(model, samples, attn: str, pixel_values=None) -> None:
    on = pack_samples(samples, MAX_SEQ_LEN, PAD_ID)
    off = pad_samples(samples, PAD_ID)
    assert on.num_rows < off.num_rows
    with torch.no_grad():
        kw_on = {} if pixel_values is None else {"pixel_values": pixel_values[on.order]}
        kw_off = {} if pixel_values is None else {"pixel_values": pixel_values}
        loss_on = model(**on.model_inputs(attn), **kw_on).loss
        loss_off = model(**off.model_inputs(attn), **kw_off).loss
    assert torch.isfinite(loss_on)
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-5, atol=0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_llama_packed_logits_equal_per_sample(attn):
    _assert_packed_matches_alone(tiny_llama(attn), text_samples(12, seed=0), attn)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_llama_loss_packing_on_equals_off(attn):
    _assert_loss_on_equals_off(tiny_llama(attn), text_samples(16, seed=1), attn)


def test_llama_gradients_packing_on_equal_off():
    # Training is what packing is for: the gradients must match too (and stay finite at padding).
    samples = text_samples(10, seed=2)
    grads = []
    for batch in (pack_samples(samples, MAX_SEQ_LEN, PAD_ID), pad_samples(samples, PAD_ID)):
        model = tiny_llama("sdpa").train()
        model(**batch.model_inputs("sdpa")).loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert torch.isfinite(grads[0]).all()
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)


def test_position_ids_alone_do_not_isolate_samples():
    # Why the 4D mask exists (PITFALLS.md): without it, packed samples attend across boundaries.
    model, samples = tiny_llama("sdpa"), text_samples(12, seed=0)
    batch = pack_samples(samples, MAX_SEQ_LEN, PAD_ID)
    with torch.no_grad():
        with_mask = model(**batch.model_inputs("sdpa")).logits
        no_mask = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
    assert (with_mask - no_mask).abs().max() > 1e-3


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_llava_packed_logits_equal_per_sample(attn):
    samples, pixel_values = image_samples(8, seed=3)
    _assert_packed_matches_alone(tiny_llava(attn), samples, attn, pixel_values)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_llava_loss_packing_on_equals_off(attn):
    samples, pixel_values = image_samples(10, seed=4)
    _assert_loss_on_equals_off(tiny_llava(attn), samples, attn, pixel_values)


def _varlen_reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """CPU stand-in for flash_attn_varlen_func: causal SDPA within each cu_seq_lens segment.

    Registered as an attention implementation so the flash-path inputs (flattened row plus
    FlashAttentionKwargs) travel through the real transformers forward; this proves the kwarg
    names reach the attention layer and the flattened layout is right, without CUDA.
    """
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:  # e.g. the SigLIP vision tower: plain attention, no packing
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling,
            is_causal=getattr(module, "is_causal", False) and attention_mask is None,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        return out.transpose(1, 2).contiguous(), None
    assert query.shape[0] == 1 and attention_mask is None, "varlen path: one flattened row, no mask"
    assert torch.equal(cu, kwargs["cu_seq_lens_k"]) and kwargs["max_length_q"] == int(cu.diff().max())
    out = torch.empty_like(query)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        out[:, :, a:b] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], scale=scaling, is_causal=True, enable_gqa=True
        )
    return out.transpose(1, 2).contiguous(), None


@pytest.fixture
def varlen_reference():
    from transformers import AttentionInterface

    name = "kiln_varlen_reference"
    AttentionInterface.register(name, _varlen_reference_attention)
    yield name
    AttentionInterface._global_mapping.pop(name, None)


@pytest.mark.parametrize("family", ["llama", "llava"])
def test_flash_inputs_match_4d_mask_path(family, varlen_reference):
    # The flash layout ([1, R*L] + cu_seq_lens kwargs) through a real forward gives the same logits
    # and loss as the CPU 4D-mask layout: one metadata structure, two attention paths.
    if family == "llama":
        build, (samples, extra) = tiny_llama, (text_samples(12, seed=7), {})
    else:
        build = tiny_llava
        samples, pixel_values = image_samples(8, seed=8)
    batch = pack_samples(samples, MAX_SEQ_LEN, PAD_ID)
    if family == "llava":
        extra = {"pixel_values": pixel_values[batch.order]}
    with torch.no_grad():
        flat = build(varlen_reference)(**batch.model_inputs("flash"), **extra)
        rows = build("sdpa")(**batch.model_inputs("sdpa"), **extra)
    torch.testing.assert_close(flat.logits.reshape(rows.logits.shape), rows.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(flat.loss, rows.loss, rtol=1e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None,
    reason="needs CUDA and flash-attn",
)
@pytest.mark.parametrize("family", ["llama", "llava"])
def test_flash_varlen_matches_sdpa(family):
    # Same packed batch, same weights: flash path (flattened row + cu_seq_lens kwargs) vs sdpa path
    # (4D mask). Both bf16, so they agree to bf16 rounding, not bit for bit: on CPU these models'
    # bf16 logits (|max| ~0.7) differ from fp32 by <= 7e-3, while a cross-sample leak costs ~0.5.
    build = tiny_llama if family == "llama" else tiny_llava
    if family == "llama":
        samples, extra = text_samples(16, seed=5), {}
    else:
        samples, pixel_values = image_samples(10, seed=6)
    batch = pack_samples(samples, MAX_SEQ_LEN, PAD_ID)
    if family == "llava":
        extra = {"pixel_values": pixel_values[batch.order].to("cuda", torch.bfloat16)}
    out = {}
    for attn in ("flash", "sdpa"):
        model = build("flash_attention_2" if attn == "flash" else "sdpa", torch.bfloat16).cuda()
        with torch.no_grad():
            res = model(**batch.model_inputs(attn, device="cuda"), **extra)
        out[attn] = (res.logits.float().reshape(batch.input_ids.shape + (-1,)), res.loss.float())
    real = batch.labels.new_zeros(batch.input_ids.shape, dtype=torch.bool)
    for r, lens in enumerate(batch.seq_lens):
        real[r, : sum(lens)] = True
    real = real.cuda()
    torch.testing.assert_close(out["flash"][0][real], out["sdpa"][0][real], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out["flash"][1], out["sdpa"][1], atol=0, rtol=1e-2)
