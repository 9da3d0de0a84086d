"""finetune=lora on the DiT (DeepSpeed ZeRO-0, one process), on the export of a latent DDPM dit_tiny run (a diffusers
DiTPipeline folder): the blocks' attention and feed-forward adapters train alone -- the base stays model.init_from's
bit for bit -- and only they reach the optimizer and the checkpoints; DiTPipeline with the exported adapter (peft,
on its transformer) samples Kiln's images for the same seed; export.merge_lora's transformer is peft's
merge_and_unload; scripts/export.py --merge-lora rebuilds that export from the run's last checkpoint, bit for bit;
a resumed run is bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.fixtures.lora import (
    DIT_ADAPTED,
    DIT_SAMPLER_STEPS,
    checkpoint_bytes,
    export_matches_end_of_run,
    fit_and_export,
    resumed_bitwise,
    tensors,
)
from tests.fixtures.lora import (
    dit_overrides as overrides,
)
from tests.support.launcher import spawn_ranks

pytestmark = pytest.mark.integration
STEPS = DIT_SAMPLER_STEPS
ADAPTED = DIT_ADAPTED


@pytest.fixture(scope="module")
def world(dit_lora_world):
    return dit_lora_world  # shared with test_dit_lora_zero3


def _train_and_export(world: dict, run_dir: str, out: str) -> dict:
    """The trainer in process: what its optimizer holds, 4 steps, the export; whether the base is still
    model.init_from's bit for bit; Kiln's sampler's images (EMA weights, seed 7) saved to ``out``."""
    from common.lora import base_key, is_adapter_key
    from recipes.dit.train import DiTTrainer

    argv = overrides(
        {k: Path(v) for k, v in world.items()}, Path(run_dir), "trainer.max_steps=4", "export.merge_lora=true"
    )
    trainer, optimized = fit_and_export(DiTTrainer, argv, Path(run_dir))
    source = tensors(Path(world["base_run"]) / "export" / "transformer")
    frozen = {base_key(k): v for k, v in trainer.model.state_dict().items() if not is_adapter_key(k)}
    torch.save(trainer.generate(torch.tensor([0, 1, 2]), torch.Generator().manual_seed(7)), out)
    return {
        "optimized": optimized,
        "frozen_keys_match": frozen.keys() == source.keys(),
        "frozen_unchanged": all(torch.equal(v, source[k]) for k, v in frozen.items()),
    }


@pytest.fixture(scope="module")
def lora_run(world, tmp_path_factory) -> dict:
    """A 4-step LoRA run with export.merge_lora (its last checkpoint: step 4), trained and exported in a child
    process (`_train_and_export`): its run dir, what the trainer reported, the path of Kiln's images."""
    root = tmp_path_factory.mktemp("dit_lora_run")
    run_dir, saved = root / "run", root / "kiln_images.pt"
    result = spawn_ranks(
        _train_and_export, ({k: str(v) for k, v in world.items()}, str(run_dir), str(saved)), 1, root, threads=2
    )[0]
    return {"run_dir": run_dir, "saved": saved, **result}


def test_adapter_trains_alone_and_dit_pipeline_samples_kilns_images(world, lora_run):
    from diffusers import DiTPipeline
    from peft import PeftModel

    run_dir, saved, result = lora_run["run_dir"], lora_run["saved"], lora_run
    assert len(result["optimized"]) == ADAPTED and all(".lora_" in n for n in result["optimized"])
    assert result["frozen_keys_match"] and result["frozen_unchanged"]

    export, base = run_dir / "export", world["base_run"] / "export"
    config = json.loads((export / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base / "transformer") and config["peft_type"] == "LORA"
    assert set(config["target_modules"]) == {"to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"}
    assert len(tensors(export)) == ADAPTED

    def pipeline_images(pipe):
        out = pipe(
            class_labels=[0, 1, 2],
            guidance_scale=1.0,
            num_inference_steps=STEPS,
            output_type="np",
            generator=torch.Generator().manual_seed(7),
        ).images
        return out * 2 - 1  # [0, 1] -> Kiln's [-1, 1]

    pipe = DiTPipeline.from_pretrained(base)
    before = pipeline_images(pipe)
    adapted = PeftModel.from_pretrained(pipe.transformer, export)  # adapts pipe.transformer in place
    got = pipeline_images(pipe)
    kiln = torch.load(saved).permute(0, 2, 3, 1).numpy()
    error, moved = np.abs(got - kiln).max(), np.abs(before - kiln).max()
    print(
        f"max |DiTPipeline + adapter - Kiln's sampler| = {error:.2e} (pixels in [-1, 1]); the adapter moved them "
        f"by up to {moved:.2e}"
    )
    assert error <= 1e-4 and moved > 1e-3

    merged = adapted.merge_and_unload().state_dict()
    ours = tensors(export / "merged" / "transformer")
    merge_error = max((ours[k] - merged[k]).abs().max().item() for k in merged)
    print(f"max |merged - peft merge_and_unload| = {merge_error:.2e}")
    assert ours.keys() == merged.keys() and merge_error <= 1e-6
    assert json.loads((export / "merged" / "kiln.json").read_text())["diffusers_pipeline"] == "DiTPipeline"


def test_export_py_rebuilds_the_export_from_the_last_checkpoint(lora_run, tmp_path, capsys):
    """A preempted run's adapter comes out of its checkpoints: scripts/export.py --merge-lora on the last one (step 4)
    writes the end of the run's export -- the EMA adapter on model.init_from and the merged pipeline -- file for file,
    every tensor bit for bit."""
    run_dir, again = lora_run["run_dir"], tmp_path / "again"
    export_matches_end_of_run(run_dir, again, capsys)
    assert (again / "merged" / "transformer").is_dir() and (again / "merged" / "vae").is_dir()


def test_checkpoints_hold_the_adapter_and_resume_bitwise(world, tmp_path):
    """Steps 4-6 of a run resumed from step 3 are bit for bit the uninterrupted run's; the checkpoint holds the
    adapter, its Adam state and its EMA: a fraction of a full fine-tune's."""
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    # No falling loss asked of 6 steps: each step's loss is at other random timesteps (0.81, 0.61, 0.65, 0.66, 0.68,
    # 0.85 measured); that the adapter trains is tested on the images above.
    ckpt = resumed_bitwise(lambda run_dir, *extra: overrides(world, run_dir, *extra), first, resumed, loss_falls=False)
    assert all(torch.equal(v, tensors(first / "export")[k]) for k, v in tensors(resumed / "export").items())

    adapter = sum(v.numel() * v.element_size() for v in tensors(first / "export").values())
    lora_bytes = checkpoint_bytes(ckpt)
    # A full run's checkpoint of the same DiT (weights, Adam, EMA): the base run's last one.
    full_bytes = checkpoint_bytes(world["base_run"] / "checkpoints" / "step_0000002")
    print(
        f"checkpoint bytes: LoRA {lora_bytes:,} (adapter {adapter:,}), full run {full_bytes:,} "
        f"({lora_bytes / full_bytes:.3f}x)"
    )
    assert 4 * adapter <= lora_bytes <= 4 * adapter + 200_000 and lora_bytes < 0.5 * full_bytes
