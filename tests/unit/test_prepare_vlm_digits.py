"""Unit tests for data.prepare_vlm_digits and what training reads of it (recipes/vlm): shards vs prepare_digits,
text variety, offline processor, labels, answer parsing, loader."""

from __future__ import annotations

import functools
import io
import json
import os
import pickle
import shutil
import socket

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from common.data.webdataset import build_webdataset_loader
from data import prepare_digits as pd
from data import prepare_vlm_digits as vd
from recipes.vlm.data import IGNORE_INDEX, decode_png, encode_sample, load_processor, prompt_messages
from recipes.vlm.evaluate import load_eval_samples, parse_answer

SEED = 3
BUILD_ARGS = ["--train-shards", "4", "--val-shards", "2", "--seed", str(SEED)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("vlm") / "vlm_digits"
    assert vd.main(["--out", str(out), *BUILD_ARGS]) == 0
    return out


@pytest.fixture(scope="module")
def meta(built):
    return vd.ensure_vlm_digits(built, train_shards=4, val_shards=2, seed=SEED)


@pytest.fixture(scope="module")
def processor(meta):
    return load_processor(meta["processor_dir"])


@pytest.fixture(scope="module")
def samples(meta):
    """All raw samples, train then val, in shard order."""
    return list(wds.WebDataset(meta["train_urls"] + meta["val_urls"], shardshuffle=False, empty_check=False))


@pytest.fixture(scope="module")
def encoded(samples, processor):
    return [encode_sample(s, processor) for s in samples]


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test (the processor must load offline)."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _image(png: bytes) -> Image.Image:
    return decode_png(png)


def _generation_ids(processor, question: str, png: bytes) -> torch.Tensor:
    """What eval-time generation feeds the model: chat template with generation prompt, then the processor."""
    prompt = processor.apply_chat_template(prompt_messages(question), add_generation_prompt=True)
    return processor(text=prompt, images=_image(png), return_tensors="pt")["input_ids"][0]


# --- files and split -------------------------------------------------------------------------------


def test_files_and_meta(built, meta):
    assert meta["source"] == "sklearn.datasets.load_digits" and meta["seed"] == SEED
    assert meta["image_size"] == 16 and meta["patch_size"] == 4 and meta["num_image_tokens"] == 16
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    assert train["shards"] == [f"train-{i:06d}.tar" for i in range(4)]
    assert val["shards"] == [f"val-{i:06d}.tar" for i in range(2)]
    assert train["samples"] + val["samples"] == 1797
    assert meta["train_urls"] == [str(built / n) for n in train["shards"]]
    assert all(os.path.isabs(u) for u in meta["train_urls"] + meta["val_urls"])
    assert meta["processor_dir"] == str(built / "processor")
    assert sorted(p.name for p in built.iterdir()) == sorted(
        ["meta.json", "processor", *train["shards"], *val["shards"]]
    )
    assert set(meta["processor_files"]) == {p.name for p in (built / "processor").iterdir()}
    assert [p.name for p in built.parent.iterdir()] == ["vlm_digits"]  # no temp dirs left behind


def test_same_split_and_images_as_prepare_digits(tmp_path, meta, samples):
    assert pd.main(["--out", str(tmp_path / "digits"), *BUILD_ARGS]) == 0
    ref_meta = pd.ensure_digits_shards(tmp_path / "digits", train_shards=4, val_shards=2, seed=SEED)
    ref = {
        s["__key__"]: s
        for s in wds.WebDataset(ref_meta["train_urls"] + ref_meta["val_urls"], shardshuffle=False, empty_check=False)
    }
    ours = {s["__key__"]: s for s in samples}
    assert len(ours) == len(samples) == 1797
    assert set(ours) == set(ref)  # same keys, and the split is in the key ("train_000123")
    for key, s in ours.items():
        assert s["png"] == ref[key]["png"] and s["cls"] == ref[key]["cls"]
        assert json.loads(s["json"])["label"] == int(s["cls"])
    # Same membership shard by shard, too.
    for split in ("train", "val"):
        for url, ref_url in zip(meta[f"{split}_urls"], ref_meta[f"{split}_urls"], strict=True):
            keys = [s["__key__"] for s in wds.WebDataset(url, shardshuffle=False, empty_check=False)]
            assert keys == [s["__key__"] for s in wds.WebDataset(ref_url, shardshuffle=False, empty_check=False)]


# --- text ----------------------------------------------------------------------------------------------


def test_varied_questions_and_answers(samples, encoded):
    texts = [json.loads(s["json"]) for s in samples]
    questions = {t["question"] for t in texts}
    assert questions == set(vd.QUESTIONS) and len(questions) >= 5
    styles = {len(t["answer"].split()) for t in texts}
    assert {1, 4, 5, 6} <= styles  # "7"/"seven", "It is a seven.", ..., "This image shows the number seven."
    # Every style is used for every digit (no style tied to one class).
    for label in range(10):
        assert len({t["answer"] for t in texts if t["label"] == label}) == len(vd.ANSWER_TEMPLATES)
    lengths = [len(e["input_ids"]) for e in encoded]
    assert max(lengths) - min(lengths) >= 10 and len(set(lengths)) >= 10
    answer_tokens = [int((e["labels"] != IGNORE_INDEX).sum()) for e in encoded]
    assert min(answer_tokens) == 2 and max(answer_tokens) >= 10  # "7</s>" ... a full sentence + </s>


def test_text_choice_is_deterministic_per_seed_and_key():
    assert vd.choose_text("train_000001", 7, 0) == vd.choose_text("train_000001", 7, 0)
    keys = [f"train_{i:06d}" for i in range(200)]
    a = [vd.choose_text(k, 7, 0) for k in keys]
    b = [vd.choose_text(k, 7, 1) for k in keys]
    assert a != b and all(t["label"] == 7 for t in a)
    assert vd.render_answer("It is {a} {w}.", 8) == "It is an eight."


@pytest.mark.parametrize("label", range(10))
def test_parse_answer_reads_every_answer_style(label):
    for template in vd.ANSWER_TEMPLATES:
        answer = vd.render_answer(template, label)
        assert parse_answer(answer) == label, answer
        assert parse_answer(answer.upper() + "</s>") == label


def test_parse_answer_edge_cases():
    assert parse_answer("7") == 7 and parse_answer("seven") == 7 and parse_answer("It is a seven.") == 7
    assert parse_answer(" Zero") == 0 and parse_answer("the digit 8, that is eight") == 8
    for text in ("", "I do not know.", "someone", "17", "tone", "seven or one", "1 2 3"):
        assert parse_answer(text) is None, text


def test_eval_samples_are_the_val_split_in_shard_order(meta, samples, monkeypatch):
    """What evaluation reads on every rank: the first val samples, in the order the shards hold them,
    also in a torchrun job (RANK/WORLD_SIZE set: a bare wds.WebDataset refused to read there)."""
    val = [s for s in samples if s["__key__"].startswith("val_")]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    got = load_eval_samples(meta["val_urls"], 25)
    assert len(got) == 25
    for g, s in zip(got, val):
        text = json.loads(s["json"])
        assert g["question"] == text["question"] and g["label"] == int(s["cls"]) == text["label"]
        with Image.open(io.BytesIO(s["png"])) as ref:
            np.testing.assert_array_equal(np.asarray(g["image"]), np.asarray(ref))
    assert len(load_eval_samples(meta["val_urls"], 10**6)) == len(val) == meta["splits"]["val"]["samples"]


# --- processor -------------------------------------------------------------------------------------------


def test_processor_loads_offline_with_auto_processor(meta, no_network):
    from transformers import AutoProcessor, LlavaProcessor

    proc = AutoProcessor.from_pretrained(meta["processor_dir"], local_files_only=True)
    assert isinstance(proc, LlavaProcessor)
    assert isinstance(load_processor(os.path.dirname(meta["processor_dir"])), LlavaProcessor)
    tok = proc.tokenizer
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    assert tok.pad_token_id == 0 and proc.image_token == "<image>"
    assert proc.image_token_id == tok.convert_tokens_to_ids("<image>")
    for special in vd.SPECIAL_TOKENS:
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1, special
        assert special in tok.all_special_tokens
    assert 300 <= len(tok) <= 1000 and len(tok) == meta["vocab_size"]
    assert proc.patch_size == 4 and proc.vision_feature_select_strategy == "full"
    assert proc.num_additional_image_tokens == 0
    assert proc.image_processor.size == {"height": 16, "width": 16}
    assert proc.chat_template == tok.chat_template == vd.CHAT_TEMPLATE
    # Byte-level BPE: any text round-trips, nothing becomes <unk>.
    text = "Ünïcode 12 ✓"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_image_token_expansion_and_pixels(processor, samples):
    s = samples[0]
    ids = _generation_ids(processor, "What digit is this?", s["png"])
    assert int((ids == processor.image_token_id).sum()) == 16 == (16 // 4) ** 2
    pixels = processor(text="<image>", images=_image(s["png"]), return_tensors="pt")["pixel_values"]
    assert pixels.shape == (1, 3, 16, 16) and pixels.dtype == torch.float32
    # NEAREST 2x upscale of the stored 8x8 digit, RGB, scaled to [-1, 1].
    gray = np.asarray(Image.open(io.BytesIO(s["png"])), dtype=np.float32)
    expect = (np.repeat(np.repeat(gray, 2, 0), 2, 1) / 255 - 0.5) / 0.5
    for c in range(3):
        np.testing.assert_allclose(pixels[0, c].numpy(), expect, atol=1e-6)
    # Other sizes: (image_size / patch_size)^2 tokens.
    big = vd.build_processor(image_size=32, patch_size=4)
    prompt = big.apply_chat_template(prompt_messages("Read the digit."), add_generation_prompt=True)
    out = big(text=prompt, images=_image(s["png"]), return_tensors="pt")
    assert int((out["input_ids"] == big.image_token_id).sum()) == 64 and out["pixel_values"].shape == (1, 3, 32, 32)
    with pytest.raises(ValueError, match="multiple of patch_size"):
        vd.build_processor(image_size=16, patch_size=5)


def test_chat_template_renders_strings_parts_and_generation_prompt(processor):
    msgs = prompt_messages("What digit is this?")
    assert processor.apply_chat_template(msgs) == "<s><|user|>\n<image>What digit is this?<|end|>\n"
    assert processor.apply_chat_template(msgs, add_generation_prompt=True).endswith("<|end|>\n<|assistant|>\n")
    conv = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "seven"}]},
    ]
    assert processor.tokenizer.apply_chat_template(conv, tokenize=False) == (
        "<s><|system|>\nAnswer briefly.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nseven</s>"
    )
    with pytest.raises(Exception, match="unsupported role"):
        processor.apply_chat_template([{"role": "tool", "content": "x"}])


# --- encode_sample -----------------------------------------------------------------------------------------


def test_labels_mask_exactly_the_prompt(processor, samples, encoded):
    tok = processor.tokenizer
    for s, e in list(zip(samples, encoded))[::97]:
        text = json.loads(s["json"])
        prompt = _generation_ids(processor, text["question"], s["png"])
        n = len(prompt)
        assert e["input_ids"].dtype == e["labels"].dtype == torch.long
        assert e["input_ids"].shape == e["labels"].shape
        assert torch.equal(e["input_ids"][:n], prompt)  # token for token the generation-time prompt
        assert bool((e["labels"][:n] == IGNORE_INDEX).all())  # image tokens included
        assert torch.equal(e["labels"][n:], e["input_ids"][n:]) and bool((e["labels"][n:] != IGNORE_INDEX).all())
        assert int(e["labels"][-1]) == tok.eos_token_id and int((e["input_ids"] == tok.eos_token_id).sum()) == 1
        assert tok.decode(e["labels"][n:-1]) == text["answer"] == e["answer"]
        assert e["label"] == int(s["cls"]) and e["question"] == text["question"] and e["key"] == s["__key__"]
        assert e["pixel_values"].shape == (3, 16, 16) and e["pixel_values"].dtype == torch.float32
        # The whole sequence is the chat template's rendering of the finished conversation.
        conv = prompt_messages(text["question"]) + [{"role": "assistant", "content": text["answer"]}]
        full = processor(text=processor.apply_chat_template(conv), images=_image(s["png"]), return_tensors="pt")
        assert torch.equal(full["input_ids"][0], e["input_ids"])
        assert torch.equal(full["pixel_values"][0], e["pixel_values"])


def test_prompt_matches_tokenizing_chat_template(processor, samples, encoded):
    """apply_chat_template(tokenize=True) with the image inside the message gives the same prompt ids."""
    s, e = samples[1], encoded[1]
    msgs = prompt_messages(e["question"])
    msgs[0]["content"][0]["image"] = _image(s["png"])
    out = processor.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    n = out["input_ids"].shape[1]
    assert torch.equal(out["input_ids"][0], e["input_ids"][:n]) and bool((e["labels"][:n] == IGNORE_INDEX).all())
    assert bool((e["labels"][n:] != IGNORE_INDEX).all())


def test_encode_sample_is_picklable_and_works_in_the_loader(meta, processor, encoded):
    decode = functools.partial(encode_sample, processor=processor)
    restored = pickle.loads(pickle.dumps(decode))
    by_key = {e["key"]: e for e in encoded}
    loader = build_webdataset_loader(
        meta["train_urls"], decode=restored, batch_size=8, rank=0, world_size=1, num_workers=2, seed=0, collate=list
    )
    try:
        batches = [batch for _, batch in zip(range(3), loader)]
    finally:
        loader.close()
    for batch in batches:
        assert isinstance(batch, list) and len(batch) == 8
        for e in batch:
            assert e["key"].startswith("train_")
            ref = by_key[e["key"]]  # same result as in this process
            assert torch.equal(e["input_ids"], ref["input_ids"]) and torch.equal(e["labels"], ref["labels"])
            assert torch.equal(e["pixel_values"], ref["pixel_values"])


def test_encode_sample_rejects_inconsistent_labels(samples, processor):
    bad = dict(samples[0], cls=b"9" if samples[0]["cls"] != b"9" else b"1")
    with pytest.raises(ValueError, match="disagree"):
        encode_sample(bad, processor)


# --- rebuild -------------------------------------------------------------------------------------------------


def test_rebuild_is_a_noop_and_other_settings_are_refused(built, capsys):
    before = {p.name: p.stat().st_mtime_ns for p in built.rglob("*")}
    assert vd.main(["--out", str(built), *BUILD_ARGS]) == 0
    assert "nothing to do" in capsys.readouterr().out
    meta, built_now = vd.build_vlm_digits(built, train_shards=4, val_shards=2, seed=SEED)
    assert not built_now
    assert {p.name: p.stat().st_mtime_ns for p in built.rglob("*")} == before
    assert vd.main(["--out", str(built), "--train-shards", "4", "--val-shards", "2", "--seed", "0"]) == 1
    with pytest.raises(ValueError, match="patch_size=4 \\(wanted 8\\)"):
        vd.ensure_vlm_digits(built, patch_size=8, train_shards=4, val_shards=2, seed=SEED)
    assert {p.name: p.stat().st_mtime_ns for p in built.rglob("*")} == before


def test_fresh_build_is_byte_identical(built, tmp_path):
    other = tmp_path / "again"
    vd.ensure_vlm_digits(other, train_shards=4, val_shards=2, seed=SEED)
    for path in sorted(built.rglob("*")):
        if path.is_file():
            assert (other / path.relative_to(built)).read_bytes() == path.read_bytes(), path.name


def test_incomplete_or_foreign_directories(built, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(built, broken)
    (broken / "processor" / "tokenizer.json").write_text("{}")
    assert vd.read_meta(broken) is None
    assert vd.main(["--out", str(broken), *BUILD_ARGS]) == 2  # not ours to delete without --force
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert vd.main(["--out", str(foreign)]) == 2
    assert (foreign / "notes.txt").read_text() == "keep me"
