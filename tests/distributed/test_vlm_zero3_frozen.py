"""LLaVA stage 1 under ZeRO-3 on 2 gloo ranks: the frozen tower and LLM, partitioned with the rest, are not
updated (the export holds them bit for bit), and a rank whose micro-batch has no image still runs the same
modules as its peer (the blank-image stand-in), so text-only conversations do not hang the collectives."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from data import prepare_llava
from tests.conftest import losses, run_train
from tests.fixtures import vlm as fx

pytestmark = pytest.mark.distributed


def test_align_under_zero3_keeps_frozen_parts_bit_for_bit(tmp_path):
    raw = fx.write_llava_data(tmp_path / "raw", n_pretrain=8, n_instruct=40)
    clip, llama = fx.write_siglip(tmp_path / "siglip"), fx.write_llama(tmp_path / "llama", tie_word_embeddings=True)
    data = tmp_path / "instruct"
    prepare_llava.build_llava(data, json_path=raw / "llava_instruct.json", images=raw / "images", train_shards=2, val_shards=1)
    run_dir = tmp_path / "run"
    run_train(["recipe=vlm_tiny", "data=llava", f"data.root={data}", "data.num_workers=1", "data.max_seq_len=256",
               "parallel.zero_stage=3", "vlm.stage=align", f"vlm.vision_from={clip}", f"vlm.language_from={llama}",
               "trainer.micro_batch_size=1", "trainer.max_steps=6", "trainer.log_every=1", "trainer.progress_bar=false",
               "trainer.eval=false", "optim.lr=1e-2", "optim.warmup_steps=1", "parallel.timeout_s=120", f"run.dir={run_dir}"],
              nproc=2, timeout=400)
    assert sorted(losses(run_dir)) == list(range(1, 7))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(0 < r["text_only_samples"] < 2 for r in records), "no step had one rank without images"
    out = load_file(run_dir / "export" / "model.safetensors")
    tower, lm = load_file(clip / "model.safetensors"), load_file(llama / "model.safetensors")
    image_id = len(lm["model.embed_tokens.weight"])
    for k, w in tower.items():
        if not k.startswith("head."):  # SigLIP's pooling head is not part of LLaVA's tower
            assert torch.equal(out[f"vision_tower.{k}"], w), k
    for k, w in lm.items():  # tied embeddings: no lm_head.weight in either
        assert torch.equal(out[f"language_model.{k}"][:image_id], w), k
    memory = json.loads((run_dir / "memory.json").read_text())
    assert memory["zero_stage"] == 3 and memory["trainable_params"] == sum(
        v.numel() for k, v in out.items() if k.startswith("multi_modal_projector."))
