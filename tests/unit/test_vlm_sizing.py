"""Qwen2.5-VL and Qwen3-VL in the memory model (recipes/vlm/sizing.py, recipes/vlm/train.py memory_spec): the
activations it predicts against the bytes transformers' own Qwen2_5_VLForConditionalGeneration /
Qwen3VLForConditionalGeneration keeps for backward on a packed batch of the pixel budget's largest images (tower frozen
or trained, with and without full AC), and the qwen2_5_vl_7b / qwen3_vl_8b presets sized without their folders against
the classes built on the meta device from the releases' published configs."""

from __future__ import annotations

import re

import pytest
import torch

from common.activations import kept_for_backward
from common.errors import ConfigError
from common.memory import head_saved, layer_activation_bytes, per_gpu_bytes
from data.tiny_bases import make_qwen2_5_vl, make_qwen3_vl
from recipes.vlm.sizing import memory_spec
from scripts.kiln.launch import compose
from tests.conftest import load_script

# Images of 16 x 16 patches: 224 x 224 px for Qwen2.5-VL's 14-px patches (4 of the tiny tower's 112-px windows of 8 x 8
# patches), 256 x 256 px for Qwen3-VL's 16-px ones; 256 patches, 64 tokens each; 140 tokens hold 2 of them and 12
# text tokens.
SEQ, MICRO = 140, 2
FIXTURES = {"qwen2_5_vl": "qwen", "qwen3_vl": "qwen3"}  # model_type -> its module fixture
# (model_type, its module fixture, vlm.train_vision, AC): every combination, and Qwen3-VL-4B's attention shape.
CASES = [
    (arch, fixture, tv, ac) for arch, fixture in FIXTURES.items() for tv in (False, True) for ac in ("none", "full")
]
CASES.append(("qwen3_vl", "qwen3_wide_heads", False, "none"))


def max_pixels(folder) -> int:
    from recipes.vlm.archs import qwen_arch

    return (16 * qwen_arch(folder).patch) ** 2


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return make_qwen2_5_vl(tmp_path_factory.mktemp("qwen") / "qwen")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Qwen3-VL: 3 blocks of full attention, learned position embeddings, DeepStack mergers after blocks 0 and 1."""
    return make_qwen3_vl(tmp_path_factory.mktemp("qwen3") / "qwen3")


@pytest.fixture(scope="module")
def qwen3_wide_heads(tmp_path_factory):
    """The tiny Qwen3-VL with Qwen3-VL-4B's attention shape (32 heads x 128 = 4096 over a 2560-wide residual): its
    language model's 4 heads x head_dim 32 = 128, twice hidden_size; the folder's tokenizer and processor, new random
    weights."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    folder = make_qwen3_vl(tmp_path_factory.mktemp("qwen3_wide") / "qwen3")
    config = Qwen3VLConfig.from_pretrained(folder)
    text = config.text_config
    text.head_dim = 2 * text.hidden_size // text.num_attention_heads
    text.rope_parameters["mrope_section"] = [8, 4, 4]  # head_dim / 2 frequencies over (t, h, w), as the fixture's
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(config).save_pretrained(folder)
    return folder


def tiny_cfg(folder, *extra):
    return compose(
        [
            "recipe=vlm_tiny",
            "data=llava",
            f"model.init_from={folder}",
            f"data.max_pixels={max_pixels(folder)}",
            f"data.max_seq_len={SEQ}",
            f"trainer.micro_batch_size={MICRO}",
            "run.dry_run=true",
            *extra,
        ]
    )


@pytest.mark.parametrize("arch, fixture, train_vision, ac", CASES)
def test_qwen_activations_match_saved_tensors(request, arch, fixture, train_vision, ac):
    """One fp32 forward + loss of the recipe's model (parallelize: its freezing and AC) on the worst micro-batch the
    planner assumes: 2 samples of 140 tokens, each with 2 images at max_pixels (4 x 64 tokens through the merger(s), 4
    x 256 patches through the tower's blocks: Qwen2.5-VL's windowed and full-attention ones, Qwen3-VL's full-attention
    ones and its DeepStack mergers, whose features the first language layers add). Not modelled: the language model's
    mRoPE cos/sin and the image features' scatter into the embeddings (~3% here)."""
    import transformers

    from recipes.vlm.archs import QWEN_ARCHS
    from recipes.vlm.parallelize import parallelize
    from recipes.vlm.qwen import IMAGE_PAD, pack_qwen, rope_index_for

    folder = request.getfixturevalue(fixture)
    cfg = tiny_cfg(folder, f"toggles.activation_checkpointing={ac}", f"vlm.train_vision={str(train_vision).lower()}")
    spec = memory_spec(cfg)
    kinds = 2 if arch == "qwen2_5_vl" else 1  # Qwen2.5-VL: windowed and full-attention blocks; Qwen3-VL: full only
    assert len(spec.more_layers) == (kinds if train_vision else 0)  # a frozen tower keeps nothing
    model_class = getattr(transformers, QWEN_ARCHS[arch].model)
    model = parallelize(model_class.from_pretrained(folder, dtype=torch.float32), cfg)
    v = model.config.vision_config
    pad = transformers.AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(IMAGE_PAD)
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(MICRO):
        ids = torch.randint(10, 300, (SEQ,), generator=g)
        ids[3:67] = ids[70:134] = pad
        grid = torch.tensor([[1, 16, 16]] * 2)
        pixels = torch.randn(512, v.in_channels * v.temporal_patch_size * v.patch_size**2, generator=g)
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
        f"{QWEN_ARCHS[arch].name} ({fixture}) train_vision={train_vision} AC={ac}: predicted {predicted:,.0f} B, "
        f"measured {measured:,} B, ratio {predicted / measured:.3f}"
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


# Qwen/Qwen3-VL-8B-Instruct's config.json, written out (its architecture keys).
RELEASE_8B = dict(
    text_config=dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=262144,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000000,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
    ),
    vision_config=dict(
        depth=27,
        hidden_size=1152,
        hidden_act="gelu_pytorch_tanh",
        intermediate_size=4304,
        num_heads=16,
        out_hidden_size=4096,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=2304,
        deepstack_visual_indexes=[8, 16, 24],
    ),
    tie_word_embeddings=False,
)
# recipe -> (transformers' class prefix, the release's config, its parameters, the trained tower's (blocks, patches
# one attention spans)). At max_pixels 1280 merged tokens (x 28^2 or 32^2) 8192 tokens hold 6 images: 30,720 patches.
PRESETS = {
    "qwen2_5_vl_7b": ("Qwen2_5_VL", RELEASE_7B, 8_292_166_656, [(28, 64), (4, 5120)]),
    "qwen3_vl_8b": ("Qwen3VL", RELEASE_8B, 8_767_123_696, [(27, 5120)]),
}


@pytest.mark.parametrize("recipe", PRESETS)
def test_qwen_presets_are_the_releases_sized_without_their_folders(recipe):
    """recipe=qwen2_5_vl_7b / qwen3_vl_8b without their folders: transformers' class built on the meta device from the
    release's config (8,292,166,656 parameters: Qwen's "8.29B"; 8,767,123,696: "8.77B"), the tower frozen, the
    merger(s) and the language model trained; at max_pixels 1280 merged tokens an image is at most 1280 tokens, 8192
    tokens hold 6 of them: 30,720 patches through the tower a micro-batch. With vlm.train_vision Qwen2.5-VL's blocks
    are two layer types, 28 over 64-patch windows and 4 (fullatt_block_indexes) over whole images; Qwen3-VL's one, 27
    over whole images."""
    import transformers

    prefix, release, params, tower_types = PRESETS[recipe]
    cfg = compose([f"recipe={recipe}", "run.dry_run=true"])
    layers = release["text_config"]["num_hidden_layers"]
    assert cfg.model.text_layers == layers  # model.* read from the release's config
    spec = memory_spec(cfg)
    with torch.device("meta"):
        config = getattr(transformers, f"{prefix}Config")(**release)
        reference = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
    assert cfg.model.vision == reference.config.model_type
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    visual = reference.model.visual
    mergers = n(visual.merger) + n(getattr(visual, "deepstack_merger_list", torch.nn.ModuleList()))
    assert spec.total_params == n(reference) == params
    assert spec.frozen_params == n(visual) - mergers
    assert spec.layer_params == n(reference.model.language_model.layers[0])
    assert (spec.layers, spec.vocab) == (layers, release["text_config"]["vocab_size"])
    assert (spec.seq, spec.micro_batch, spec.more_layers) == (8192, 1, ())
    assert "at most 1280 tokens each" in spec.note and "6 whole such images" in spec.note
    assert "30,720 patches" in spec.note
    tower = memory_spec(compose([f"recipe={recipe}", "run.dry_run=true", "vlm.train_vision=true"])).more_layers
    assert [(t.layers, t.seq, t.batch) for t in tower] == [(k, s, 30720 // s) for k, s in tower_types]
    assert all(t.params == n(visual.blocks[0]) for t in tower)


@pytest.mark.parametrize("recipe", PRESETS)
def test_plan_answers_what_fits_on_8_h100s(capsys, recipe):
    """`scripts/plan.py recipe=qwen2_5_vl_7b cluster.gpus=8` (and qwen3_vl_8b): without cp, full AC fits 8 x 80 GB at
    ZeRO-1, 2 and 3 (its own layout: ZeRO-3) and the activations of 8192 tokens without AC fit at no stage. The plan
    varies parallel.cp too (Ulysses: cp divides the 28 / 32 query heads): without AC a cp=4 layout fits at ZeRO-2,
    and no cp layout is offered at ZeRO-3, which DeepSpeed's engine would refuse (the embedding, 545M / 622M
    elements, is over ZeRO-3's reduce bucket: common/deepspeed.py check_cp_zero3)."""
    heads = {"qwen2_5_vl_7b": 28, "qwen3_vl_8b": 32}[recipe]
    assert load_script("plan").main([f"recipe={recipe}", "cluster.gpus=8", "--all"]) == 0
    out = capsys.readouterr().out
    row = re.compile(r"\s*\d+(\*?)\s+(\d+)\s+1\s+1\s+1\s+(\d+)\s+(zero\d)\s+(\w+)\s.*%(.*)$")
    rows = [
        (star, int(dp), int(cp), stage, ac, note)
        for star, dp, cp, stage, ac, note in (r.groups() for r in map(row.match, out.splitlines()) if r)
    ]
    fitting = sum(not note for *_, note in rows)
    assert f"{fitting} of {len(rows)} layouts the recipe allows fit" in out
    assert {cp for _, dp, cp, *_ in rows} == {c for c in (1, 2, 4, 8) if heads % c == 0}
    assert all(dp * cp == 8 for _, dp, cp, *_ in rows)
    assert sorted((stage, ac) for _, _, cp, stage, ac, note in rows if cp == 1 and not note) == [
        ("zero1", "full"),
        ("zero2", "full"),
        ("zero3", "full"),
    ], out
    assert ("*", 8, 1, "zero3", "full", "") in rows
    assert not [r for r in rows if r[2] > 1 and r[3] == "zero3"]
    assert (2, 4, "zero2", "none", "") in [r[1:] for r in rows]


def test_budgets_sizing_cannot_use_and_a_missing_folder_are_one_line(qwen):
    """An image budget over data.max_seq_len (every image sample would be skipped) stops sizing in one line; a release
    known by name sizes without its folder, and training it without the folder is one line."""
    with pytest.raises(ConfigError, match=r"images of up to 1280 tokens, more than data.max_seq_len=1024"):
        memory_spec(compose(["recipe=qwen2_5_vl_7b", "run.dry_run=true", "data.max_seq_len=1024"]))
    from recipes.vlm.weights import weight_source

    source = weight_source(compose(["recipe=qwen2_5_vl_7b"]))
    with pytest.raises(ConfigError, match=r"Qwen2.5-VL-7B-Instruct: no such folder .* training reads the downloaded"):
        source.load("sdpa")


def test_qwen2_5_vl_7b_dpo_sizes_two_documents_a_pair_and_the_reference_copy(capsys):
    """configs/recipe/qwen2_5_vl_7b_dpo.yaml sized without its folder (run.dry_run composes it): a micro-batch of one
    pair is two documents of 8192 tokens with their images (recipes/vlm/preference.py), so a reference-free loss
    (simpo) keeps twice the SFT preset's activations and transient; the live reference adds to each GPU's weights a
    copy of the release's 8,292,166,656 parameters in bf16, whole under ZeRO 0-2 and an eighth under ZeRO-3 at dp=8
    (common/deepspeed.py frozen_copy), and nothing else there. `scripts/plan.py recipe=qwen2_5_vl_7b_dpo
    cluster.gpus=8` finds one layout to fit 8 x 80 GB, the preset's: ZeRO-3 with full AC, 49.23 GiB (docs/planner.md),
    and offers no cp (not run with preference pairs yet)."""
    from common.memory import Layout, estimate

    dpo = memory_spec(compose(["recipe=qwen2_5_vl_7b_dpo", "run.dry_run=true"]))
    free = memory_spec(compose(["recipe=qwen2_5_vl_7b_dpo", "preference.loss=simpo", "preference.reference=auto"]))
    sft = memory_spec(compose(["recipe=qwen2_5_vl_7b", "run.dry_run=true"]))
    assert (dpo.micro_batch, free.micro_batch, sft.micro_batch) == (2, 2, 1)
    assert "61,440 patches a micro-batch" in dpo.note  # twice the SFT preset's 30,720
    assert dpo.reference_copy and not free.reference_copy
    assert "reference: a frozen reference copy of 8.29B in the compute dtype" in dpo.note
    assert free.note.endswith(
        "reference: reference-free loss: none; 1 pair(s) a micro-batch: 2 documents with their images"
    )
    for stage in range(4):
        for ac in ("none", "full"):
            layout = Layout(dp=8, tp=1, pp=1, zero_stage=stage, ac=ac)
            ref, no_ref, one = estimate(dpo, layout), estimate(free, layout), estimate(sft, layout)
            assert ref["weights"] - no_ref["weights"] == 2 * PRESETS["qwen2_5_vl_7b"][2] / (8 if stage == 3 else 1)
            assert all(ref[k] == no_ref[k] for k in ("grads", "optimizer", "gathered", "activations", "transient"))
            assert (no_ref["activations"], no_ref["transient"]) == (2 * one["activations"], 2 * one["transient"])
    assert load_script("plan").main(["recipe=qwen2_5_vl_7b_dpo", "cluster.gpus=8", "--all"]) == 0
    out = capsys.readouterr().out
    assert "micro batch 2 x 8192 tokens" in out and "1 of 8 layouts the recipe allows fit" in out
    assert re.search(r"\n  1\*\s+8\s+1\s+1\s+1\s+1\s+zero3\s+full\s+3\.86 .* 49\.23\s+62%\n", out), out
