"""Packing changes speed, not math: packed logits/loss equal per-sample ones for tiny Llama and Llava models."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlavaConfig, LlavaForConditionalGeneration, SiglipVisionConfig

from common.data.packing import IGNORE_INDEX, pack_samples, pad_samples
from recipes.vlm.attention import attn_implementation

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


def tiny_llava(attn: str | dict, dtype: torch.dtype = torch.float32) -> LlavaForConditionalGeneration:
    torch.manual_seed(0)
    vision = SiglipVisionConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=_text_config(attn if isinstance(attn, str) else attn["text_config"]),
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
    # Why the 4D mask exists: without it, packed samples attend across boundaries.
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


def _reference_varlen_attn(
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
):
    """torch.nn.attention.varlen.varlen_attn as documented, on CPU (the kernel is CUDA only): q/k/v
    [tokens, heads, head_dim]; each cu_seq segment attends within itself, causally for window (-1, 0)."""
    assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k == int(cu_seq_q.diff().max())
    assert window_size == (-1, 0) and enable_gqa == (q.shape[1] != k.shape[1])
    out = torch.empty_like(q)
    for a, b in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        seg = [t[a:b].transpose(0, 1) for t in (q, k, v)]  # [heads, n, head_dim]
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(
            *seg, scale=scale, is_causal=True, enable_gqa=enable_gqa
        ).transpose(0, 1)
    return out


def _reference_without_gqa(q, k, v, *args, **kwargs):
    """torch 2.11's varlen_attn, which has no enable_gqa: query and key/value head counts must be equal."""
    assert "enable_gqa" not in kwargs and q.shape[1] == k.shape[1]
    return _reference_varlen_attn(q, k, v, *args, **kwargs)


@pytest.fixture(params=["enable_gqa", "repeat_kv"])
def varlen_on_cpu(request, monkeypatch):
    """The VLM's toggles.attention=flash implementation (recipes/vlm/attention.py), registered with
    transformers as in training, with torch's CUDA-only varlen kernel (common/varlen.py) swapped for its CPU
    reference: the flash-path inputs then travel through the real forward and the real adapter on CPU. Both
    kernels: one that shares key/value heads itself (torch 2.13), one that needs them repeated (torch 2.11)."""
    from common import varlen
    from recipes.vlm import attention

    kernel = (_reference_varlen_attn, True) if request.param == "enable_gqa" else (_reference_without_gqa, False)
    monkeypatch.setattr(varlen, "_kernel", lambda: kernel)
    attention.register_varlen_attention()
    return attn_implementation("flash")


def _attn(family: str, attn):
    """A model's attn_implementation: a name, or for the LLaVA the per-sub-config dict the recipe uses."""
    return attn if family == "llava" or isinstance(attn, str) else attn["text_config"]


@pytest.mark.parametrize("family", ["llama", "llava"])
def test_flash_inputs_match_4d_mask_path(family, varlen_on_cpu):
    # The flash layout ([1, R*L] + cu_seq_lens kwargs) through a real forward gives the same logits,
    # loss and gradients as the CPU 4D-mask layout: one metadata structure, two attention paths.
    if family == "llama":
        build, (samples, extra) = tiny_llama, (text_samples(12, seed=7), {})
    else:
        build = tiny_llava
        samples, pixel_values = image_samples(8, seed=8)
    batch = pack_samples(samples, MAX_SEQ_LEN, PAD_ID)
    if family == "llava":
        extra = {"pixel_values": pixel_values[batch.order]}
    flat_model, rows_model = build(_attn(family, varlen_on_cpu)).train(), build("sdpa").train()
    flat = flat_model(**batch.model_inputs("flash"), **extra)
    rows = rows_model(**batch.model_inputs("sdpa"), **extra)
    torch.testing.assert_close(flat.logits.reshape(rows.logits.shape), rows.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(flat.loss, rows.loss, rtol=1e-6, atol=0)
    flat.loss.backward()
    rows.loss.backward()
    for (name, a), b in zip(flat_model.named_parameters(), rows_model.parameters()):
        assert (a.grad is None) == (b.grad is None), name  # None: unused (SigLIP's pooling head)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("packing", [True, False])
def test_varlen_inputs_describe_the_dense_mask(packing):
    # What the GPU kernel is told (cu_seq_lens over the flattened rows, causal window (-1, 0)) allows
    # exactly the (query, key) pairs the CPU path's [R, 1, L, L] mask allows, laid block-diagonally
    # over the same flattened rows: no pair more, none less.
    samples = text_samples(20, seed=9)
    batch = pack_samples(samples, MAX_SEQ_LEN, PAD_ID) if packing else pad_samples(samples, PAD_ID)
    flash, dense = batch.model_inputs("flash"), batch.model_inputs("sdpa")["attention_mask"]
    n = batch.input_ids.numel()
    cu = flash["cu_seq_lens_q"].tolist()
    segment = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
    pos = torch.arange(n)
    varlen_allows = (segment[:, None] == segment[None, :]) & (pos[None, :] <= pos[:, None])
    mask_allows = torch.block_diag(*dense[:, 0].to(torch.int)).bool()
    assert torch.equal(varlen_allows, mask_allows)
    assert flash["max_length_q"] == int(torch.tensor(cu).diff().max())


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
    reason="needs a CUDA GPU of capability >= 8.0 (torch's varlen flash kernel)",
)
@pytest.mark.parametrize("family", ["llama", "llava"])
def test_flash_varlen_matches_sdpa(family):
    # Same packed batch, same weights: torch's varlen kernel through the recipe's attention function
    # (flattened row + cu_seq_lens kwargs) vs SDPA with the 4D mask. Both bf16, so they agree to bf16
    # rounding, not bit for bit: on CPU these models' bf16 logits (|max| ~0.7) differ from fp32 by
    # <= 7e-3, while a cross-sample leak costs ~0.5. Gradients are compared by direction.
    from recipes.vlm.attention import register_varlen_attention

    register_varlen_attention()
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
        model = (
            build(_attn(family, attn_implementation("flash")) if attn == "flash" else "sdpa", torch.bfloat16)
            .cuda()
            .train()
        )
        res = model(**batch.model_inputs(attn, device="cuda"), **extra)
        res.loss.backward()
        grad = torch.cat([p.grad.float().reshape(-1) for p in model.parameters() if p.grad is not None])
        out[attn] = (res.logits.float().reshape(batch.input_ids.shape + (-1,)), res.loss.float(), grad)
    real = batch.labels.new_zeros(batch.input_ids.shape, dtype=torch.bool)
    for r, lens in enumerate(batch.seq_lens):
        real[r, : sum(lens)] = True
    real = real.cuda()
    torch.testing.assert_close(out["flash"][0][real], out["sdpa"][0][real], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out["flash"][1], out["sdpa"][1], atol=0, rtol=1e-2)
    assert torch.nn.functional.cosine_similarity(out["flash"][2], out["sdpa"][2], dim=0) > 0.99
