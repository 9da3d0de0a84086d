"""LLaVA's frozen parts stay frozen on 2 gloo ranks under every ZeRO stage. Stage 3, the whole recipe: the
frozen tower and LLM, partitioned with the rest, are not updated (the export holds them bit for bit), and a
rank whose micro-batch has no image still runs the same modules as its peer (the blank-image stand-in), so
text-only conversations do not hang the collectives. Stages 0-2, the recipe's engine in-process: after
optimizer steps the tower and LLM are the folders' tensors, only the projector moved and only it is in
the optimizer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.distributed import free_port
from data import prepare_llava
from tests.conftest import losses, metrics, run_train
from tests.fixtures import vlm as fx

pytestmark = pytest.mark.distributed


def _stages_worker(rank: int, world: int, port: int, folder: str) -> None:
    """Each ZeRO stage 0-2: the recipe's align engine (parallelize) over a LLaVA from the parts, 3 steps on
    this rank's own conversation, then what moved and what the optimizer holds."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    from PIL import Image

    from common.distributed import init_distributed, teardown
    from common.engine import DeepSpeedEngine
    from recipes.vlm.data import encode_conversation
    from recipes.vlm.parallelize import parallelize
    from recipes.vlm.weights import weight_source
    from scripts.kiln.launch import compose

    init_distributed()
    result = {}
    try:
        for stage in (0, 1, 2):
            cfg = compose(
                [
                    "recipe=vlm_tiny",
                    "vlm.stage=align",
                    f"vlm.vision_from={folder}/clip",
                    f"vlm.language_from={folder}/llama",
                    f"parallel.zero_stage={stage}",
                    "trainer.micro_batch_size=1",
                    "optim.lr=1e-2",
                    "optim.warmup_steps=0",
                ]
            )
            source = weight_source(cfg)
            processor = source.processor()
            torch.manual_seed(0)
            model = source.load("sdpa")
            projector = {k: v.clone() for k, v in model.model.multi_modal_projector.state_dict().items()}
            engine = DeepSpeedEngine(parallelize(model, cfg), cfg, world).ds
            image = Image.fromarray(fx._digits()[0][rank], mode="L").convert("RGB")
            enc = encode_conversation(
                [
                    {"role": "user", "content": "<image>\nWhat digit is this?"},
                    {"role": "assistant", "content": fx.NUMBER_WORDS[rank].capitalize() + "."},
                ],
                [image],
                processor,
            )
            for _ in range(3):
                loss = engine(
                    input_ids=enc["input_ids"][None], labels=enc["labels"][None], pixel_values=enc["pixel_values"]
                ).loss
                engine.backward(loss)
                engine.step()
            state = engine.module.state_dict()
            tower, lm = load_file(f"{folder}/clip/model.safetensors"), load_file(f"{folder}/llama/model.safetensors")
            old = len(lm["model.embed_tokens.weight"])
            inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
            result[stage] = {
                "tower_same": all(torch.equal(state[f"model.vision_tower.{k}"], w) for k, w in tower.items()),
                "lm_same": all(
                    torch.equal(
                        state[
                            "lm_head.weight"
                            if k == "lm_head.weight"
                            else k.replace("model.", "model.language_model.", 1)
                        ][:old],
                        w,
                    )
                    for k, w in lm.items()
                ),
                "projector_moved": all(
                    not torch.equal(state[f"model.multi_modal_projector.{k}"], v) for k, v in projector.items()
                ),
                "trainable": sum(p.numel() for p in engine.module.parameters() if p.requires_grad),
                "projector": sum(v.numel() for v in projector.values()),
                "optimizer_numel": sum(p.numel() for g in inner.param_groups for p in g["params"]),
            }
            engine.destroy()
    finally:
        teardown()
    Path(folder, f"{rank}.json").write_text(json.dumps(result))


def test_frozen_parts_stay_bit_for_bit_under_zero_0_1_2(tmp_path):
    fx.write_clip(tmp_path / "clip")
    fx.write_llama(tmp_path / "llama")
    torch.multiprocessing.spawn(_stages_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        for stage, r in result.items():
            assert r["tower_same"] and r["lm_same"] and r["projector_moved"], (rank, stage, r)
            assert r["trainable"] == r["projector"]
            # The optimizer holds the projector: whole at stage 0, half of its flat fp32 copy per rank at 1-2.
            assert r["optimizer_numel"] == (r["projector"] if stage == "0" else (r["projector"] + 1) // 2), (
                rank,
                stage,
                r,
            )


def test_align_under_zero3_keeps_frozen_parts_bit_for_bit(tmp_path):
    raw = fx.write_llava_data(tmp_path / "raw", n_pretrain=8, n_instruct=40)
    clip, llama = fx.write_siglip(tmp_path / "siglip"), fx.write_llama(tmp_path / "llama", tie_word_embeddings=True)
    data = tmp_path / "instruct"
    prepare_llava.build_llava(
        data, json_path=raw / "llava_instruct.json", images=raw / "images", train_shards=2, val_shards=1
    )
    run_dir = tmp_path / "run"
    run_train(
        [
            "recipe=vlm_tiny",
            "data=llava",
            f"data.root={data}",
            "data.num_workers=1",
            "data.max_seq_len=256",
            "parallel.zero_stage=3",
            "vlm.stage=align",
            f"vlm.vision_from={clip}",
            f"vlm.language_from={llama}",
            "trainer.micro_batch_size=1",
            "trainer.max_steps=6",
            "trainer.log_every=1",
            "trainer.progress_bar=false",
            "trainer.eval=false",
            "optim.lr=1e-2",
            "optim.warmup_steps=1",
            "parallel.timeout_s=120",
            f"run.dir={run_dir}",
        ],
        nproc=2,
        timeout=400,
    )
    assert sorted(losses(run_dir)) == list(range(1, 7))
    records = metrics(run_dir).values()
    assert any(0 < r["text_only_samples"] < 2 for r in records), "no step had one rank without images"
    out = load_file(run_dir / "export" / "model.safetensors")
    tower, lm = load_file(clip / "model.safetensors"), load_file(llama / "model.safetensors")
    image_id = len(lm["model.embed_tokens.weight"])
    for k, w in tower.items():
        if not k.startswith("head."):  # SigLIP's pooling head is not part of LLaVA's tower
            assert torch.equal(out[f"vision_tower.vision_model.{k}"], w), k
    for k, w in lm.items():  # tied embeddings: no lm_head.weight in either
        assert torch.equal(out[f"language_model.{k}"][:image_id], w), k
    memory = json.loads((run_dir / "memory.json").read_text())
    assert memory["zero_stage"] == 3 and memory["trainable_params"] == sum(
        v.numel() for k, v in out.items() if k.startswith("multi_modal_projector.")
    )
