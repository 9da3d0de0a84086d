"""parallel.cp for the VLM (recipes/vlm/context_parallel.py) on 2 gloo ranks, against the unsplit model: a tiny
transformers LLaVA, a tiny Qwen2.5-VL (mRoPE positions [3, R, L], split with the tokens) and a tiny Qwen3-VL (its
DeepStack features and their mask cut with the tokens too) with their language model split over the cp ranks give the
unsplit forward's logits and loss on a packed batch with images (documents of different lengths in one row, images
in some of them; Qwen3-VL's also videos, an image and a video straddling the cuts), and their weight gradients,
summed over the cp ranks as DeepSpeed sums them, the unsplit ones; under toggles.attention=sdpa (the rows' 4D mask)
and flash (the flattened row's cu_seqlens, through tests/fixtures/varlen.py's CPU stand-in for torch's CUDA-only
kernel), each against the unsplit SDPA forward. The training runs are test_vlm_zero2.py's cp=2 (LLaVA) and
test_vlm_qwen_cp.py's (Qwen2.5-VL, Qwen3-VL).
"""

from __future__ import annotations

import copy

import pytest
import torch

from recipes.vlm.context_parallel import ULYSSES_PREFIX
from tests.support.launcher import spawn_ranks

pytestmark = pytest.mark.distributed
CP = 2
VOCAB = 64
QWEN_IMAGE = VOCAB - 1  # its image pad; the video pad, vision start and end below it


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


def _tiny_qwen():
    """A tiny transformers Qwen2.5-VL (a 1-block tower with its 2x2 merger; a 2-layer Qwen2 language model with
    mRoPE over 4 heads and 2 key/value heads), fp32."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},  # 16 / 2
            pad_token_id=0,
        ),
        vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, fullatt_block_indexes=[0]
        ),
        image_token_id=QWEN_IMAGE,
        video_token_id=QWEN_IMAGE - 1,
        vision_start_token_id=QWEN_IMAGE - 2,
        vision_end_token_id=QWEN_IMAGE - 3,
    )
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).float()


def _tiny_qwen3():
    """A tiny transformers Qwen3-VL (a 2-block tower, patch 16, its 2x2 merger and DeepStack: blocks 0 and 1 merged
    and added after language layers 0 and 1 at the image and video tokens; a 3-layer Qwen3 language model with
    interleaved mRoPE over 4 heads and 2 key/value heads), fp32."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
            pad_token_id=0,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=16,
            out_hidden_size=64,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0, 1],
        ),
        image_token_id=QWEN_IMAGE,
        video_token_id=QWEN_IMAGE - 1,
        vision_start_token_id=QWEN_IMAGE - 2,
        vision_end_token_id=QWEN_IMAGE - 3,
    )
    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(config).float()


def _documents(image: torch.Tensor, make_image):
    """Four documents (two with an image: prompt `image` before their text, -100 labels) and their images."""
    g = torch.Generator().manual_seed(3)
    samples, images = [], []
    for n, has_image in ((30, True), (14, False), (25, True), (9, False)):
        text = torch.randint(3, VOCAB - 4, (n,), generator=g)
        prompt = torch.cat([torch.tensor([1]), image]) if has_image else torch.tensor([1])
        ids = torch.cat([prompt, text])
        samples.append({"input_ids": ids, "labels": torch.cat([torch.full_like(prompt, -100), text])})
        images.append(make_image(g) if has_image else None)
    return samples, images


def _llava_batch(image_tokens: int):
    """The documents packed into rows of 48 tokens (padding tails), and the model's inputs per attention kernel."""
    from common.data.packing import pack_samples

    samples, images = _documents(torch.full((image_tokens,), VOCAB - 1), lambda g: torch.randn(3, 16, 16, generator=g))
    packed = pack_samples(samples, 48, pad_id=0)
    pixel_values = torch.stack([images[i] for i in packed.order if images[i] is not None])
    return packed.input_ids.shape, lambda attention: packed.model_inputs(attention) | {"pixel_values": pixel_values}


def _pack_qwen(model, samples: list[dict]):
    """`samples` packed by recipes/vlm/qwen.py into rows of at most 48 tokens, each sample's mRoPE positions from
    transformers' get_rope_index on it alone: (the rows' shape, the model's inputs per attention kernel)."""
    from recipes.vlm.qwen import pack_qwen, rope_index_for

    c = model.config
    batch = pack_qwen(
        samples,
        rope_index_for(c),
        max_seq_len=48,
        pad_id=0,
        image_pad_id=c.image_token_id,
        video_pad_id=c.video_token_id,
    )
    return batch.packed.input_ids.shape, batch.model_inputs


def _qwen_batch(model):
    """The same documents for the Qwen2.5-VL (an image of 4x4 patches: 4 tokens, between its vision start and end)."""
    c = model.config
    image = torch.tensor([c.vision_start_token_id, *[c.image_token_id] * 4, c.vision_end_token_id])
    samples, images = _documents(image, lambda g: torch.randn(16, 3 * 2 * 14 * 14, generator=g))
    for sample, pixels in zip(samples, images, strict=True):
        if pixels is not None:
            sample |= {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 4, 4]])}
    return _pack_qwen(model, samples)


# Qwen3-VL's documents: text runs, images (t, h, w patches) and videos (Qwen3VLProcessor's layout: each temporal
# patch a 2-token timestamp text, then its own vision start, pads and end). Packed (even_rows, longest first) into
# 3 rows of 48: row 0 opens with the first, whose image pads sit at 19..26; row 1 with the second, whose video's
# second frame pads sit at 22..25; row 2 with the third (an image and a video that the cut leaves whole). sdpa cuts
# each row at 24 and flash the flattened 3 x 48 at 72 (row 1's 24): an image and a video straddle the cuts.
QWEN3_DOCUMENTS = (
    (17, ("image", (1, 4, 8)), 12),  # 40 tokens
    (10, ("video", (2, 4, 4)), 11),  # 38
    (3, ("image", (1, 4, 4)), 3, ("video", (1, 4, 4)), 14),  # 36
    (10,),  # 11
    (("image", (1, 4, 4)), 2),  # 9
    (6,),  # 7
)


def _qwen3_batch(model):
    """QWEN3_DOCUMENTS as samples (a BOS first; labels on the text, -100 on the vision and timestamp tokens) with
    their pixels, packed."""
    c = model.config
    g = torch.Generator().manual_seed(3)
    patch = 3 * 2 * 16 * 16
    samples = []
    for document in QWEN3_DOCUMENTS:
        ids, labels, sample = [torch.tensor([1])], [torch.tensor([-100])], {}
        for part in document:
            if isinstance(part, int):
                text = torch.randint(3, VOCAB - 4, (part,), generator=g)
                ids.append(text)
                labels.append(text)
                continue
            kind, (t, h, w) = part
            pads = [c.image_token_id if kind == "image" else c.video_token_id] * (h * w // 4)
            frame = [c.vision_start_token_id, *pads, c.vision_end_token_id]
            if kind == "video":  # each temporal patch after its timestamp text
                frames = [[*torch.randint(3, VOCAB - 4, (2,), generator=g).tolist(), *frame] for _ in range(t)]
                tokens = torch.tensor([i for f in frames for i in f])
            else:
                tokens = torch.tensor(frame)
            ids.append(tokens)
            labels.append(torch.full_like(tokens, -100))
            pixels = "pixel_values" if kind == "image" else "pixel_values_videos"
            sample[pixels] = torch.randn(t * h * w, patch, generator=g)
            sample[f"{kind}_grid_thw"] = torch.tensor([[t, h, w]])
        samples.append(sample | {"input_ids": torch.cat(ids), "labels": torch.cat(labels)})
    return _pack_qwen(model, samples)


def _against_the_unsplit(reference, shape, inputs, groups) -> dict:
    """`reference` (unsplit, SDPA with the rows' 4D mask) against copies of it with the language model split over the
    cp ranks, under sdpa and flash: logits, loss, weight gradients (summed over cp as DeepSpeed sums them)."""
    import torch.distributed as tdist

    from recipes.vlm.attention import VARLEN_ATTENTION, eval_attention
    from recipes.vlm.context_parallel import split_language_model

    reference.train()
    want = reference(**inputs("sdpa"), use_cache=False)
    want.loss.backward()
    scale = max(p.grad.abs().max().item() for p in reference.parameters() if p.grad is not None)
    result = {"rows": list(shape), "logits_max": want.logits.abs().max().item()}
    if getattr(reference.config.vision_config, "deepstack_visual_indexes", None):
        result["deepstack_share"] = _deepstack_share(reference, inputs("sdpa"), want.logits)
    for attention in ("sdpa", "flash"):
        split = copy.deepcopy(reference)
        split.zero_grad()
        if attention == "flash":  # the whole batch as one flattened row, with its cu_seqlens
            split.set_attn_implementation({"text_config": VARLEN_ATTENTION})
        split_language_model(split, groups)
        seen = []  # the tokens a decoder layer of the split model holds: 1/cp of each row
        split.model.language_model.layers[0].register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape))
        ids = inputs(attention)["input_ids"]
        visual = ids >= QWEN_IMAGE - 1  # image and video pads (LLaVA's image token is Qwen's image pad)
        cut = ids.shape[1] // CP
        got = split(**inputs(attention), use_cache=False)
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
            "rows_cut_in_a_visual": int((visual[:, cut - 1] & visual[:, cut]).sum()),
            "logits_err": (got.logits.view_as(want.logits) - want.logits).abs().max().item(),
            "loss_err": abs(got.loss.item() - want.loss.item()),
            "grad_rel_err": worst,
        }
    return result


def _deepstack_share(model, inputs: dict, logits: torch.Tensor) -> float:
    """Max |logits difference| that Qwen3-VL's DeepStack features make on the unsplit model: what a split that lost
    them (zeroed) would be off by, to set against the test's tolerance."""

    def zeroed(_module, args, kwargs):
        kwargs["deepstack_visual_embeds"] = [torch.zeros_like(f) for f in kwargs["deepstack_visual_embeds"]]
        return args, kwargs

    hook = model.model.language_model.register_forward_pre_hook(zeroed, with_kwargs=True)
    with torch.no_grad():
        without = model(**inputs, use_cache=False).logits
    hook.remove()
    return (without - logits).abs().max().item()


def _on_each_rank() -> dict:
    from common import varlen
    from common.parallel_dims import ParallelDims
    from recipes.vlm.attention import register_varlen_attention
    from tests.fixtures.varlen import cpu_kernel

    varlen._kernel = cpu_kernel  # torch's varlen kernel is CUDA only: its CPU stand-in, in this rank's process
    register_varlen_attention()
    groups = ParallelDims(dp=1, tp=1, pp=1, world_size=CP, cp=CP).context_groups("cpu")  # the trainer's
    llava, image_tokens = _tiny_llava()
    qwen, qwen3 = _tiny_qwen(), _tiny_qwen3()
    return {
        "LLaVA": _against_the_unsplit(llava, *_llava_batch(image_tokens), groups),
        "Qwen2.5-VL": _against_the_unsplit(qwen, *_qwen_batch(qwen), groups),
        "Qwen3-VL": _against_the_unsplit(qwen3, *_qwen3_batch(qwen3), groups),
    }


def test_split_language_models_equal_the_unsplit_forward_and_gradients(tmp_path):
    for ranks in spawn_ranks(_on_each_rank, (), CP, tmp_path):
        for model, r in ranks.items():
            rows, length = r["rows"]
            # sdpa: each of the rows split; flash: the one flattened row (rows x length tokens) split
            tokens = {"sdpa": [rows, length // CP], "flash": [1, rows * length // CP]}
            for attention, layer_tokens in tokens.items():
                e = r[attention]
                print(
                    f"{model} cp={CP} {attention} vs unsplit sdpa on packed rows {r['rows']}: logits max |diff| "
                    f"{e['logits_err']:.1e} (of {r['logits_max']:.1e}), loss |diff| {e['loss_err']:.1e}, weight "
                    f"gradients max |diff| / max |grad| {e['grad_rel_err']:.1e}"
                )
                assert e["layer_tokens"] == [layer_tokens] and e["after_eval"].startswith(ULYSSES_PREFIX)
                # README: sdpa's logits bit for bit, the same loss under both; flash's logits measured within 2.1e-7,
                # gradients within 4.4e-7 of the largest (both attentions): the bounds are 5x and 4.5x those.
                assert e["loss_err"] == 0 and e["grad_rel_err"] <= 2e-6, e
                assert e["logits_err"] == 0 if attention == "sdpa" else e["logits_err"] <= 1e-6, e
            if model == "Qwen3-VL":  # DeepStack's features cut with the tokens, where an image and a video straddle it
                print(f"Qwen3-VL: its DeepStack features zeroed move the unsplit logits by {r['deepstack_share']:.1e}")
                assert r["deepstack_share"] >= 1e-2
                assert (r["sdpa"]["rows_cut_in_a_visual"], r["flash"]["rows_cut_in_a_visual"]) == (2, 1)
