"""The VLM's preference path (recipes/vlm/preference.py) against TRL's DPOTrainer on a LLaVA: the same weights, pairs
and images, TRL's padded batch (one sequence per answer, its images beside) against Kiln's documents packed together,
two a pair, through the trainer's own collate and forward; and the pair decoder's labels against the answers' text."""

from __future__ import annotations

import copy
import functools
import io
import json
import types

import numpy as np
import pytest
import torch

from common.data.packing import IGNORE_INDEX
from common.preference import PreferenceConfig
from recipes.vlm.data import collate, encode_conversation
from recipes.vlm.preference import PreferenceTraining, collate_pairs, decode_pair, final_answer

TOL = dict(rtol=1e-5, atol=1e-5)
PROMPTS = ("What digit is this?", "Describe the picture.")
ANSWERS = (("The digit is seven.", "It is 7."), ("Noise.", "A cat on a mat, sleeping."))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from tests.fixtures.vlm import write_llava_hf

    folder = write_llava_hf(tmp_path_factory.mktemp("llava") / "llava")
    processor = AutoProcessor.from_pretrained(folder)
    policy = LlavaForConditionalGeneration.from_pretrained(folder).eval()
    reference = LlavaForConditionalGeneration.from_pretrained(folder).eval()
    torch.manual_seed(2)
    with torch.no_grad():  # a reference apart from the policy: rewards far from 0, accuracy between 0 and 1
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (30, 30, 3), dtype=np.uint8)) for _ in PROMPTS]
    return processor, policy, reference, images


def trl_rows(images) -> list[dict]:
    """The pairs in TRL's conversational vision layout (RLAIF-V's)."""
    return [
        {
            "images": [image],
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
            "chosen": [{"role": "assistant", "content": [{"type": "text", "text": c}]}],
            "rejected": [{"role": "assistant", "content": [{"type": "text", "text": r}]}],
        }
        for image, q, (c, r) in zip(images, PROMPTS, ANSWERS)
    ]


def kiln_documents(batch: dict) -> list[dict]:
    """TRL's padded rows ([chosen..., rejected...]) as Kiln's documents (chosen, rejected per pair): each row's tokens,
    labelled where TRL's completion mask is, with its image."""
    n, docs = len(batch["input_ids"]) // 2, []
    for k in range(n):
        for row in (k, n + k):
            keep = batch["attention_mask"][row].bool()
            ids = batch["input_ids"][row][keep]
            labels = ids.masked_fill(batch["completion_mask"][row][keep] == 0, IGNORE_INDEX)
            docs.append({"input_ids": ids, "labels": labels, "pixel_values": batch["pixel_values"][row]})
    return docs


def kiln_trainer(policy, reference, pref: PreferenceConfig, adapter="LlavaInputs") -> PreferenceTraining:
    """PreferenceTraining on the parts of a VLMTrainer it reads: the architecture's inputs adapter, the policy, the
    reference."""
    from recipes.vlm import inputs as vlm_inputs

    kind = getattr(vlm_inputs, adapter)
    inputs = kind.__new__(kind)  # its model_inputs and labels read the batch only
    tr = types.SimpleNamespace(
        cfg=types.SimpleNamespace(preference=pref),
        lora_base="",
        device=torch.device("cpu"),
        inputs=inputs,
        engine=types.SimpleNamespace(model=policy, module=policy),
        model_inputs=lambda batch: inputs.model_inputs(batch, "sdpa", "cpu", torch.float32),
    )
    return PreferenceTraining(tr, reference=reference)


@pytest.mark.parametrize("packing", [True, False])
def test_vlm_dpo_loss_and_rewards_equal_dpo_trainer(world, tmp_path, packing):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    processor, policy, reference, images = world
    args = DPOConfig(output_dir=str(tmp_path), beta=0.3, report_to=[], use_cpu=True, bf16=False, max_length=None)
    rows = trl_rows(images)
    trainer = DPOTrainer(
        model=policy,
        ref_model=reference,
        args=args,
        train_dataset=Dataset.from_list(rows[:1]),
        processing_class=processor,
    )
    batch = trainer.data_collator(copy.deepcopy(rows))
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode].clear()
    with torch.no_grad():
        want = trainer._compute_loss(trainer.model, batch, return_outputs=False)
    logged = {k: v[-1] for k, v in trainer._metrics[mode].items()}

    pad = processor.tokenizer.pad_token_id
    docs_collate = lambda docs: collate(docs, packing=packing, max_seq_len=256, pad_id=pad)  # noqa: E731
    pairs = [{"docs": kiln_documents(batch)[2 * k : 2 * k + 2], "key": str(k)} for k in range(len(rows))]
    kiln = collate_pairs(pairs, docs_collate)
    assert kiln["pairs"] == 2 and len(kiln["packed"].seq_lens) == (1 if packing else 4)
    training = kiln_trainer(policy, reference, PreferenceConfig(loss="sigmoid", beta=0.3))
    with torch.no_grad():
        losses, metrics = training.forward(kiln)
    torch.testing.assert_close(losses.mean(), want, **TOL)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        assert metrics[name].mean().item() == pytest.approx(logged[name], rel=1e-5, abs=1e-5), name
    assert 0 < logged["rewards/accuracies"] < 1  # one pair each way: the accuracy's test can fail


def test_qwen_vl_dpo_loss_and_rewards_equal_dpo_trainer_on_the_same_tokens(tmp_path):
    """Qwen2.5-VL (mRoPE positions per packed document): Kiln's decoded pairs (its own encoder) packed, against
    DPOTrainer's loss on the same documents padded one a row, chosen rows first (TRL's layout), its positions computed
    by transformers from the padding."""
    from datasets import Dataset
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from data.tiny_qwen_vl import build
    from recipes.vlm import qwen

    folder = build(tmp_path / "qwen", "qwen2.5-vl")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    image_processor = AutoImageProcessor.from_pretrained(folder, min_pixels=56 * 56, max_pixels=112 * 112)
    policy = AutoModelForImageTextToText.from_pretrained(folder).eval()
    reference = AutoModelForImageTextToText.from_pretrained(folder).eval()
    torch.manual_seed(2)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rng = np.random.default_rng(0)
    encode = functools.partial(
        qwen.encode_qwen, tokenizer=tokenizer, image_processor=image_processor, max_seq_len=512, video_config=None
    )
    pairs = []
    for k, (question, (chosen, rejected)) in enumerate(zip(PROMPTS, ANSWERS)):
        image = Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8))
        record = {"id": str(k), "prompt": [{"role": "user", "content": "<image>" + question}], "num_images": 1}
        record |= {"chosen": chosen, "rejected": rejected}
        pairs.append(decode_pair({"json": json.dumps(record), "image0": png(image)}, encode))
    rows = [pair["docs"][side] for side in (0, 1) for pair in pairs]  # TRL's [chosen..., rejected...]
    width = max(len(d["input_ids"]) for d in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    attention, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for r, doc in enumerate(rows):
        n = len(doc["input_ids"])
        ids[r, :n], attention[r, :n], completion[r, :n] = doc["input_ids"], 1, doc["labels"] != IGNORE_INDEX
    pads = tokenizer.convert_tokens_to_ids([qwen.IMAGE_PAD, qwen.VIDEO_PAD])
    batch = {
        "input_ids": ids,
        "attention_mask": attention,
        "completion_mask": completion,
        "pixel_values": torch.cat([d["pixel_values"] for d in rows]),
        "image_grid_thw": torch.cat([d["image_grid_thw"] for d in rows]),
        "mm_token_type_ids": qwen.modality_types(ids, *pads),
    }
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.3, report_to=[], use_cpu=True, bf16=False)
    text = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])  # TRL needs one; the batch is ours
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=text, processing_class=tokenizer)
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode].clear()
    with torch.no_grad():
        want = trainer._compute_loss(trainer.model, batch, return_outputs=False)
    logged = {k: v[-1] for k, v in trainer._metrics[mode].items()}

    docs_collate = functools.partial(
        qwen.collate_qwen,
        rope_index=qwen.rope_index_for(policy.config),
        packing=True,
        max_seq_len=512,
        pad_id=tokenizer.pad_token_id,
        image_pad_id=pads[0],
        video_pad_id=pads[1],
    )
    kiln = collate_pairs(pairs, docs_collate)
    assert len(kiln["batch"].packed.seq_lens) == 1  # all four documents in one row
    training = kiln_trainer(policy, reference, PreferenceConfig(loss="sigmoid", beta=0.3), "QwenInputs")
    with torch.no_grad():
        losses, metrics = training.forward(kiln)
    torch.testing.assert_close(losses.mean(), want, **TOL)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        assert metrics[name].mean().item() == pytest.approx(logged[name], rel=1e-5, abs=1e-5), name
    assert 0 < logged["rewards/accuracies"] < 1


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_pair_decodes_into_two_documents_labelled_on_their_final_answers_only(world):
    """A multi-turn prompt's earlier answer is prompt: each document's labels spell its final answer and nothing
    else; a side over data.max_seq_len drops the pair whole."""
    processor, _, _, images = world
    prompt = [
        {"role": "user", "content": "<image>What is this?"},
        {"role": "assistant", "content": "A digit."},
        {"role": "user", "content": "Which one?"},
    ]
    record = {
        "id": "p0",
        "prompt": prompt,
        "chosen": "Seven.",
        "rejected": "The digit seven, I believe.",
        "num_images": 1,
    }
    sample = {"json": json.dumps(record).encode(), "image0": png(images[0])}
    encode = lambda messages, imgs: encode_conversation(messages, imgs, processor, max_seq_len=256)  # noqa: E731
    pair = decode_pair(sample, encode)
    assert pair["key"] == "p0" and len(pair["docs"]) == 2
    for doc, answer in zip(pair["docs"], (record["chosen"], record["rejected"])):
        labelled = doc["input_ids"][doc["labels"] != IGNORE_INDEX]
        assert processor.tokenizer.decode(labelled).strip() == answer  # llava-hf's template ends a turn without eos
        assert doc["pixel_values"].shape[0] == 1
    short = lambda messages, imgs: encode_conversation(messages, imgs, processor, max_seq_len=40)  # noqa: E731
    assert "skipped" in decode_pair(sample, short)


def test_final_answer_keeps_the_last_labelled_run():
    labels = torch.tensor([-100, 5, 6, -100, -100, 7, 8, 9, -100])
    assert final_answer(labels).tolist() == [-100] * 5 + [7, 8, 9, -100]
    assert final_answer(torch.full((3,), -100)).tolist() == [-100] * 3
