"""Qwen2.5-VL (and Qwen3-VL) at native resolution, packed: tiny random release folders (common/tools/fixtures.py's
make_qwen2_5_vl / make_qwen3_vl, transformers' own classes), images of several sizes and aspect ratios, and a packed
row of samples with 0, 1 and 2 images against transformers' own forward on each sample alone."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from common.data.packing import IGNORE_INDEX
from common.errors import ConfigError
from common.tools.fixtures import make_qwen2_5_vl, make_qwen3_vl
from recipes.vlm.parallelize import freeze_for_stage
from recipes.vlm.qwen import (
    IMAGE_PAD,
    VIDEO_PAD,
    ImageTokensExceed,
    blank_qwen_sample,
    collate_qwen,
    encode_llava_qwen,
    encode_qwen,
    image_pad_repeats,
    load_processing,
    modality_types,
    pack_qwen,
    rope_index_for,
)

# (height, width): one above max_pixels (shrunk), one near min_pixels, a wide one spanning several
# 112-px attention windows of the tower (its windowed blocks), a tall one.
SIZES = [(300, 200), (56, 84), (140, 224), (112, 56)]


def load_release(folder):
    """A release folder as transformers loads it: its model (fp32, eval), tokenizer and image processor."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return types.SimpleNamespace(
        folder=folder,
        model=model,
        tokenizer=tokenizer,
        image_processor=AutoImageProcessor.from_pretrained(folder),
        image_pad=tokenizer.convert_tokens_to_ids(IMAGE_PAD),
        video_pad=tokenizer.convert_tokens_to_ids(VIDEO_PAD),
    )


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return load_release(make_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl")))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Qwen3-VL: 16-px patches (32-px image tokens), DeepStack (the tower's blocks 0 and 1 feed the first two of
    three language layers at the image tokens), interleaved mRoPE on a Qwen3 language model."""
    return load_release(make_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl")))


ARCHS = {"qwen2_5_vl": "qwen", "qwen3_vl": "qwen3"}  # model_type -> its fixture


def image(height: int, width: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def conversation(n_images: int) -> list[dict]:
    if n_images == 0:
        return [{"role": "user", "content": "What is two plus three?"}, {"role": "assistant", "content": "Five."}]
    ask = "<image>\nDescribe the image." if n_images == 1 else "<image>\nCompare the two pictures.\n<image>"
    return [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": "A handwritten digit."},
        {"role": "user", "content": "What digit is this?"},
        {"role": "assistant", "content": "Five."},
    ]


def test_image_tokens_follow_the_processor_rule(qwen):
    """Each image's tokens are the Qwen2.5-VL processor's own replacement for its pad (Qwen2_5_VLProcessor's
    replace_image_token, which the processor applies itself; the processor object cannot be built without
    torchvision), and that is the image processor's patch count for the raw size over merge^2: native resolution,
    so the count varies with size and aspect ratio."""
    from transformers import Qwen2_5_VLProcessor

    images = [image(h, w, i) for i, (h, w) in enumerate(SIZES)]
    messages = [
        {"role": "user", "content": "Compare <image> and <image>.\n<image><image>"},
        {"role": "assistant", "content": "Five."},
    ]
    enc = encode_qwen(messages, images, qwen.tokenizer, qwen.image_processor)
    ip = qwen.image_processor
    rule = types.SimpleNamespace(image_processor=ip, image_token=IMAGE_PAD)
    expected = [
        Qwen2_5_VLProcessor.replace_image_token(rule, {"image_grid_thw": enc["image_grid_thw"]}, i).count(IMAGE_PAD)
        for i in range(len(images))
    ]
    assert expected == [ip.get_number_of_image_patches(h, w) // ip.merge_size**2 for h, w in SIZES]
    assert len(set(expected)) == len(SIZES)  # a different count for every image
    assert (28 * 28 * expected[0] <= ip.size["longest_edge"]) and expected[0] < (300 * 200) // (28 * 28)  # shrunk
    # In the sequence: each image is one run of pads of its count, between <|vision_start|> and <|vision_end|>.
    ids = enc["input_ids"]
    is_pad = (ids == qwen.image_pad).int()
    starts = torch.nonzero(torch.diff(is_pad, prepend=torch.zeros(1, dtype=torch.int32)) == 1).flatten()
    ends = torch.nonzero(torch.diff(is_pad, append=torch.zeros(1, dtype=torch.int32)) == -1).flatten() + 1
    vision_start, vision_end = qwen.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    assert (ends - starts).tolist() == expected
    assert ids[starts - 1].eq(vision_start).all() and ids[ends].eq(vision_end).all()
    assert enc["pixel_values"].shape == (sum(expected) * ip.merge_size**2, 3 * 2 * 14 * 14)
    # Labels: the assistant's answer and its <|im_end|>, nothing of the prompt or the images.
    answer = qwen.tokenizer("Five.<|im_end|>", add_special_tokens=False)["input_ids"]
    assert enc["labels"][enc["labels"] != IGNORE_INDEX].tolist() == answer


def test_placeholder_mismatch_and_image_budget_are_one_line(qwen):
    images = [image(56, 84, 0), image(140, 224, 1)]
    with pytest.raises(ValueError, match=r"^the conversation has 1 image placeholder\(s\) but 2 image\(s\)"):
        encode_qwen(conversation(1), images, qwen.tokenizer, qwen.image_processor)
    with pytest.raises(ImageTokensExceed, match=r"^its 2 image\(s\) take 46 tokens, more than data.max_seq_len 40$"):
        encode_qwen(conversation(2), images, qwen.tokenizer, qwen.image_processor, max_seq_len=40)
    # Over the length but the images fit: cut before the image the cut would split, never inside it.
    full = encode_qwen(conversation(2), images, qwen.tokenizer, qwen.image_processor)
    second = int(torch.nonzero(full["input_ids"] == qwen.image_pad).flatten()[6])  # first token of the 40-token image
    assert second + 30 >= 46  # the images alone fit; the cut falls inside the second
    enc = encode_qwen(conversation(2), images, qwen.tokenizer, qwen.image_processor, max_seq_len=second + 30)
    assert enc["truncated"] and torch.equal(enc["input_ids"], full["input_ids"][:second])
    assert enc["image_grid_thw"].tolist() == full["image_grid_thw"][:1].tolist()
    assert torch.equal(enc["pixel_values"], full["pixel_values"][:24])


def alone_outputs(qwen):
    """Three samples (0, 1 and 2 images of different sizes) and transformers' own forward on each alone: its
    logits and its loss summed over its labels (num_items_in_batch=1, as the trainer asks)."""
    samples = [
        encode_qwen(conversation(n), ims, qwen.tokenizer, qwen.image_processor)
        for n, ims in ((0, []), (1, [image(300, 200, 0)]), (2, [image(56, 84, 1), image(140, 224, 2)]))
    ]
    outputs = []
    with torch.no_grad():
        for s in samples:
            ids = s["input_ids"][None]
            has_images = len(s["image_grid_thw"]) > 0
            outputs.append(
                qwen.model(
                    input_ids=ids,
                    pixel_values=s["pixel_values"] if has_images else None,
                    image_grid_thw=s["image_grid_thw"] if has_images else None,
                    mm_token_type_ids=modality_types(ids, qwen.image_pad, qwen.video_pad),
                    labels=s["labels"][None],
                    num_items_in_batch=1,
                )
            )
    return samples, outputs


@pytest.fixture(scope="module")
def alone():
    """alone_outputs per architecture, computed once for its rows' cases."""
    cache = {}

    def outputs(arch: str, qwen):
        if arch not in cache:
            cache[arch] = alone_outputs(qwen)
        return cache[arch]

    return outputs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rows", [1, 2])
def test_packed_rows_match_each_sample_alone(request, alone, arch, rows):
    """The three samples packed into one row (or two, images in both): the tower takes all the images as one patch
    sequence, the language model the rows with the block-diagonal mask and each sample's own mRoPE positions
    (Qwen3-VL: interleaved; its DeepStack features added at the rows' image tokens in the same order). Every sample's
    logits equal transformers' own forward on it alone (fp32, SDPA: max |diff| is printed; <= 2.4e-7 for both
    architectures when measured), and the packed loss (summed) the sum of the samples' own losses."""
    qwen = request.getfixturevalue(ARCHS[arch])
    assert qwen.model.config.model_type == arch
    samples, outputs = alone(arch, qwen)
    lengths = sorted(len(s["input_ids"]) for s in samples)
    batch = pack_qwen(
        samples,
        rope_index_for(qwen.model.config),  # as the loader workers run it: transformers' get_rope_index, no weights
        max_seq_len=512 if rows == 1 else lengths[-1] + lengths[0],  # the longest + the shortest: two rows
        pad_id=qwen.tokenizer.pad_token_id,
        image_pad_id=qwen.image_pad,
        video_pad_id=qwen.video_pad,
    )
    assert batch.packed.num_rows == rows and batch.image_grid_thw.shape == (3, 3)
    with torch.no_grad():
        out = qwen.model(**batch.model_inputs("sdpa"), use_cache=False, num_items_in_batch=1)
        # The flash inputs (one flattened row, positions as [4, 1, R*L] with the text positions first) without
        # their cu_seq_lens: transformers' own packed-sequence mask, built from that text row (no cache), must
        # give the same logits, so the layout is the one transformers reads as packed.
        flat = {k: v for k, v in batch.model_inputs("flash").items() if not k.startswith(("cu_seq", "max_length"))}
        assert flat["position_ids"].shape == (4, 1, batch.packed.input_ids.numel())
        flash_layout = qwen.model(**flat, use_cache=False).logits.reshape(out.logits.shape)
    placed = [(r, start, n) for r, lens in enumerate(batch.packed.seq_lens) for start, n in _starts(lens)]
    diffs = [
        (out.logits[r, start : start + n] - outputs[i].logits[0]).abs().max().item()
        for i, (r, start, n) in zip(batch.packed.order, placed, strict=True)
    ]
    print(f"{arch}, {rows} row(s): max |packed - alone| per sample {diffs}")
    assert max(diffs) < 1e-5
    assert batch.packed.num_labels == sum(int((s["labels"][1:] != IGNORE_INDEX).sum()) for s in samples)
    torch.testing.assert_close(out.loss, sum(o.loss for o in outputs), rtol=1e-6, atol=1e-5)
    assert (flash_layout - out.logits).abs().max().item() < 1e-5
    # mRoPE is live: image tokens' height and width positions differ from the text's running count.
    assert not torch.equal(batch.position_ids[1], batch.position_ids[2])


def _starts(lens: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each sample in a row."""
    return [(sum(lens[:k]), n) for k, n in enumerate(lens)]


def test_pad_repeats_expand_each_placeholder():
    ids = torch.tensor([5, 9, 6, 9, 7])
    assert image_pad_repeats(ids, 9, [3, 2]).tolist() == [1, 3, 1, 2, 1]
    assert ids.repeat_interleave(image_pad_repeats(ids, 9, [3, 2])).tolist() == [5, 9, 9, 9, 6, 9, 9, 7]


def png(im) -> bytes:
    import io

    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def llava_sample(key: str, messages: list[dict], images: list) -> dict:
    """A raw sample as data.prepare_llava writes it (its JSON record, then image0, image1, ... bytes)."""
    record = {"id": key, "messages": messages, "num_images": len(images)}
    return {"json": json.dumps(record), **{f"image{i}": png(im) for i, im in enumerate(images)}}


def test_llava_samples_collate_with_counted_skips_and_a_blank(qwen):
    """prepare_llava samples with 0 and 2 images and one whose images alone exceed max_seq_len: the over-long one
    is dropped and counted, the rest pack; a micro-batch without images gets the blank image, unlabelled."""
    cfg = qwen.model.config
    kw = dict(max_seq_len=100)
    two = encode_llava_qwen(
        llava_sample("two", conversation(2), [image(56, 84, 1), image(112, 56, 2)]),
        qwen.tokenizer,
        qwen.image_processor,
        **kw,
    )
    text = encode_llava_qwen(llava_sample("text", conversation(0), []), qwen.tokenizer, qwen.image_processor, **kw)
    big = encode_llava_qwen(
        llava_sample("big", conversation(2), [image(300, 200, 0), image(200, 300, 3)]),
        qwen.tokenizer,
        qwen.image_processor,
        **kw,
    )
    assert big == {"skipped": "its 2 image(s) take 108 tokens, more than data.max_seq_len 100", "key": "big"}
    assert two["key"] == "two" and two["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 4]] and not two["truncated"]
    blank = blank_qwen_sample(qwen.image_processor, qwen.image_pad)
    collate = dict(
        rope_index=rope_index_for(cfg),
        packing=True,
        max_seq_len=100,
        pad_id=qwen.tokenizer.pad_token_id,
        image_pad_id=qwen.image_pad,
        video_pad_id=qwen.video_pad,
        blank=blank,
    )
    out = collate_qwen([two, big, text], **collate)
    assert (out["samples"], out["skipped"], out["text_only"]) == (2, 1, 1)
    assert out["batch"].image_grid_thw.tolist() == [[1, 4, 6], [1, 8, 4]]  # no blank: the batch has images
    assert out["real_tokens"] == len(two["input_ids"]) + len(text["input_ids"])
    alone = collate_qwen([text], **collate)
    assert alone["batch"].image_grid_thw.tolist() == blank["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert alone["batch"].packed.num_labels == int((text["labels"][1:] != IGNORE_INDEX).sum())


MERGERS = ("model.visual.merger.", "model.visual.deepstack_merger_list.")  # Qwen3-VL's DeepStack mergers: projectors


@pytest.mark.parametrize(
    ("arch", "stage"), [("qwen2_5_vl", "align"), ("qwen2_5_vl", "finetune"), ("qwen3_vl", "align")]
)
def test_stages_freeze_qwen_parts(request, arch, stage):
    """LLaVA's stages on a Qwen-VL's parts: align trains the merger alone (Qwen3-VL: with its DeepStack mergers),
    finetune the merger and the language model; the tower stays frozen (no vlm.train_vision). One packed backward:
    gradients reach exactly those."""
    from transformers import AutoModelForImageTextToText

    qwen = request.getfixturevalue(ARCHS[arch])
    model = AutoModelForImageTextToText.from_pretrained(qwen.folder, dtype=torch.float32)
    freeze_for_stage(model, stage)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    merger = {n for n, _ in model.named_parameters() if n.startswith(MERGERS)}
    assert any(n.startswith(MERGERS[1]) for n in merger) == (arch == "qwen3_vl")
    language = {n for n, _ in model.named_parameters() if n.startswith(("model.language_model.", "lm_head."))}
    assert trainable == (merger if stage == "align" else merger | language)
    samples = [
        encode_qwen(conversation(n), ims, qwen.tokenizer, qwen.image_processor)
        for n, ims in ((0, []), (2, [image(56, 84, 1), image(140, 224, 2)]))
    ]
    batch = pack_qwen(
        samples,
        rope_index_for(model.config),
        max_seq_len=512,
        pad_id=qwen.tokenizer.pad_token_id,
        image_pad_id=qwen.image_pad,
        video_pad_id=qwen.video_pad,
    )
    model(**batch.model_inputs("sdpa"), use_cache=False).loss.backward()
    reached = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert reached == trainable


def test_pixel_budget_overrides_the_folder_and_bad_ones_are_one_line(qwen):
    """data.min_pixels / data.max_pixels replace the folder's budget: a 300x200 image then has the tokens
    transformers' smart_resize gives for it within the new budget; an inverted or too small budget, and a tokenizer
    whose <|image_pad|> is not the model's, stop with one line."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    image_token_id = qwen.model.config.image_token_id
    low, high = 28 * 28 * 8, 28 * 28 * 16
    _, ip = load_processing(qwen.folder, image_token_id, min_pixels=low, max_pixels=high)
    h, w = smart_resize(300, 200, 28, low, high)
    grid = ip(images=[image(300, 200, 0)], return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == [[1, h // 14, w // 14]] and h * w <= high
    bad = {
        (high, low): f"data.min_pixels={high} is above data.max_pixels={low}",
        (28 * 28 * 100, 0): "the pixel budget 78400..50176 is inverted (data.min_pixels / data.max_pixels)",
        (0, 700): "data.max_pixels=700 is below one merged 28x28 patch (784 pixels)",
    }
    for (mn, mx), message in bad.items():
        with pytest.raises(ConfigError) as err:
            load_processing(qwen.folder, image_token_id, min_pixels=mn, max_pixels=mx)
        assert str(err.value) == message
    with pytest.raises(
        ConfigError, match=r"the tokenizer's <\|image_pad\|> is id \d+, the model's image_token_id is 3$"
    ):
        load_processing(qwen.folder, 3)


@pytest.mark.parametrize(("arch", "name", "unit"), [("qwen2_5_vl", "Qwen2.5-VL", 28), ("qwen3_vl", "Qwen3-VL", 32)])
def test_init_from_a_qwen_folder_sets_the_model_keys_and_bad_keys_are_one_line(request, arch, name, unit):
    """model.init_from=<a Qwen2.5-VL or Qwen3-VL folder>: the model.* keys are its config's (its own tower: model.vision
    qwen2_5_vl / qwen3_vl), vlm.stage=align (the merger alone) composes, and the pixel budget keys compose; an inverted
    budget, one below the architecture's merged patch (28 or 32 px square), a budget for a LLaVA and a chosen
    model.vision stop at composition, one line."""
    from common.launch import compose

    qwen = request.getfixturevalue(ARCHS[arch])
    folder, c = str(qwen.folder), qwen.model.config
    cfg = compose(
        ["recipe=vlm_tiny", "data=llava", f"model.init_from={folder}", "vlm.stage=align", "data.max_pixels=12544"]
    )
    m, v, t = cfg.model, c.vision_config, c.text_config
    assert (m.vision, m.vision_hidden_size, m.vision_layers, m.vision_heads, m.vision_patch_size) == (
        arch,
        v.hidden_size,
        v.depth,
        v.num_heads,
        v.patch_size,
    )
    assert (m.text_hidden_size, m.text_layers, m.text_kv_heads, m.vocab_size, m.max_seq_len) == (
        t.hidden_size,
        t.num_hidden_layers,
        t.num_key_value_heads,
        t.vocab_size,
        t.max_position_embeddings,
    )
    assert (cfg.data.min_pixels, cfg.data.max_pixels) == (0, 12544)
    bad = {
        (f"model.init_from={folder}", "data.min_pixels=12544", "data.max_pixels=3136"): (
            "data.min_pixels=12544 is above data.max_pixels=3136"
        ),
        (f"model.init_from={folder}", f"data.max_pixels={unit * unit - 1}"): (
            f"data.max_pixels={unit * unit - 1} is below one merged {unit}x{unit} patch ({unit * unit} pixels)"
        ),
        ("data.max_pixels=12544",): (
            "data.min_pixels / data.max_pixels are the pixel budget of a native-resolution model "
            "(model.init_from=<a Qwen2.5-VL or Qwen3-VL folder>); a LLaVA resizes every image to its tower's image "
            "size"
        ),
        (f"model.vision={arch}",): f"model.vision={arch} is read from model.init_from=<a {name} folder>, not chosen",
    }
    for overrides, message in bad.items():
        with pytest.raises(ConfigError) as err:
            compose(["recipe=vlm_tiny", "data=llava", *overrides])
        assert str(err.value) == message, overrides


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_export_is_a_peft_adapter_over_the_release(request, arch, tmp_path):
    """finetune=lora on a Qwen2.5-VL / Qwen3-VL: adapters on the language model's linears, the merger(s) in full,
    nothing else trains; the export is a PEFT folder that peft itself loads over the release with the adapted model's
    logits, and export.merge_lora's merged folder loads as the release's class with them too (fp32)."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from common.launch import compose
    from recipes.vlm.lora import write_export
    from recipes.vlm.parallelize import trainable_parts
    from recipes.vlm.qwen import load_qwen

    qwen = request.getfixturevalue(ARCHS[arch])
    cfg = compose(
        ["recipe=vlm_tiny", "data=llava", f"model.init_from={qwen.folder}", "finetune=lora", "export.merge_lora=true"]
    )
    model = load_qwen(qwen.folder, "sdpa")
    assert type(model) is type(qwen.model)
    trainable_parts(model, cfg)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    merger = [n for n in trained if n.startswith(MERGERS)]
    adapters = [n for n in trained if n.startswith("model.language_model.layers.") and ".lora_" in n]
    layers = model.config.text_config.num_hidden_layers
    assert merger and len(adapters) == layers * 7 * 2 and sorted(trained) == sorted(merger + adapters)
    torch.manual_seed(1)
    with torch.no_grad():  # as training leaves them: B off zero, the merger moved
        for n in trained:
            p = model.get_parameter(n)
            p.add_(torch.randn_like(p) * 0.05)
    processing = load_processing(qwen.folder, model.config.image_token_id)
    write_export(model, cfg, tmp_path, base=str(qwen.folder), processor=processing)
    s = encode_qwen(conversation(1), [image(300, 200, 0)], qwen.tokenizer, qwen.image_processor)
    ids = s["input_ids"][None]
    inputs = dict(
        input_ids=ids,
        pixel_values=s["pixel_values"],
        image_grid_thw=s["image_grid_thw"],
        mm_token_type_ids=modality_types(ids, qwen.image_pad, qwen.video_pad),
    )
    base = AutoModelForImageTextToText.from_pretrained(qwen.folder, dtype=torch.float32)
    with torch.no_grad():
        want = model.eval()(**inputs).logits
        peft = PeftModel.from_pretrained(base, tmp_path).eval()(**inputs).logits
        merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", dtype=torch.float32)
        assert type(merged) is type(qwen.model)
        merged = merged.eval()(**inputs).logits
        plain = qwen.model(**inputs).logits
    diffs = [(x - want).abs().max().item() for x in (peft, merged)]
    print(f"{arch}: max |peft - trained|, |merged - trained| logits: {diffs}")
    assert max(diffs) < 1e-5 and (plain - want).abs().max().item() > 1e-3  # the adapter changes the logits
