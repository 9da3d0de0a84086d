"""scripts/export.py on DiT and VLM runs (DeepSpeed on 2 gloo ranks): from the final checkpoint it writes the
run's own end-of-run export tensor for tensor (EMA weights under ZeRO-3 in bf16 with a shared embedding, a latent
DiT under ZeRO-2, a VLM under ZeRO-2, and under ZeRO-3 in bf16 with selective activation checkpointing and its frozen
tower partitioned), sharded when asked, loadable by diffusers and transformers; from an earlier checkpoint that step's
weights; one line (exit 2) for what is not a checkpoint of the run, --merge-lora on a full run, or a LoRA run whose
base is gone; and nothing left behind by an export that fails.
(LoRA runs' exports: tests/integration/test_dit_lora.py, test_vlm_lora.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import FAST_DIT, REPO, load_script, run_train
from tests.fixtures.llm import compare_export, tensors
from tests.fixtures.runs import VLM_ZERO2

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runs(tmp_path_factory, trained, latent_dit_data):
    root = tmp_path_factory.mktemp("export_any")
    quick = ["trainer.eval=false", "trainer.micro_batch_size=8", "data.num_workers=1", "diffusion.samples_per_class=1"]
    out = {name: root / name for name in ("dit3", "dit2_latent", "vlm2", "vlm3")}
    run_train(
        [
            *FAST_DIT,
            *quick,
            f"run.dir={out['dit3']}",
            "parallel.zero_stage=3",
            "toggles.precision=bf16",
            "model.shared_conditioning=true",
            "trainer.max_steps=3",
            "checkpoint.every=2",
        ],
        nproc=2,
    )
    vae, shards = latent_dit_data(16).values()  # shared with test_dit_vae_zero3
    run_train(
        [
            *FAST_DIT,
            *quick,
            f"run.dir={out['dit2_latent']}",
            "parallel.zero_stage=2",
            "data=images",
            f"data.root={shards}",
            "data.image_size=16",
            f"diffusion.vae={vae}",
            "trainer.max_steps=2",
        ],
        nproc=2,
    )
    vlm = [
        "recipe=vlm_tiny",
        "trainer.max_steps=2",
        "trainer.micro_batch_size=8",
        "trainer.progress_bar=false",
        "trainer.eval=false",
        "data.num_workers=1",
    ]
    out["vlm2"] = trained(VLM_ZERO2, 2)  # test_vlm_zero2's run
    # ZeRO-3 partitions the frozen tower too (DeepSpeed's frozen_param_fragments, per rank); under activation
    # checkpointing DeepSpeed records the blocks' parameters (trained and frozen) under the wrapper's prefix.
    run_train(
        [
            *vlm,
            f"run.dir={out['vlm3']}",
            "parallel.zero_stage=3",
            "toggles.precision=bf16",
            "toggles.activation_checkpointing=selective",
        ],
        nproc=2,
    )
    return out


def export(capsys, *argv: str) -> tuple[int, str]:
    code = load_script("export").main([str(a) for a in argv])
    return code, capsys.readouterr().err


def assert_same_folder(ours, theirs, *, subfolders=("",)) -> None:
    for sub in subfolders:
        assert compare_export(theirs / sub, ours / sub) == {"same_keys": True, "bitwise": True}, sub


def test_dit_zero3_bf16_equals_the_end_of_run_export(runs, tmp_path, capsys):
    run = runs["dit3"]
    code, err = export(capsys, run, "--out", tmp_path / "final", "--max-shard-size", "100KB")
    assert code == 0, err
    ours, theirs = tmp_path / "final", run / "export"
    shards = sorted((ours / "transformer").glob("*.safetensors"))
    assert len(shards) > 3 and (ours / "transformer" / "diffusion_pytorch_model.safetensors.index.json").exists()
    assert_same_folder(ours, theirs, subfolders=("transformer",))
    weights = tensors(ours / "transformer")
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
    # The shared embedding is written under every block, as diffusers' layout wants it.
    assert "transformer_blocks.3.norm1.emb.class_embedder.embedding_table.weight" in weights
    for name in ("transformer/config.json", "kiln.json", "scheduler/scheduler_config.json"):
        assert json.loads((ours / name).read_text()) == json.loads((theirs / name).read_text()), name
    from diffusers import DiTTransformer2DModel

    loaded = DiTTransformer2DModel.from_pretrained(ours / "transformer", torch_dtype=torch.bfloat16)
    assert all(torch.equal(v, weights[k]) for k, v in loaded.state_dict().items())

    # An earlier checkpoint: that step's (EMA) weights.
    code, err = export(capsys, run, "--checkpoint", "step_2", "--out", tmp_path / "step2")
    assert code == 0, err
    assert json.loads((tmp_path / "step2" / "kiln.json").read_text())["step"] == 2
    earlier = tensors(tmp_path / "step2" / "transformer")
    assert earlier.keys() == weights.keys() and not all(torch.equal(earlier[k], weights[k]) for k in weights)
    # Without --out: beside the end-of-run export, in exports/step_2; the export itself stays step 3's.
    code, err = export(capsys, run, "--checkpoint", "step_2")
    assert code == 0, err
    beside = run / "exports" / "step_2"
    assert_same_folder(beside, tmp_path / "step2", subfolders=("transformer",))
    assert json.loads((theirs / "kiln.json").read_text())["step"] == 3
    assert compare_export(ours / "transformer", theirs / "transformer") == {"same_keys": True, "bitwise": True}
    code, err = export(capsys, run, "--checkpoint", "step_2")  # nor is the step_2 export replaced unasked
    assert code == 2 and f"{beside} exists" in err and "--out DIR" in err and len(err.strip().splitlines()) == 1
    shutil.rmtree(beside.parent)  # the run stays as trained for the module's other tests


def test_latent_dit_zero2_loads_in_dit_pipeline(runs, tmp_path, capsys):
    run = runs["dit2_latent"]
    code, err = export(capsys, run, "--out", tmp_path / "out")
    assert code == 0, err
    ours, theirs = tmp_path / "out", run / "export"
    assert_same_folder(ours, theirs, subfolders=("transformer", "vae"))
    assert json.loads((ours / "model_index.json").read_text()) == json.loads((theirs / "model_index.json").read_text())
    from diffusers import DiTPipeline

    pipe = DiTPipeline.from_pretrained(ours)
    assert pipe.transformer.config.in_channels == 4 and pipe.vae is not None


@pytest.mark.parametrize("name", ["vlm2", "vlm3"])
def test_vlm_equals_the_end_of_run_export(runs, name, tmp_path, capsys, monkeypatch):
    run = runs[name]
    code, err = export(capsys, run, "--out", tmp_path / "out")
    assert code == 0, err
    ours, theirs = tmp_path / "out", run / "export"
    assert_same_folder(ours, theirs)
    for name in (
        "config.json",
        "generation_config.json",
        "processor_config.json",
        "preprocessor_config.json",
        "tokenizer.json",
    ):
        assert json.loads((ours / name).read_text()) == json.loads((theirs / name).read_text()), name
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(ours)
    reference = LlavaForConditionalGeneration.from_pretrained(theirs)
    ids = torch.tensor([[1, 5, 7, 9]])
    assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_a_failed_export_leaves_nothing_behind(runs, tmp_path, capsys, monkeypatch):
    """An export that fails midway (its second safetensors shard cannot be written) removes what it wrote: its temp
    folder (exports/.step_3.tmp) and the exports/ folder it made. The run is as it was."""
    import safetensors.torch

    run = tmp_path / "dit3"
    shutil.copytree(runs["dit3"], run)
    before = set(run.rglob("*"))
    real, calls = safetensors.torch.save_file, []

    def save_file(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    with pytest.raises(OSError, match="No space left on device"):
        export(capsys, run, "--max-shard-size", "100KB")
    assert calls[0].parent == run / "exports" / ".step_3.tmp" / "transformer"  # one shard was written
    assert sorted(set(run.rglob("*")) ^ before) == []


def test_refusals_are_one_line(runs, tmp_path, capsys):
    dit, vlm = runs["dit3"], runs["vlm2"]
    code, err = export(capsys, dit, "--checkpoint", dit / "samples")
    assert code == 2 and "is not a checkpoint" in err and len(err.strip().splitlines()) == 1
    latest = dit / "checkpoints" / (dit / "checkpoints" / "latest").read_text().strip()
    code, err = export(capsys, vlm, "--checkpoint", latest)
    assert code == 2 and "checkpoint of recipe dit_tiny" in err and len(err.strip().splitlines()) == 1
    code, err = export(capsys, dit, "--max-shard-size", "lots")
    assert code == 2 and "--max-shard-size lots: not a size" in err and len(err.strip().splitlines()) == 1
    # A ZeRO-3 checkpoint that lost a rank's optimizer file.
    broken = tmp_path / "broken"
    shutil.copytree(dit, broken, ignore=shutil.ignore_patterns("*zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    code, err = export(capsys, broken)
    assert code == 2 and "incomplete DeepSpeed checkpoint" in err and len(err.strip().splitlines()) == 1
    # The TrainState file (the EMA) cut short.
    cut = tmp_path / "cut"
    shutil.copytree(dit, cut)
    state = cut / "checkpoints" / latest.name / "trainer.pt"
    state.write_bytes(state.read_bytes()[:1000])
    code, err = export(capsys, cut)
    assert code == 2 and "trainer.pt is unreadable" in err and len(err.strip().splitlines()) == 1
    assert (cut / "export" / "kiln.json").exists() and not list(cut.rglob("*.tmp"))  # nothing lost, nothing left
    # --merge-lora on a full run; a LoRA run whose base (model.init_from) is gone: its checkpoints hold the adapter
    # only.
    code, err = export(capsys, vlm, "--merge-lora")
    assert code == 2 and "--merge-lora is for finetune=lora runs" in err and len(err.strip().splitlines()) == 1
    lora = tmp_path / "lora"
    shutil.copytree(vlm, lora)
    cfg = OmegaConf.load(vlm / "config.yaml")
    cfg.finetune, cfg.model.init_from = "lora", str(tmp_path / "moved")
    OmegaConf.save(cfg, lora / "config.yaml")
    code, err = export(capsys, lora)
    assert code == 2 and f"model.init_from={tmp_path / 'moved'}, which is gone" in err
    assert len(err.strip().splitlines()) == 1
    # As a user runs it: exit 2, one line, no traceback, nothing written.
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "export.py"),
            str(vlm),
            "--checkpoint",
            str(latest),
            "--out",
            str(tmp_path / "never"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and not (tmp_path / "never").exists()
