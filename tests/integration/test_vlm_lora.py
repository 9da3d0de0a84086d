"""finetune=lora on the VLM (DeepSpeed ZeRO-0, one process) from a tiny llava-hf checkpoint: the language model's
adapters and the projector train -- the rest stays model.init_from's bit for bit -- and only they reach the optimizer
and the checkpoints; the export is a PEFT adapter folder that PeftModel loads onto LlavaForConditionalGeneration with
the trained model's logits, export.merge_lora's merged LLaVA is peft's merge_and_unload; scripts/export.py
--merge-lora rebuilds that export from the run's last checkpoint, bit for bit; a resumed run is bitwise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import load_script, run_train
from tests.fixtures import vlm as fx
from tests.fixtures.lora import (
    checkpoint_bytes,
    export_matches_end_of_run,
    fit_and_export,
    resumed_bitwise,
    tensors,
)
from tests.fixtures.lora import (
    vlm_overrides as overrides,
)
from tests.support.launcher import spawn_ranks

pytestmark = pytest.mark.integration
HF_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
ADAPTED = 2 * 7 * 2  # 2 layers x 7 projections x (A, B)


@pytest.fixture(scope="module")
def world(vlm_lora_world):
    return vlm_lora_world  # shared with test_vlm_lora_zero


def probe(folder: Path) -> dict[str, torch.Tensor]:
    """Fixed model inputs: a chat turn with one image."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    image = Image.fromarray(
        (torch.rand(fx.IMAGE_SIZE, fx.IMAGE_SIZE, 3, generator=torch.Generator().manual_seed(0)) * 255)
        .to(torch.uint8)
        .numpy()
    )
    return dict(
        processor(
            text="USER: <image>\nWhat digit is this? ASSISTANT: A handwritten seven.",
            images=[image],
            return_tensors="pt",
        )
    )


def _train_and_export(world: dict, run_dir: str, out: str) -> dict:
    """The trainer in process: what its optimizer holds, 4 steps, the export; whether the frozen base is still
    model.init_from's bit for bit; the trained model's logits on `probe` (saved to ``out``)."""
    from transformers import LlavaForConditionalGeneration

    from common.lora import base_key, is_adapter_key
    from recipes.vlm.train import VLMTrainer

    argv = overrides(
        {k: Path(v) for k, v in world.items()}, Path(run_dir), "trainer.max_steps=4", "export.merge_lora=true"
    )
    trainer, optimized = fit_and_export(VLMTrainer, argv, Path(run_dir))
    model = trainer.model.eval()
    source = LlavaForConditionalGeneration.from_pretrained(world["base"], dtype=torch.float32).state_dict()
    frozen = {
        base_key(k): v
        for k, v in model.state_dict().items()
        if not is_adapter_key(k) and "multi_modal_projector" not in k
    }
    with torch.no_grad():
        logits = model(**probe(Path(world["base"]))).logits
    torch.save(logits, out)
    return {
        "optimized": optimized,
        "frozen_keys_match": frozen.keys() == {k for k in source if "multi_modal" not in k},
        "frozen_unchanged": all(torch.equal(v, source[k]) for k, v in frozen.items()),
    }


@pytest.fixture(scope="module")
def lora_run(world, tmp_path_factory) -> dict:
    """A 4-step LoRA run with export.merge_lora (its last checkpoint: step 4), trained and exported in a child
    process (`_train_and_export`): its run dir, what the trainer reported, the path of its logits."""
    root = tmp_path_factory.mktemp("vlm_lora_run")
    run_dir, saved = root / "run", root / "kiln_logits.pt"
    result = spawn_ranks(
        _train_and_export, ({k: str(v) for k, v in world.items()}, str(run_dir), str(saved)), 1, root, threads=2
    )[0]
    return {"run_dir": run_dir, "saved": saved, "base": world["base"], **result}


def test_adapter_and_projector_train_alone_and_export_for_peft(world, lora_run):
    from peft import PeftModel
    from transformers import LlavaForConditionalGeneration

    run_dir, saved, result = lora_run["run_dir"], lora_run["saved"], lora_run
    projector = [n for n in result["optimized"] if "multi_modal_projector" in n]
    assert len(projector) == 4 and len(result["optimized"]) == ADAPTED + 4
    assert all(".lora_A." in n or ".lora_B." in n for n in result["optimized"] if n not in projector)
    assert all("language_model" in n for n in result["optimized"] if n not in projector)  # not the tower's q_proj
    assert result["frozen_keys_match"] and result["frozen_unchanged"]

    export = run_dir / "export"
    config = json.loads((export / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(world["base"]) and config["modules_to_save"] == [
        "multi_modal_projector"
    ]
    assert (export / "tokenizer.json").exists() and (export / "processor_config.json").exists()
    assert len(tensors(export)) == ADAPTED + 4

    kiln = torch.load(saved)
    inputs = probe(world["base"])
    base = LlavaForConditionalGeneration.from_pretrained(world["base"], dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(**inputs).logits
        peft_model = PeftModel.from_pretrained(base, export).eval()
        peft_logits = peft_model(**inputs).logits
    error, changed = (peft_logits - kiln).abs().max().item(), (base_logits - kiln).abs().max().item()
    print(f"max |PeftModel - Kiln| logits = {error:.2e}; training moved them by up to {changed:.2e}")
    assert error <= 1e-5 and changed > 1e-3

    merged = peft_model.merge_and_unload().state_dict()
    ours = LlavaForConditionalGeneration.from_pretrained(export / "merged", dtype=torch.float32).eval()
    merge_error = max((ours.state_dict()[k] - merged[k]).abs().max().item() for k in merged)
    with torch.no_grad():
        merged_error = (ours(**inputs).logits - kiln).abs().max().item()
    print(f"max |merged - peft merge_and_unload| = {merge_error:.2e}; logits {merged_error:.2e}")
    assert ours.state_dict().keys() == merged.keys() and merge_error <= 1e-6 and merged_error <= 1e-5


def test_export_py_rebuilds_the_export_from_the_last_checkpoint(lora_run, tmp_path, capsys):
    """A preempted run's adapter comes out of its checkpoints: scripts/export.py --merge-lora on the last one (step 4)
    writes the end of the run's export -- adapter, projector and processor on model.init_from, and the merged LLaVA --
    file for file, every tensor bit for bit. A base whose files changed since the run stops it with one line."""
    run_dir, again = lora_run["run_dir"], tmp_path / "again"
    export_matches_end_of_run(run_dir, again, capsys)
    assert (again / "merged" / "model.safetensors").exists()

    # A base that changed since the run: one line, nothing written. Overwritten in place by a fine-tune of itself
    # (every tensor moved a little: the same names, dtypes and shapes), or given one more tensor.
    from safetensors.torch import load_file, save_file

    moved, base = tmp_path / "moved", tmp_path / "base"
    shutil.copytree(run_dir, moved, ignore=shutil.ignore_patterns("export"))
    shutil.copytree(lora_run["base"], base)
    weights = next(base.glob("*.safetensors"))
    original = load_file(weights)
    cfg = OmegaConf.load(run_dir / "config.yaml")
    cfg.model.init_from = str(base)
    OmegaConf.save(cfg, moved / "config.yaml")
    for changed in (
        {k: v + 1e-3 * torch.randn_like(v) if v.is_floating_point() else v for k, v in original.items()},
        original | {"extra": torch.zeros(1)},
    ):
        save_file(changed, weights, metadata={"format": "pt"})
        assert load_script("export").main([str(moved), "--merge-lora", "--out", str(tmp_path / "never")]) == 2
        err = capsys.readouterr().err
        assert f"model.init_from={base} holds other weights than the base the adapter" in err, err
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / "never").exists()


def test_checkpoints_hold_what_trains_and_resume_bitwise(world, tmp_path):
    """Steps 4-6 of a run resumed from step 3 are bit for bit the uninterrupted run's; its checkpoint holds the adapter,
    the projector and their Adam state: about 3x their bytes, a fraction of a full fine-tune's checkpoint."""
    first, resumed, full = tmp_path / "first", tmp_path / "resumed", tmp_path / "full"
    ckpt = resumed_bitwise(lambda run_dir, *extra: overrides(world, run_dir, *extra), first, resumed)

    trained = sum(v.numel() * v.element_size() for v in tensors(first / "export").values())
    lora_bytes = checkpoint_bytes(ckpt)
    run_train(overrides(world, full, "finetune=full", "trainer.max_steps=1"))
    full_bytes = checkpoint_bytes(full / "checkpoints" / "step_0000001")
    print(
        f"checkpoint bytes: LoRA {lora_bytes:,} (adapter + projector {trained:,}), full fine-tune {full_bytes:,} "
        f"({lora_bytes / full_bytes:.3f}x)"
    )
    assert 3 * trained <= lora_bytes <= 3 * trained + 200_000 and lora_bytes < 0.5 * full_bytes
