"""Preference pairs (data.prepare_preference) in TRL's standard and conversational layouts and UltraFeedback's:
each document equal to what transformers' apply_chat_template (or the plain tokenizer, for text) gives, labels
exactly on the answer, malformed rows skipped and counted; and what training makes of a pair
(recipes/llm/preference.py): two documents of one packed row, chosen then rejected."""

from __future__ import annotations

import json

import pytest
import torch

from common.data.dataset import load_dataset_meta
from common.data.packing import IGNORE_INDEX
from common.data.webdataset import iter_samples
from data import prepare_preference
from recipes.llm.preference import decode_pair, pack_pairs, split_pair
from tests.fixtures.llm import EOT, write_llama_tokenizer
from tests.fixtures.preference import LAYOUTS, preference_row, write_pairs


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_llama_tokenizer(tmp_path_factory.mktemp("tok") / "Llama-3.2-1B")


def build(tokenizer_dir, out, inputs, *extra) -> dict:
    argv = ["--tokenizer", str(tokenizer_dir), "--input", *map(str, inputs), "--out", str(out), "--val-fraction", "0.1"]
    assert prepare_preference.main([*argv, *extra]) == 0
    meta = load_dataset_meta(out, "tokenizer")
    return meta


def pairs_of(meta: dict) -> list[dict]:
    return [decode_pair(s) for s in iter_samples([*meta["train_urls"], *meta["val_urls"]])]


def expected(tokenizer, layout: str, side: str) -> tuple[list[int], str]:
    """(the document's ids, the answer's text) as transformers renders the pair about hot/cold, independently."""
    row = preference_row("hot", "cold", layout)
    if layout == "standard":
        prompt = tokenizer(row["prompt"])["input_ids"]
        answer = tokenizer(row[side], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return prompt + answer, tokenizer.decode(answer)
    head = row["prompt"] if layout == "conversational" else []
    messages = head + row[side] if layout == "conversational" else row[side]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    return list(ids), messages[-1]["content"] + EOT


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_gives_the_chat_template_documents_with_labels_on_the_answer(tokenizer_dir, tmp_path, layout):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    suffix = ".json" if layout == "implicit" else ".jsonl"  # a .json list reads as a .jsonl does
    pairs_file = tmp_path / f"pairs{suffix}"
    pairs_file.write_text(
        json.dumps([preference_row("hot", "cold", layout)] * 4)
        if suffix == ".json"
        else "".join(json.dumps(preference_row("hot", "cold", layout)) + "\n" for _ in range(4))
    )
    meta = build(tokenizer_dir, tmp_path / "out", [pairs_file])
    assert meta["format"] == "preference" and meta["pairs"] == 4
    for pair in pairs_of(meta):
        for side, doc in zip(("chosen", "rejected"), split_pair(pair)):
            ids, answer = expected(tokenizer, layout, side)
            assert doc["input_ids"].tolist() == ids
            labelled = doc["labels"][doc["labels"] != IGNORE_INDEX]
            assert tokenizer.decode(labelled) == answer
            # the answer is the document's tail: every label after the prompt, none before
            first = int((doc["labels"] != IGNORE_INDEX).nonzero()[0])
            assert (doc["labels"][first:] == doc["input_ids"][first:]).all()


def test_malformed_rows_are_skipped_and_counted(tokenizer_dir, tmp_path):
    good = preference_row("up", "down", "conversational")
    long_prompt = {**good, "prompt": [{"role": "user", "content": "word " * 100}]}
    long_answer = {**good, "chosen": [{"role": "assistant", "content": "down " * 100}]}
    rows = [
        json.dumps(good),
        json.dumps({k: v for k, v in good.items() if k != "rejected"}),
        json.dumps({**good, "rejected": good["chosen"]}),
        json.dumps(long_prompt),
        json.dumps(long_answer),
        "{not json",
        json.dumps({**good, "chosen": [{"role": "user", "content": "no answer"}]}),
    ]
    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text("\n".join(rows * 2) + "\n")
    meta = build(tokenizer_dir, tmp_path / "out", [pairs_file], "--max-seq-len", "128")
    assert meta["pairs"] == 2
    assert meta["inputs"]["skipped_rows"] == {
        "a missing side (chosen or rejected)": 2,
        "chosen equals rejected": 2,
        prepare_preference.PROMPT_TOO_LONG: 2,
        prepare_preference.PAIR_TOO_LONG: 2,
        "bad JSON": 2,
        "an answer that is not one final assistant turn after a prompt": 2,
    }
    assert meta["longest_sample"] <= 128


def test_a_pair_is_two_documents_of_one_row_chosen_first(tokenizer_dir, tmp_path):
    meta = build(tokenizer_dir, tmp_path / "out", [write_pairs(tmp_path / "pairs.jsonl", n=6)])
    pairs = pairs_of(meta)[:4]
    # 2 ranks, 2 rows each, 1 pair a row: rank 1 gets rows 1 and 3
    batch = pack_pairs([[p] for p in pairs], dp_rank=1, dp=2, max_seq_len=128, pad_id=0)
    assert batch.pairs == 2 and batch.packed.num_rows == 2
    for r, pair in enumerate((pairs[1], pairs[3])):
        chosen, rejected = split_pair(pair)
        n, m = len(chosen["input_ids"]), len(rejected["input_ids"])
        assert batch.packed.seq_lens[r] == [n, m]
        assert batch.doc_index[r, :n].eq(2 * r).all() and batch.doc_index[r, n : n + m].eq(2 * r + 1).all()
        assert batch.doc_index[r, n + m :].eq(-1).all()
        assert batch.packed.input_ids[r, : n + m].tolist() == pair["input_ids"].tolist()
        mask = batch.packed.attention_mask_4d()[r, 0]
        assert not mask[n:, :n].any()  # the rejected answer never sees the chosen document
        assert torch.equal(batch.packed.position_ids[r, n : n + m], torch.arange(m))


def test_the_lora_reference_is_the_base_with_the_adapter_disabled():
    """finetune=lora's reference: the policy's forward with its adapter off gives the frozen base's logits (a copy
    of the model before LoRA), and the adapter is back on afterwards."""
    import copy

    from common.config import LoRAConfig
    from common.lora import adapters_disabled, apply_lora
    from tests.fixtures.flops import tiny_llama

    base, tokens = tiny_llama()
    model = apply_lora(copy.deepcopy(base), LoRAConfig(rank=4, targets=["wq", "wv", "w2"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.5)  # a trained adapter: B != 0
        want = base(tokens)
        adapted = model(tokens)
        with adapters_disabled(model):
            off = model(tokens)
        again = model(tokens)
    assert not torch.allclose(adapted, want, atol=1e-3)
    torch.testing.assert_close(off, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(again, adapted)


# --- pairs with images: the VLM's layout (--images), stored as text with the image files' bytes ---------------


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _parts(*parts: str) -> list[dict]:
    """OpenAI/TRL content parts: "<image>" an image part, anything else a text part."""
    return [{"type": "image"} if p == "<image>" else {"type": "text", "text": p} for p in parts]


SYSTEM = {"role": "system", "content": "Be brief."}
# id -> (row, the stored prompt, chosen, rejected, the images in order), the stored text written out by hand
IMAGE_PAIRS = {
    "strings": (
        {"images": ["a.png"], "prompt": "<image>What colour?", "chosen": "Red.", "rejected": "Blue."},
        [_user("<image>What colour?")], "Red.", "Blue.", ["a.png"],
    ),
    "one image, no placeholder": (
        {"image": "b.png", "prompt": "What colour?", "chosen": "Blue.", "rejected": "Red."},
        [_user("<image>What colour?")], "Blue.", "Red.", ["b.png"],
    ),
    "rlaif-v parts": (
        {
            "images": ["a.png", "b.png"],
            "prompt": [{"role": "user", "content": _parts("<image>", "Left or", "<image>", " right?")}],
            "chosen": [{"role": "assistant", "content": _parts("Left.")}],
            "rejected": [{"role": "assistant", "content": _parts("Right.")}],
        },
        [_user("<image>Left or<image> right?")], "Left.", "Right.", ["a.png", "b.png"],
    ),
    "messages, no placeholder": (
        {
            "images": ["b.png", "a.png"],
            "prompt": [SYSTEM, _user("First?"), _assistant("Blue."), _user("Next?")],
            "chosen": [_assistant("Red.")],
            "rejected": "Green.",
        },
        [SYSTEM, _user("<image><image>First?"), _assistant("Blue."), _user("Next?")],
        "Red.", "Green.", ["b.png", "a.png"],
    ),
    "implicit prompt": (
        {"images": ["a.png"], "chosen": [_user("Colour?<image>"), _assistant("Red.")],
         "rejected": [_user("Colour?<image>"), _assistant("Pink.")]},
        [_user("Colour?<image>")], "Red.", "Pink.", ["a.png"],
    ),
}  # fmt: skip


@pytest.fixture
def images(tmp_path):
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    Image.new("RGB", (4, 4), "red").save(folder / "a.png")
    Image.new("RGB", (6, 2), "blue").save(folder / "b.png")
    (folder / "bad.png").write_bytes(b"\x89PNG not an image")
    return folder


def build_image_pairs(capsys, images, rows: list | None, out, *extra) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the build of ``rows`` (written to ``out``.jsonl unless None: as they are)."""
    pairs_file = out.parent / f"{out.name}.jsonl"
    if rows is not None:
        pairs_file.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    argv = ["--input", str(pairs_file), "--images", str(images), "--out", str(out), "--val-shards", "1"]
    rc = prepare_preference.main([*argv, "--workers", "1", *extra])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_each_image_layout_is_stored_as_the_prompt_turns_the_answers_and_the_image_bytes(capsys, images, tmp_path):
    rows = [{"id": name, **row} for name, (row, *_) in IMAGE_PAIRS.items()]
    rc, out, _ = build_image_pairs(capsys, images, rows, tmp_path / "vpairs")
    assert rc == 0 and "5 pairs with 7 images" in out
    meta = load_dataset_meta(tmp_path / "vpairs")
    from recipes.vlm.data import PAIRS  # the format the VLM's preference training reads

    assert meta["format"] == prepare_preference.VLM_FORMAT == PAIRS == "llava-preference"
    assert (meta["pairs"], meta["text_only"], meta["multi_turn"]) == (5, 0, 1)
    assert meta["splits"]["train"]["samples"] == 4 and meta["splits"]["val"]["samples"] == 1
    samples = list(iter_samples([*meta["train_urls"], *meta["val_urls"]]))
    assert len({s["__key__"] for s in samples}) == 5
    for s in samples:
        record = json.loads(s["json"])
        _, prompt, chosen, rejected, files = IMAGE_PAIRS[record["id"]]
        assert record == {"id": record["id"], "prompt": prompt, "chosen": chosen, "rejected": rejected,
                          "num_images": len(files)}  # fmt: skip
        assert sorted(k for k in s if k.startswith("image")) == [f"image{i}" for i in range(len(files))]
        assert [s[f"image{i}"] for i in range(len(files))] == [(images / f).read_bytes() for f in files]
    # the same command again finds the dataset there
    assert build_image_pairs(capsys, images, None, tmp_path / "vpairs")[:2] == (
        0, f"{tmp_path / 'vpairs'}/meta.json exists; nothing to do (pass --force to rebuild)\n"
    )  # fmt: skip


def test_image_pairs_that_cannot_be_used_are_skipped_and_counted(capsys, images, tmp_path):
    good = {"images": ["a.png"], "prompt": "<image>Colour?", "chosen": "Red.", "rejected": "Blue."}
    rows = [
        good,
        good,
        {**good, "images": ["none.png"]},
        {**good, "images": ["bad.png"]},
        {**good, "prompt": "<image><image>Colour?"},
        {**good, "chosen": "Red.<image>"},
        {k: v for k, v in good.items() if k != "rejected"},
        {**good, "rejected": "Red."},
        {**good, "chosen": [_user("Red.")], "rejected": [_assistant("Blue.")]},
        "{not json",
        {**good, "prompt": [{"role": "user", "content": [{"type": "video"}]}]},
    ]
    rc, out, _ = build_image_pairs(capsys, images, rows, tmp_path / "vpairs")
    assert rc == 0
    meta = load_dataset_meta(tmp_path / "vpairs")
    assert meta["pairs"] == 2
    assert meta["inputs"]["skipped_rows"] == {
        "missing image": 1,
        "undecodable image": 1,
        "<image> count mismatch": 2,
        "a missing side (chosen or rejected)": 1,
        "chosen equals rejected": 1,
        "an answer that is not one final assistant turn after a prompt": 1,
        "bad JSON": 1,
        "malformed": 1,
    }
    assert f"first missing image: vpairs.jsonl:3: {images / 'none.png'}" in out
    assert "skipped rows: 2 <image> count mismatch" in out


def test_image_pairs_bad_input_is_one_line(capsys, images, tmp_path):
    bad = {"images": ["none.png"], "prompt": "Colour?", "chosen": "Red.", "rejected": "Blue."}
    rc, out, err = build_image_pairs(capsys, images, [bad, bad], tmp_path / "vpairs")
    assert rc == 2 and err == "kiln: error: no pair could be used (2 missing image)\n" and not out
    assert not (tmp_path / "vpairs").exists()
    rc, _, err = build_image_pairs(capsys, images, [bad], tmp_path / "vpairs", "--tokenizer", str(tmp_path))
    assert rc == 2 and err.startswith("kiln: error: --tokenizer with --images") and err.count("\n") == 1
