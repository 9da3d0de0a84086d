"""finetune=lora on the LLM, one process, on a tiny Llama checkpoint (tied embeddings, llama3 RoPE, fp32): only the
adapter trains -- the base stays model.init_from's bit for bit -- and only the adapter reaches the optimizer and the
checkpoints; the export is a PEFT adapter folder that PeftModel loads onto LlamaForCausalLM with the trained model's
logits, export.merge_lora's merged model is peft's merge_and_unload; a resumed run continues bit for bit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, losses, run_train
from tests.fixtures.llm import write_llama_folder, write_token_dataset
from tests.support.launcher import run_python, spawn_ranks

pytestmark = pytest.mark.integration
HF_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = write_llama_folder(root / "tied", "tied")
    return {"base": model, "data": write_token_dataset(root / "data", model)}


def overrides(folders: dict, run_dir: Path, *extra: str) -> list[str]:
    return [
        "recipe=llm_tiny",
        "finetune=lora",
        f"model.init_from={folders['base']}",
        f"data.root={folders['data']}",
        "data.build=[]",
        "data.num_workers=0",
        "data.max_seq_len=64",
        "trainer.micro_batch_size=4",
        "trainer.progress_bar=false",
        "trainer.log_every=1",
        "optim.lr=1e-2",
        "optim.warmup_steps=0",
        f"run.dir={run_dir}",
        *extra,
    ]


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def dcp_contents(ckpt: Path) -> tuple[list[str], int, int]:
    """A DCP checkpoint's model keys, the bytes of its tensors (weights and optimizer state) and of its files."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    items = dcp.FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata
    tensor_bytes = sum(
        m.size.numel() * m.properties.dtype.itemsize for m in items.values() if isinstance(m, TensorStorageMetadata)
    )
    return (
        [k for k in items if k.startswith("model.")],
        tensor_bytes,
        sum(f.stat().st_size for f in (ckpt / "dcp").iterdir()),
    )


def _train_and_export(folders: dict, run_dir: str, out: str) -> dict:
    """The recipe's trainer, in process: what its optimizer holds, 4 steps, the export; then whether the base is
    still model.init_from's bit for bit, and the trained model's logits on fixed tokens (saved to ``out``)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from common.distributed import init_distributed
    from common.lora import base_key, is_adapter_key
    from recipes.llm.hf_adapter import to_hf_state_dict
    from recipes.llm.train import LLMTrainer
    from scripts.kiln.launch import compose

    cfg = compose(overrides(folders, Path(run_dir), "trainer.max_steps=4", "export.merge_lora=true"))
    trainer = LLMTrainer(cfg, init_distributed(), Path(run_dir))
    in_optimizer = {id(p) for group in trainer.engine.optimizer.param_groups for p in group["params"]}
    optimized = sorted(name for name, p in trainer.model.named_parameters() if id(p) in in_optimizer)
    trainer.fit()
    trainer.export()
    model = trainer.model.eval()
    state = get_model_state_dict(model)
    base = to_hf_state_dict({base_key(k): v for k, v in state.items() if not is_adapter_key(k)}, trainer.args)
    source = tensors(Path(folders["base"]))
    tokens = torch.randint(0, trainer.args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.save({"tokens": tokens, "logits": model(tokens)}, out)
    return {
        "optimized": optimized,
        "base_keys_match": base.keys() == source.keys(),
        "base_unchanged": all(torch.equal(base[k], source[k]) for k in source if k in base),
    }


def test_adapter_trains_alone_and_exports_for_peft(folders, tmp_path):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    run_dir, saved = tmp_path / "run", tmp_path / "kiln_logits.pt"
    result = spawn_ranks(
        _train_and_export, ({k: str(v) for k, v in folders.items()}, str(run_dir), str(saved)), 1, tmp_path, threads=2
    )[0]
    # Only the adapter reaches the optimizer: 7 projections x 4 layers x (A, B).
    assert len(result["optimized"]) == 56 and all(".lora_A." in n or ".lora_B." in n for n in result["optimized"])
    assert result["base_keys_match"] and result["base_unchanged"]

    export = run_dir / "export"
    config = json.loads((export / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(folders["base"]) and config["peft_type"] == "LORA"
    assert set(config["target_modules"]) == HF_TARGETS and config["r"] == 8 and config["lora_alpha"] == 16
    adapter = tensors(export)
    assert len(adapter) == 56 and "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight" in adapter
    assert all(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)  # trained: B left zero

    kiln = torch.load(saved)
    base = LlamaForCausalLM.from_pretrained(folders["base"], dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(kiln["tokens"]).logits
        peft_model = PeftModel.from_pretrained(base, export).eval()
        peft_logits = peft_model(kiln["tokens"]).logits
    error = (peft_logits - kiln["logits"]).abs().max().item()
    changed = (base_logits - kiln["logits"]).abs().max().item()
    print(f"max |PeftModel - Kiln| logits = {error:.2e}; the adapter moved the logits by up to {changed:.2e}")
    assert error <= 1e-5 and changed > 1e-3

    # export.merge_lora: the merged model is peft's merge_and_unload, and a LlamaForCausalLM of the same logits.
    merged = peft_model.merge_and_unload().state_dict()
    ours = tensors(export / "merged")
    assert ours.keys() == {k for k in merged if k != "lm_head.weight"}  # tied: one tensor, as save_pretrained writes
    merge_error = max((ours[k] - merged[k]).abs().max().item() for k in ours)
    with torch.no_grad():
        merged_logits = (
            LlamaForCausalLM.from_pretrained(export / "merged", dtype=torch.float32).eval()(kiln["tokens"]).logits
        )
    print(
        f"max |merged - peft merge_and_unload| = {merge_error:.2e}; "
        f"logits {(merged_logits - kiln['logits']).abs().max().item():.2e}"
    )
    assert merge_error <= 1e-6 and (merged_logits - kiln["logits"]).abs().max().item() <= 1e-5


@pytest.fixture(scope="module")
def six_steps(folders, tmp_path_factory):
    """A finetune=lora run of 6 steps with a checkpoint at step 3."""
    run_dir = tmp_path_factory.mktemp("six_steps")
    run_train(overrides(folders, run_dir, "trainer.max_steps=6", "checkpoint.every=3"))
    return run_dir


def test_checkpoints_hold_the_adapter_and_resume_bitwise(folders, six_steps, tmp_path):
    """A new run resumed from step 3 gives steps 4-6 bit for bit. The checkpoint holds the adapter and its optimizer
    state only: a fraction of a full fine-tune's checkpoint of the same model. scripts/export.py rebuilds the export."""
    first, resumed, full = six_steps, tmp_path / "resumed", tmp_path / "full"
    ckpt = first / "checkpoints" / "step_0000003"
    run_train(overrides(folders, resumed, "trainer.max_steps=6", f"run.resume={ckpt}"))
    want, got = losses(first), losses(resumed)
    assert sorted(got) == [4, 5, 6] and all(got[s] == want[s] for s in got), (want, got)
    assert want[6] < want[1]

    # scripts/export.py rebuilds the run's export from its last checkpoint and model.init_from.
    again = tmp_path / "again"
    exported = run_python([sys.executable, str(REPO / "scripts" / "export.py"), str(first), "--out", str(again)])
    assert exported.returncode == 0, exported.stderr
    want, got = tensors(first / "export"), tensors(again)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    configs = [json.loads((d / "adapter_config.json").read_text()) for d in (again, first / "export")]
    for c in configs:  # peft keeps target_modules as a set: its order in the file varies
        c["target_modules"] = sorted(c["target_modules"])
    assert configs[0] == configs[1]

    keys, lora_tensors, lora_files = dcp_contents(ckpt)
    assert len(keys) == 56 and all(".lora_A." in k or ".lora_B." in k for k in keys)
    adapter_bytes = sum(v.numel() * v.element_size() for v in tensors(first / "export").values())
    # The adapter, Adam's two moments of it, and Adam's step counts: nothing of the base.
    assert adapter_bytes * 3 <= lora_tensors <= adapter_bytes * 3 + 56 * 8, (adapter_bytes, lora_tensors)
    run_train(overrides(folders, full, "finetune=full", "trainer.max_steps=1"))
    _, full_tensors, full_files = dcp_contents(full / "checkpoints" / "step_0000001")
    print(
        f"checkpoint tensor bytes: LoRA {lora_tensors:,}, full fine-tune {full_tensors:,} "
        f"({lora_tensors / full_tensors:.3f}x); files {lora_files:,} vs {full_files:,} "
        f"({lora_files / full_files:.2f}x; the rest is per-parameter optimizer hyperparameters)"
    )
    assert lora_tensors < 0.25 * full_tensors and lora_files < full_files


def test_activation_checkpointing_and_dropout(folders, six_steps, tmp_path):
    """Full activation checkpointing recomputes the adapted blocks exactly; with lora.dropout the masks are drawn
    per rank and their random streams are checkpointed: a resumed run is still bit for bit."""
    ac = tmp_path / "ac"
    run_train(
        overrides(folders, ac, "trainer.max_steps=6", "checkpoint.final=false", "toggles.activation_checkpointing=full")
    )
    ref, got = losses(six_steps), losses(ac)
    assert sorted(got) == sorted(ref) and all(got[s] == pytest.approx(ref[s], rel=1e-6) for s in ref), (ref, got)

    dropout, resumed = tmp_path / "dropout", tmp_path / "dropout_resumed"
    extra = ["trainer.max_steps=4", "lora.dropout=0.1", "toggles.activation_checkpointing=full"]
    run_train(overrides(folders, dropout, *extra, "checkpoint.every=2"))
    run_train(overrides(folders, resumed, *extra, f"run.resume={dropout / 'checkpoints' / 'step_0000002'}"))
    want, got = losses(dropout), losses(resumed)
    assert sorted(got) == [3, 4] and all(got[s] == want[s] for s in got), (want, got)
    assert want[2] != pytest.approx(ref[2], rel=1e-6)  # dropout did draw


def test_qlora_nf4_base(folders, tmp_path):
    """lora.quantize_base=nf4: the adapted linears' frozen weights in torchao's 4-bit NormalFloat. The loss falls, a
    resumed run continues bit for bit (the base is quantized again, alike), and the export's merged model computes what
    transformers' LlamaForCausalLM does with torchao's dequantized NF4 weights and the exported adapter loaded by
    peft -- not what it does on the full-precision base."""
    from peft import PeftModel
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    from transformers import LlamaForCausalLM

    first, resumed = tmp_path / "first", tmp_path / "resumed"
    out = run_train(
        overrides(
            folders,
            first,
            "trainer.max_steps=6",
            "checkpoint.every=3",
            "lora.quantize_base=nf4",
            "export.merge_lora=true",
        )
    ).stdout
    # 4 layers x 7 linears, 151,552 weights: half a byte each plus the scales, against 4 bytes each in fp32.
    assert "lora.quantize_base=nf4: the adapted linears' base weights hold 0.1 MiB" in out, out
    run_train(
        overrides(
            folders,
            resumed,
            "trainer.max_steps=6",
            "lora.quantize_base=nf4",
            f"run.resume={first / 'checkpoints' / 'step_0000003'}",
        )
    )
    want, got = losses(first), losses(resumed)
    assert want[6] < want[1] and sorted(got) == [4, 5, 6] and all(got[s] == want[s] for s in got), (want, got)

    tokens = torch.randint(0, 384, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = LlamaForCausalLM.from_pretrained(folders["base"], dtype=torch.float32).eval()
        full_logits = PeftModel.from_pretrained(full, first / "export").eval()(tokens).logits
        nf4 = LlamaForCausalLM.from_pretrained(folders["base"], dtype=torch.float32).eval()
        for name, module in nf4.named_modules():
            if name.rpartition(".")[2] in HF_TARGETS:
                scales = module.weight.numel() // 64
                block = next(b for b in (256, 128, 64, 32, 16, 8, 4, 2, 1) if scales % b == 0)
                module.weight.copy_(to_nf4(module.weight, 64, block).get_original_weight())
        nf4_logits = PeftModel.from_pretrained(nf4, first / "export").eval()(tokens).logits
        merged = (
            LlamaForCausalLM.from_pretrained(first / "export" / "merged", dtype=torch.float32).eval()(tokens).logits
        )
    error, quantized = (merged - nf4_logits).abs().max().item(), (merged - full_logits).abs().max().item()
    print(f"max |merged - PeftModel on the NF4 base| = {error:.2e}; against the fp32 base {quantized:.2e}")
    assert error <= 1e-5 and quantized > 1e-3
