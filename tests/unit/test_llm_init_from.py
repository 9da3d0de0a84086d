"""model.init_from on one process: the model's keys come from config.json, llama3 RoPE frequencies are
transformers' bit for bit, step-0 logits equal transformers', the export is the source bit for bit and
generates the same text, and every unsupported or mismatched input stops with one line, exit 2, nothing
written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from recipes.llm import weights
from recipes.llm.hf_adapter import to_hf_state_dict
from recipes.llm.model import Llama3RopeScaling, LlamaArgs, Transformer, rope_inv_freq
from recipes.llm.sizing import llama_args, memory_spec
from scripts.kiln.launch import compose
from tests.conftest import kiln_error, run_train
from tests.fixtures.llm import train_tokenizer, write_llama_folder, write_token_dataset

VARIANTS = ("tied", "gqa")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llama")
    return {v: write_llama_folder(root / v, v) for v in VARIANTS}


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def loaded(folder: Path, device: str = "cpu") -> tuple[Transformer, LlamaArgs]:
    """The model as the trainer builds it for one rank: meta, materialized empty, then read from disk."""
    args = llama_args(compose(["recipe=llm_tiny", f"model.init_from={folder}"]), vocab_size=0)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_buffers()
    weights.load_weights(model, args, folder)
    return model.eval(), args


@pytest.mark.parametrize(
    "scaling", [Llama3RopeScaling(), Llama3RopeScaling(32.0, 1.0, 4.0, 8192), Llama3RopeScaling(8.0, 2.0, 8.0, 16)]
)
@pytest.mark.parametrize("head_dim,theta", [(128, 500000.0), (64, 500000.0), (16, 10000.0)])
def test_llama3_rope_frequencies_are_transformers_bits(scaling, head_dim, theta):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        },
    )
    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config)
    got = rope_inv_freq(head_dim, theta, scaling=scaling)
    assert attention_factor == 1.0 and torch.equal(got, expected)
    assert not torch.equal(got, rope_inv_freq(head_dim, theta))  # the scaling changes something


def test_model_keys_come_from_the_checkpoint(folders):
    from transformers import LlamaForCausalLM

    # llm_8b's preset shapes (4096 wide, 32 layers, ...) give way to the checkpoint's.
    cfg = compose(
        ["recipe=llm_8b", f"model.init_from={folders['tied']}", "data.max_seq_len=128", "model.dim=64", "parallel.tp=1"]
    )
    m = cfg.model
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size) == (64, 4, 4, 4, 160, 384)
    assert (m.tie_embeddings, m.rope_theta, m.max_seq_len, m.norm_eps) == (True, 500000.0, 2048, 1e-5)
    assert m.rope_scaling.rope_type == "llama3" and m.rope_scaling.original_max_position_embeddings == 16
    gqa = compose(["recipe=llm_tiny", f"model.init_from={folders['gqa']}"]).model
    assert (gqa.n_kv_heads, gqa.tie_embeddings, gqa.rope_scaling.rope_type) == (2, False, "default")
    # The memory model (run.dry_run, scripts/plan.py) counts the checkpoint's parameters.
    spec = memory_spec(cfg)
    hf_params = LlamaForCausalLM.from_pretrained(folders["tied"]).num_parameters()
    assert spec.layers * spec.layer_params + spec.first_params + spec.last_params == hf_params


def test_adapter_gives_tied_checkpoints_one_tensor():
    args = LlamaArgs(dim=8, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=11, ffn_dim=16, tie_embeddings=True)
    full = Transformer(args).state_dict()
    assert "lm_head.weight" not in to_hf_state_dict(full, args)
    # A last pipeline stage holds the output projection without the embedding: it is the embedding.
    last_stage = {"output.weight": full["output.weight"], "norm.weight": full["norm.weight"]}
    assert to_hf_state_dict(last_stage, args) == {
        "model.embed_tokens.weight": full["output.weight"],
        "model.norm.weight": full["norm.weight"],
    }


@pytest.mark.parametrize("variant", VARIANTS)
def test_step0_logits_export_and_generate_match_the_source(folders, variant, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = folders[variant]
    model, args = loaded(source)
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        error = (model(tokens) - reference(tokens).logits).abs().max().item()
    print(f"{variant}: max |logits - transformers| = {error:.2e}")
    assert error <= 1e-5

    tokenizer = weights.load_tokenizer(source)
    out = tmp_path / "export"
    weights.write_hf_folder(model.state_dict(), args, out, tokenizer=tokenizer, source=source)
    want, got = tensors(source), tensors(out)
    assert got.keys() == want.keys()
    for key in want:  # bf16 on disk -> fp32 master -> bf16 again: exact
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    assert json.loads((out / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    assert (out / "generation_config.json").read_text() == (source / "generation_config.json").read_text()
    assert AutoTokenizer.from_pretrained(out).chat_template == tokenizer.chat_template

    prompt = tokenizer("The with statement", return_tensors="pt")
    runs = [
        AutoModelForCausalLM.from_pretrained(f)
        .eval()
        .generate(**prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=tokenizer.eos_token_id)[
            0
        ]
        .tolist()
        for f in (source, out)
    ]
    assert runs[0] == runs[1]


@pytest.mark.gpu
def test_loads_onto_the_gpu(folders):
    from transformers import AutoModelForCausalLM

    model, args = loaded(folders["gqa"], device="cuda")
    reference = AutoModelForCausalLM.from_pretrained(folders["gqa"], dtype=torch.float32).cuda().eval()
    tokens = torch.randint(0, args.vocab_size, (2, 64), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, atol=1e-4, rtol=0)


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def _rope(folder: Path) -> None:
    _edit_config(
        folder,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 64,
        },
    )


def _drop_a_shard(folder: Path) -> None:
    sorted(folder.glob("model-*.safetensors"))[-1].unlink()


def _bin_only(folder: Path) -> None:
    for f in folder.glob("*.safetensors*"):
        f.unlink()
    (folder / "pytorch_model.bin").write_bytes(b"")


def _dit_export(folder: Path) -> None:
    shutil.rmtree(folder)
    (folder / "transformer").mkdir(parents=True)
    (folder / "kiln.json").write_text("{}")


def _run_dir(folder: Path) -> None:
    (folder / "config.yaml").write_text("recipe: {}\n")
    (folder / "checkpoints").mkdir()


BAD_CHECKPOINTS = {
    "non-llama model_type": (lambda f: _edit_config(f, model_type="mistral"), "model_type='mistral'"),
    "rope_scaling yarn": (_rope, "rope_scaling type 'yarn'"),
    "attention_bias": (lambda f: _edit_config(f, attention_bias=True), "attention_bias=True"),
    "mlp_bias": (lambda f: _edit_config(f, mlp_bias=True), "mlp_bias=True"),
    "missing shard": (_drop_a_shard, "names 1 missing file"),
    "config wider than weights": (lambda f: _edit_config(f, num_hidden_layers=5), "lack 9 of the 48 weights"),
    "no safetensors": (_bin_only, "no *.safetensors weights (found pytorch_model.bin"),
    "a DiT export": (_dit_export, "no config.json"),
    "a run dir": (_run_dir, "a Kiln run dir"),
}


@pytest.mark.parametrize("case", BAD_CHECKPOINTS)
def test_unsupported_checkpoints_stop_with_one_line(folders, case, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(folders["gqa"], folder)
    damage, needle = BAD_CHECKPOINTS[case]
    damage(folder)
    line = kiln_error(["recipe=llm_tiny", f"model.init_from={folder}", f"run.dir={tmp_path / 'run'}"], capsys)
    assert f"model.init_from={folder}: " in line and needle in line, line
    assert not (tmp_path / "run").exists()


def test_command_line_keys_that_disagree_stop_with_both_values(folders, tmp_path, capsys):
    run = tmp_path / "run"
    line = kiln_error(
        ["recipe=llm_tiny", f"model.init_from={folders['gqa']}", "model.dim=128", f"run.dir={run}"], capsys
    )
    assert "model.dim=128 disagrees" in line and "hidden_size=64" in line
    line = kiln_error(
        ["recipe=llm_tiny", f"model.init_from={folders['tied']}", "model.tie_embeddings=false", f"run.dir={run}"],
        capsys,
    )
    assert "model.tie_embeddings=False disagrees" in line and "tie_word_embeddings=True" in line
    line = kiln_error(
        ["recipe=llm_tiny", f"model.init_from={folders['gqa']}", "data.max_seq_len=4096", f"run.dir={run}"], capsys
    )
    assert "data.max_seq_len=4096 exceeds model.max_seq_len=2048 (max_position_embeddings" in line
    assert not run.exists()


def test_data_from_another_tokenizer_stops_with_one_line(folders, tmp_path):
    other = tmp_path / "other_tokenizer"
    train_tokenizer(vocab_size=320).save_pretrained(other)
    data, run = write_token_dataset(tmp_path / "data", other), tmp_path / "run"
    proc = run_train(
        [
            "recipe=llm_tiny",
            f"model.init_from={folders['tied']}",
            f"data.root={data}",
            "data.build=[]",
            f"run.dir={run}",
        ],
        check=False,
        timeout=300,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        f"kiln: error: data.root={data} was tokenized with another tokenizer than "
        f"model.init_from={folders['tied']} (320 vs 384 tokens)"
    ), lines[0]
    assert not run.exists()
