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
    from common.lora import apply_lora
    from recipes.llm.preference import adapters_disabled
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
