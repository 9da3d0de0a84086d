"""Qwen2.5-VL in the memory model (recipes/vlm/sizing.py, recipes/vlm/train.py memory_spec): the activations it
predicts against the bytes transformers' own Qwen2_5_VLForConditionalGeneration keeps for backward on a packed batch
of the pixel budget's largest images (tower frozen or trained, with and without full AC), and the qwen2_5_vl_7b
preset sized without its folder against the class built on the meta device from the release's published config."""

from __future__ import annotations

import re

import pytest
import torch

from common.errors import ConfigError
from common.launch import compose
from common.memory import head_saved, layer_activation_bytes, per_gpu_bytes
from common.tools.activations import kept_for_backward
from common.tools.fixtures import make_qwen2_5_vl
from recipes.vlm.train import memory_spec
from tests.conftest import load_script

# The tiny tower's window is 112 px = 8 x 8 patches: 224 x 224 images (max_pixels) are 4 windows, 256 patches, 64
# tokens each; 140 tokens hold 2 of them and 12 text tokens.
MAX_PIXELS, SEQ, MICRO = 224 * 224, 140, 2


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return make_qwen2_5_vl(tmp_path_factory.mktemp("qwen") / "qwen")


def tiny_cfg(folder, *extra):
    return compose(
        [
            "recipe=vlm_tiny",
            "data=llava",
            f"model.init_from={folder}",
            f"data.max_pixels={MAX_PIXELS}",
            f"data.max_seq_len={SEQ}",
            f"trainer.micro_batch_size={MICRO}",
            "run.dry_run=true",
            *extra,
        ]
    )


@pytest.mark.parametrize("train_vision", [False, True])
@pytest.mark.parametrize("ac", ["none", "full"])
def test_qwen_activations_match_saved_tensors(qwen, train_vision, ac):
    """One fp32 forward + loss of the recipe's model (parallelize: its freezing and AC) on the worst micro-batch the
    planner assumes: 2 samples of 140 tokens, each with 2 images at max_pixels (4 x 64 tokens through the merger, 4 x
    256 patches through the tower's windowed and full-attention blocks). Not modelled: the language model's mRoPE
    cos/sin and the image features' scatter into the embeddings (~3% here)."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from recipes.vlm.parallelize import parallelize
    from recipes.vlm.qwen import IMAGE_PAD, pack_qwen, rope_index_for

    cfg = tiny_cfg(qwen, f"toggles.activation_checkpointing={ac}", f"vlm.train_vision={str(train_vision).lower()}")
    spec = memory_spec(cfg)
    assert len(spec.more_layers) == (2 if train_vision else 0)  # a frozen tower keeps nothing
    model = parallelize(Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen, dtype=torch.float32), cfg)
    pad = AutoTokenizer.from_pretrained(qwen).convert_tokens_to_ids(IMAGE_PAD)
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(MICRO):
        ids = torch.randint(10, 300, (SEQ,), generator=g)
        ids[3:67] = ids[70:134] = pad
        grid = torch.tensor([[1, 16, 16]] * 2)
        pixels = torch.randn(512, 1176, generator=g)
        samples.append({"input_ids": ids, "labels": ids, "pixel_values": pixels, "image_grid_thw": grid})
    rope = rope_index_for(model.config)
    batch = pack_qwen(samples, rope, max_seq_len=SEQ, pad_id=0, image_pad_id=pad, video_pad_id=-1, packing=False)
    inputs = batch.model_inputs("sdpa")
    measured, out = kept_for_backward(
        lambda: model(**inputs, use_cache=False, num_items_in_batch=1).loss,
        [*model.parameters(), *model.buffers(), *inputs.values()],
    )
    rows = dict(seq=SEQ, batch=MICRO, act_bytes=4)
    predicted = spec.layers * layer_activation_bytes(spec.block, recompute=ac, **rows)
    predicted += per_gpu_bytes(head_saved(spec.block, vocab=spec.vocab, **rows)) + spec.outside_layers_bytes
    predicted += sum(
        t.layers * layer_activation_bytes(t.block, seq=t.seq, batch=t.batch, act_bytes=4, recompute=ac)
        for t in spec.more_layers
    )
    print(
        f"Qwen2.5-VL train_vision={train_vision} AC={ac}: predicted {predicted:,.0f} B, measured {measured:,} B, "
        f"ratio {predicted / measured:.3f}"
    )
    assert predicted == pytest.approx(measured, rel=0.05)
    del out


# Qwen/Qwen2.5-VL-7B-Instruct's config.json, written out (its architecture keys).
RELEASE_7B = dict(
    text_config=dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=128000,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    ),
    vision_config=dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=3584,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
    ),
    tie_word_embeddings=False,
)


def test_qwen2_5_vl_7b_preset_is_the_release_sized_without_its_folder():
    """recipe=qwen2_5_vl_7b without its folder: transformers' Qwen2_5_VLForConditionalGeneration built on the meta
    device from the release's config (8,292,166,656 parameters: Qwen's "8.29B"), the tower frozen, the merger and the
    language model trained; at max_pixels 1280 x 28 x 28 an image is at most 1280 tokens, 8192 tokens hold 6 of
    them: 30,720 patches through the tower a micro-batch. With vlm.train_vision its blocks are two layer types: 28
    over 64-patch windows, 4 (fullatt_block_indexes) over whole images."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = compose(["recipe=qwen2_5_vl_7b", "run.dry_run=true"])
    assert cfg.model.vision == "qwen2_5_vl" and cfg.model.text_layers == 28  # model.* read from the release's config
    spec = memory_spec(cfg)
    with torch.device("meta"):
        reference = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**RELEASE_7B))
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    visual = reference.model.visual
    assert spec.total_params == n(reference) == 8_292_166_656
    assert spec.frozen_params == n(visual) - n(visual.merger)
    assert spec.layer_params == n(reference.model.language_model.layers[0]) and spec.vocab == 152064
    assert (spec.seq, spec.micro_batch, spec.more_layers) == (8192, 1, ())
    assert "at most 1280 tokens each" in spec.note and "6 whole such images" in spec.note
    assert "30,720 patches" in spec.note
    tower = compose(["recipe=qwen2_5_vl_7b", "run.dry_run=true", "vlm.train_vision=true"])
    windowed, full = memory_spec(tower).more_layers
    assert (windowed.layers, windowed.seq, windowed.batch) == (28, 64, 30720 // 64)
    assert (full.layers, full.seq, full.batch) == (4, 5120, 6) and full.params == n(visual.blocks[0])


def test_plan_answers_what_fits_on_8_h100s(capsys):
    """`scripts/plan.py recipe=qwen2_5_vl_7b cluster.gpus=8`: with full AC the preset fits 8 x 80 GB at ZeRO-1, 2
    and 3 (its own layout: ZeRO-3); without AC the activations of 8192 tokens do not fit at any stage."""
    assert load_script("plan").main(["recipe=qwen2_5_vl_7b", "cluster.gpus=8", "--all"]) == 0
    out = capsys.readouterr().out
    assert "3 of 8 layouts the recipe allows fit" in out
    row = re.compile(r"\s*\d+(\*?)\s+8\s+1\s+1\s+1\s+1\s+(zero\d)\s+(\w+)\s.*%(.*)$")
    rows = [r.groups() for r in map(row.match, out.splitlines()) if r]
    assert sorted((stage, ac) for _, stage, ac, note in rows if not note) == [
        ("zero1", "full"),
        ("zero2", "full"),
        ("zero3", "full"),
    ], out
    assert ("*", "zero3", "full", "") in rows


def test_budgets_sizing_cannot_use_and_a_missing_folder_are_one_line(qwen):
    """An image budget over data.max_seq_len (every image sample would be skipped) stops sizing in one line; a release
    known by name sizes without its folder, and training it without the folder is one line."""
    with pytest.raises(ConfigError, match=r"images of up to 1280 tokens, more than data.max_seq_len=1024"):
        memory_spec(compose(["recipe=qwen2_5_vl_7b", "run.dry_run=true", "data.max_seq_len=1024"]))
    from recipes.vlm.sources import weight_source

    source = weight_source(compose(["recipe=qwen2_5_vl_7b"]))
    with pytest.raises(ConfigError, match=r"Qwen2.5-VL-7B-Instruct: no such folder .* training reads the downloaded"):
        source.load("sdpa")
