"""LLaVA as it is really trained, end to end on CPU with tiny offline parts: align from a CLIP folder + a Llama
folder leaves both bit for bit in the export; finetune from that run moves the LLM, not the tower; a
llava-hf release continues training with the same per-step losses packed or padded (1e-5)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoProcessor, LlavaForConditionalGeneration

from data import prepare_llava
from tests.conftest import losses, metrics, run_train
from tests.fixtures import vlm as fx

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Parts folders and the two LLaVA datasets (pretrain: captions; instruct: multi-turn + text-only)."""
    root = tmp_path_factory.mktemp("llava_world")
    raw = fx.write_llava_data(root / "raw", n_pretrain=64, n_instruct=64)
    out = {
        "clip": fx.write_clip(root / "clip"),
        "llama": fx.write_llama(root / "llama", chat_template=True),
        "llava_hf": fx.write_llava_hf(root / "llava_hf"),
    }
    for name in ("llava_pretrain", "llava_instruct"):
        out[name] = root / name
        prepare_llava.build_llava(
            out[name],
            json_path=raw / f"{name}.json",
            images=raw / "images",
            train_shards=2,
            val_shards=1,
            val_fraction=0.05,
        )
    return out


def fast(world, data: str, run_dir, *extra: str) -> list[str]:
    return [
        "recipe=vlm_tiny",
        "data=llava",
        f"data.root={world[data]}",
        "data.num_workers=1",
        "data.max_seq_len=256",
        "trainer.micro_batch_size=8",
        "trainer.log_every=1",
        "trainer.progress_bar=false",
        "vlm.eval_samples=4",
        "vlm.max_new_tokens=4",
        "optim.warmup_steps=1",
        f"run.dir={run_dir}",
        *extra,
    ]


def exported(run_dir) -> dict[str, torch.Tensor]:
    """The export's tensors, by the names llava-hf checkpoints use (the export writes that layout):
    vision_tower.vision_model.*, multi_modal_projector.*, language_model.model.*, language_model.lm_head.*."""
    return load_file(run_dir / "export" / "model.safetensors")


@pytest.fixture(scope="module")
def align_then_finetune(world, tmp_path_factory):
    align, finetune = tmp_path_factory.mktemp("align"), tmp_path_factory.mktemp("finetune")
    run_train(
        fast(
            world,
            "llava_pretrain",
            align,
            "vlm.stage=align",
            f"vlm.vision_from={world['clip']}",
            f"vlm.language_from={world['llama']}",
            "trainer.max_steps=4",
            "optim.lr=1e-2",
        )
    )
    run_train(fast(world, "llava_instruct", finetune, f"model.init_from={align}", "trainer.max_steps=3"))
    return align, finetune


def test_align_leaves_tower_and_llm_bit_for_bit(world, align_then_finetune):
    align, _ = align_then_finetune
    out = exported(align)
    tower, lm = load_file(world["clip"] / "model.safetensors"), load_file(world["llama"] / "model.safetensors")
    image_id = len(lm["model.embed_tokens.weight"])  # <image> was added after the LLM's vocabulary
    for k, w in tower.items():
        assert torch.equal(out[f"vision_tower.vision_model.{k}"], w), k
    for k, w in lm.items():
        assert torch.equal(out[f"language_model.{k}"][:image_id], w), k
    assert torch.equal(
        out["language_model.model.embed_tokens.weight"][image_id], lm["model.embed_tokens.weight"].mean(0)
    )
    assert set(out) == {f"vision_tower.vision_model.{k}" for k in tower} | {f"language_model.{k}" for k in lm} | {
        f"multi_modal_projector.linear_{i}.{p}" for i in (1, 2) for p in ("weight", "bias")
    }
    assert losses(align)[4] < losses(align)[1]  # the projector alone learns
    config = json.loads((align / "export" / "config.json").read_text())
    assert config["image_token_index"] == image_id and config["vision_feature_layer"] == -2
    assert config["vision_feature_select_strategy"] == "default"


def test_finetune_moves_the_llm_not_the_tower(align_then_finetune):
    align, finetune = align_then_finetune
    before, after = exported(align), exported(finetune)
    tower = [k for k in after if k.startswith("vision_tower.")]
    assert tower and all(torch.equal(after[k], before[k]) for k in tower)
    lm = [k for k in after if k.startswith("language_model.")]
    assert all(not torch.equal(after[k], before[k]) for k in lm if "layers" in k and k.endswith("proj.weight"))
    records = metrics(finetune).values()
    assert sum(r["text_only_samples"] for r in records) > 0  # the instruct mix's text-only conversations trained too
    assert json.loads((finetune / "eval.json").read_text())["val_tokens"] > 0


def test_export_loads_offline_for_serving(align_then_finetune, monkeypatch):
    _, finetune = align_then_finetune
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    export = finetune / "export"
    for name in (
        "config.json",
        "model.safetensors",
        "processor_config.json",
        "preprocessor_config.json",
        "tokenizer.json",
        "chat_template.jinja",
    ):
        assert (export / name).exists(), name
    processor, model = AutoProcessor.from_pretrained(export), LlavaForConditionalGeneration.from_pretrained(export)
    assert processor.image_token_id == model.config.image_token_id and processor.chat_template
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": "<image>\nWhat digit is this?"}], add_generation_prompt=True, tokenize=False
    )
    from PIL import Image

    inputs = processor(text=prompt, images=[Image.new("RGB", (8, 8))], return_tensors="pt", add_special_tokens=False)
    assert model.generate(**inputs, max_new_tokens=3, do_sample=False).shape[1] > inputs["input_ids"].shape[1]


def test_llava_hf_continues_and_packing_changes_speed_not_math(world, tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    common = [
        "trainer.max_steps=5",
        "trainer.eval=false",
        "checkpoint.final=false",
        "optim.lr=2e-3",
        f"model.init_from={world['llava_hf']}",
    ]
    run_train(fast(world, "llava_instruct", on, *common, "data.packing=true"))
    run_train(fast(world, "llava_instruct", off, *common, "data.packing=false"))
    packed, padded = losses(on), losses(off)
    assert sorted(packed) == list(range(1, 6)) and packed[5] < packed[1]
    for step in packed:
        assert packed[step] == pytest.approx(padded[step], rel=1e-5, abs=0), step
