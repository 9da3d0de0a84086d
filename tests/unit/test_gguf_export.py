"""The GGUF export (recipes/llm/gguf_export.py) read back with gguf's own GGUFReader, without llama.cpp: every tensor
equals the Hugging Face folder's once a Llama's q/k row order is undone (F16 and BF16 bit for bit after the cast, Q8_0
within half a quantization step; a Qwen3's and a Qwen3-MoE's as they are, their experts stacked), the
hyperparameters, Llama 3's RoPE factors (against transformers' own llama3 frequencies), the tokenizer (tokens in id
order, types, merges, special ids) and the chat template are in the file, and the Modelfile names the file, the template
and the stop tokens. A PEFT LoRA folder (on a Llama, on a Qwen3) is written as llama.cpp's GGUF LoRA: its metadata,
every A and B equal to peft's (a Llama's B q/k rows in llama.cpp's order), and the base GGUF + the file's B A x alpha /
rank equal to peft's merge_and_unload of the adapter on transformers. What it cannot write stops with one line.
llama.cpp itself loads the file in tests/integration/test_gguf_llamacpp.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import gguf  # a declared dependency (pyproject's export extra, which make install installs)
import numpy as np
import pytest
import torch

from common.errors import ConfigError
from recipes.llm.export import write_export
from recipes.llm.gguf_export import rope_factors, unpermute, write_gguf
from scripts.kiln.launch import compose
from tests.conftest import REPO
from tests.fixtures.llm import EOT, QWEN_CHAT_TEMPLATE, write_llama_folder, write_moe_folder, write_qwen3_folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    # tied: fp32, tied embeddings, llama3 RoPE scaling; gqa: bf16 shards, 2 kv heads, untied output.
    return {v: write_llama_folder(root / v, v) for v in ("tied", "gqa")}


@pytest.fixture(scope="module")
def qwens(tmp_path_factory):
    """A Qwen3 (tied, bf16, head_dim 32 != 64 / 4 heads) and a Qwen3-MoE llama.cpp's qwen3moe computes (8 experts of
    width 32, top-2 renormalized, experts in every layer; fp32, untied), both with the tests' Qwen tokenizer."""
    root = tmp_path_factory.mktemp("gguf_qwen")
    return {
        "qwen3": write_qwen3_folder(root / "qwen3"),
        "qwen3_moe": write_moe_folder(
            root / "qwen3_moe", "qwen3_moe", tokenizer="qwen", mlp_only_layers=[], norm_topk_prob=True
        ),
    }


def read(path):
    reader = gguf.GGUFReader(path)
    fields = {name: f.contents() for name, f in reader.fields.items()}
    return fields, {t.name: t for t in reader.tensors}


def hf_tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def back_to_hf(name: str, tensor, config: dict) -> np.ndarray:
    """A GGUF tensor as float32 in Hugging Face's layout (numpy shape = the safetensors' shape)."""
    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    data = data.reshape([int(n) for n in reversed(tensor.shape)])
    if config.get("model_type") not in ("llama", "mixtral"):  # llama.cpp's qwen3/qwen3moe rotate as transformers
        return data
    heads = config["num_attention_heads"]
    if name.endswith("attn_q.weight"):
        data = unpermute(data, heads)
    elif name.endswith("attn_k.weight"):
        data = unpermute(data, config["num_key_value_heads"])
    return data


HF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_up": "mlp.up_proj",
}


def hf_name(name: str) -> str:
    """llama.cpp's tensor name as Hugging Face's (written out here, not taken from gguf's map the export uses)."""
    stem = name.removesuffix(".weight")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        return f"model.layers.{layer}.{HF_NAMES[part]}.weight"
    return f"{HF_NAMES[stem]}.weight"


@pytest.mark.parametrize("variant", ["tied", "gqa"])
@pytest.mark.parametrize("gguf_type", ["f16", "bf16", "q8_0"])
def test_every_tensor_reads_back_as_the_folders(folders, variant, gguf_type, tmp_path):
    folder = folders[variant]
    config = json.loads((folder / "config.json").read_text())
    path = write_gguf(folder, tmp_path, gguf_type)
    assert path == tmp_path / f"model-{gguf_type}.gguf"
    _, tensors = read(path)
    theirs = hf_tensors(folder)
    weights = {n: t for n, t in tensors.items() if n != "rope_freqs.weight"}
    assert sorted(hf_name(n) for n in weights) == sorted(theirs)  # tied: no output.weight (llama.cpp reuses token_embd)
    cast = {"f16": torch.float16, "bf16": torch.bfloat16}
    for name, tensor in weights.items():
        ours, reference = back_to_hf(name, tensor, config), theirs[hf_name(name)].float()
        if reference.ndim == 1:  # norms stay F32: bit for bit
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(ours, reference.numpy())
        elif gguf_type in cast:  # the folder's weights cast to the type, bit for bit
            np.testing.assert_array_equal(ours, reference.to(cast[gguf_type]).float().numpy(), err_msg=name)
        else:  # Q8_0: blocks of 32 values, one step (amax / 127) each, the step stored in f16: within half a step
            # plus 127 x the f16 step's rounding (2^-11 of it)
            assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0
            blocks = reference.numpy().reshape(-1, 32)
            step = np.abs(blocks).max(axis=1, keepdims=True) / 127
            assert (np.abs(ours.reshape(-1, 32) - blocks) <= step * (0.5 + 127 * 2**-11)).all(), name


def test_mixtral_experts_are_stacked_as_llamacpps(tmp_path):
    """A Mixtral folder: llama.cpp's llama architecture with experts, each layer's experts one [experts, out, in]
    tensor per projection (w1 gate, w2 down, w3 up), the router in F32."""
    folder = write_moe_folder(tmp_path / "mixtral", "mixtral")
    config = json.loads((folder / "config.json").read_text())
    fields, tensors = read(write_gguf(folder, tmp_path / "out", "f16"))
    assert (fields["llama.expert_count"], fields["llama.expert_used_count"]) == (4, 2)
    theirs = hf_tensors(folder)
    for layer in range(config["num_hidden_layers"]):
        router = tensors[f"blk.{layer}.ffn_gate_inp.weight"]
        assert router.tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(
            back_to_hf("router", router, config), theirs[f"model.layers.{layer}.block_sparse_moe.gate.weight"].numpy()
        )
        for w, part in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
            stacked = torch.stack(
                [theirs[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"] for e in range(4)]
            )
            ours = back_to_hf(part, tensors[f"blk.{layer}.ffn_{part}_exps.weight"], config)
            np.testing.assert_array_equal(ours, stacked.to(torch.float16).float().numpy())
    assert not any(".experts." in name for name in tensors)


@pytest.mark.parametrize("variant", ["qwen3", "qwen3_moe"])
def test_a_qwen_is_written_as_llamacpps_converter_writes_it(qwens, variant, tmp_path):
    """A Qwen3 as llama.cpp's qwen3, a Qwen3-MoE as its qwen3moe: every weight of the folder under llama.cpp's name,
    in F16 bit for bit as the folder's cast, q/k rows as they are (its RoPE rotates the halves of each head, as
    transformers'), norms (the q/k norms too) and the router in F32 bit for bit, a layer's experts stacked per
    projection [experts, out, in]; a tied output projection not written; the converter's hyperparameters (the explicit
    head_dim as key/value length; the experts' count, top-k and width), the Qwen2 split, the ChatML chat template and
    the Modelfile's template and stop."""
    folder = qwens[variant]
    config = json.loads((folder / "config.json").read_text())
    fields, tensors = read(write_gguf(folder, tmp_path, "f16"))
    arch = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe"}[variant]
    theirs, seen = hf_tensors(folder), set()
    for name, tensor in tensors.items():
        ours = back_to_hf(name, tensor, config)
        if "_exps." in name:  # blk.L.ffn_gate_exps.weight: model.layers.L.mlp.experts.E.gate_proj.weight, E stacked
            _, layer, part = name.removesuffix("_exps.weight").replace("ffn_", "").split(".")
            keys = [f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight" for e in range(8)]
            reference = torch.stack([theirs[k] for k in keys])
        else:
            keys = [hf_name(name)]
            reference = theirs[keys[0]]
        seen.update(keys)
        if reference.ndim == 1 or name.endswith("ffn_gate_inp.weight"):
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, name
            np.testing.assert_array_equal(ours, reference.float().numpy(), err_msg=name)
        else:
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F16, name
            np.testing.assert_array_equal(ours, reference.to(torch.float16).float().numpy(), err_msg=name)
    assert seen == set(theirs)  # every weight written once; the tied output too (as token_embd)
    assert ("output.weight" in tensors) == (not config["tie_word_embeddings"])
    head_dim = {"qwen3": 32, "qwen3_moe": 16}[variant]
    expected = {
        "general.architecture": arch,
        f"{arch}.block_count": config["num_hidden_layers"],
        f"{arch}.context_length": config["max_position_embeddings"],
        f"{arch}.embedding_length": 64,
        f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.rope.freq_base": config["rope_parameters"]["rope_theta"],
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.chat_template": QWEN_CHAT_TEMPLATE,
        "tokenizer.ggml.eos_token_id": json.loads((folder / "config.json").read_text())["eos_token_id"],
    }
    if variant == "qwen3_moe":
        expected |= {
            f"{arch}.expert_count": 8,
            f"{arch}.expert_used_count": 2,
            f"{arch}.expert_feed_forward_length": 32,
        }
    assert {k: fields.get(k) for k in expected} == expected
    assert fields[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert f"{arch}.rope.dimension_count" not in fields  # the converter's Qwen models leave it to head_dim
    lines = (tmp_path / "Modelfile").read_text().splitlines()
    assert lines[1] == 'TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}'
    assert [line for line in lines if line.startswith("PARAMETER stop")] == ['PARAMETER stop "<|im_end|>"']


def test_the_metadata_is_the_folders(folders, tmp_path):
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    folder = folders["tied"]
    config = json.loads((folder / "config.json").read_text())
    fields, tensors = read(write_gguf(folder, tmp_path, "f16"))
    expected = {
        "general.architecture": "llama",
        "llama.block_count": 4,
        "llama.context_length": 2048,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 160,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 4,
        "llama.rope.dimension_count": 16,
        "llama.vocab_size": config["vocab_size"],
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_F16),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe",
    }
    assert {k: fields[k] for k in expected} == expected
    assert fields["llama.rope.freq_base"] == 500000.0
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert fields["tokenizer.ggml.tokens"] == tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    control = [i for i, t in enumerate(fields["tokenizer.ggml.token_type"]) if t == gguf.TokenType.CONTROL]
    assert control == sorted(tokenizer.all_special_ids)
    merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    assert fields["tokenizer.ggml.merges"] == [" ".join(m) if isinstance(m, list) else m for m in merges]
    assert fields["tokenizer.ggml.bos_token_id"] == tokenizer.bos_token_id
    assert fields["tokenizer.ggml.eos_token_id"] == tokenizer.eos_token_id
    assert fields["tokenizer.ggml.add_bos_token"] is True  # the post-processor adds <|begin_of_text|>
    assert fields["tokenizer.chat_template"] == tokenizer.chat_template
    # Llama 3's RoPE: llama.cpp divides each default frequency by its factor; transformers computes the scaled ones.
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(folder), "cpu")
    default = 1.0 / 500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    factors = gguf.quants.dequantize(tensors["rope_freqs.weight"].data, gguf.GGMLQuantizationType.F32)
    np.testing.assert_allclose(default / factors, inv_freq.double(), rtol=1e-6)
    assert rope_factors(json.loads((folders["gqa"] / "config.json").read_text())) is None


def test_the_modelfile_names_the_file_its_template_and_stops(folders, tmp_path):
    write_gguf(folders["gqa"], tmp_path, "q8_0")
    lines = (tmp_path / "Modelfile").read_text().splitlines()
    assert lines[0] == "FROM ./model-q8_0.gguf"
    text = "\n".join(lines)
    assert 'TEMPLATE """{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>' in text
    # generation_config.json's two eos ids (<|end_of_text|>, <|eot_id|>), each once
    assert [line for line in lines if line.startswith("PARAMETER stop")] == [
        'PARAMETER stop "<|end_of_text|>"',
        f'PARAMETER stop "{EOT}"',
    ]


# ChatML as Hugging Face's chat templating docs print it (Qwen's adds a default system prompt and tools).
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize("chat", ["llama3", "chatml"])
def test_the_modelfile_template_renders_the_chat_templates_prompt(folders, chat, tmp_path):
    """ollama renders a Modelfile's TEMPLATE with Go's text/template on the request's .Messages: on a system turn, an
    earlier exchange and a question it gives transformers' apply_chat_template prompt (with the generation prompt),
    less Llama 3's leading bos, which ollama's tokenizer adds (tokenizer.ggml.add_bos_token). Needs Go (skipped
    without)."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("needs Go: its text/template is what ollama renders a Modelfile's TEMPLATE with")
    from transformers import AutoTokenizer

    folder = folders["gqa"]
    if chat == "chatml":
        folder = Path(shutil.copytree(folder, tmp_path / "chatml"))
        (folder / "chat_template.jinja").write_text(CHATML)
    write_gguf(folder, tmp_path, "f16")
    template = (tmp_path / "Modelfile").read_text().split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    messages = [
        {"role": "system", "content": "You answer with one word."},
        {"role": "user", "content": "What is the opposite of up?"},
        {"role": "assistant", "content": "down"},
        {"role": "user", "content": "And of hot?"},
    ]
    proc = subprocess.run(
        [go, "run", str(REPO / "tests" / "support" / "go_template.go")],
        input=json.dumps({"template": template, "messages": messages}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert expected.startswith(tokenizer.bos_token) == (chat == "llama3")
    assert proc.stdout == expected.removeprefix(tokenizer.bos_token)


def test_what_is_not_written_stops_with_one_line(folders, qwens, tmp_path):
    with pytest.raises(ConfigError, match=r"export.gguf_type='q4_k_m' .*llama-quantize.*f16, bf16, q8_0$"):
        write_gguf(folders["tied"], tmp_path, "q4_k_m")
    other = Path(shutil.copytree(folders["tied"], tmp_path / "other_split"))
    spec = json.loads((other / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\s+|\S+"
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match=r"its pre-tokenizer is not one llama.cpp splits the same way here"):
        write_gguf(other, tmp_path / "out", "f16")
    # a Qwen3-MoE llama.cpp's qwen3moe computes otherwise (it has experts in every layer and renormalizes the top-k)
    moe = Path(shutil.copytree(qwens["qwen3_moe"], tmp_path / "moe"))
    config = json.loads((moe / "config.json").read_text())
    refused = {
        r"mlp_only_layers=\[0\]: dense layers, which llama.cpp's qwen3moe does not have$": {"mlp_only_layers": [0]},
        r"decoder_sparse_step=2: dense layers between the MoE ones": {"decoder_sparse_step": 2},
        r"norm_topk_prob=false: llama.cpp's qwen3moe always renormalizes": {"norm_topk_prob": False},
        r"model_type='qwen2_moe': only Llama, Mixtral, Qwen3 and Qwen3-MoE are written": {"model_type": "qwen2_moe"},
    }
    for message, change in refused.items():
        (moe / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ConfigError, match=message):
            write_gguf(moe, tmp_path / "out", "f16")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["recipe=dit_tiny", "export.formats=[gguf]"], "export.formats: the DiT recipes do not write 'gguf'"),
        (["recipe=llm_tiny", "export.formats=[onnx]"], "export.formats: the LLM recipes do not write 'onnx'"),
        (["recipe=llm_tiny", "export.gguf_type=q4_0"], "export.gguf_type='q4_0' is not written here"),
        (  # moe_tiny is a Qwen3-MoE with a dense first layer, which llama.cpp's qwen3moe does not have
            ["recipe=moe_tiny", "export.formats=[gguf]"],
            "export.formats=[gguf]: this run's model is an MoE with dense layers",
        ),
        (
            [
                "recipe=moe_tiny",
                "export.formats=[gguf]",
                "model.moe.first_dense_layers=0",
                "model.moe.norm_topk_prob=false",
            ],
            "export.formats=[gguf]: this run's model is an MoE without top-k renormalization",
        ),
        (
            ["recipe=moe_tiny", "export.formats=[gguf]", "model.moe.first_dense_layers=0", "model.qk_norm=false"]
            + ["model.moe.shared_ffn_dim=64", "model.qkv_bias=true"],
            "export.formats=[gguf]: this run's model is a Qwen2 or Qwen2-MoE",
        ),
    ],
)
def test_the_config_refuses_what_is_not_written(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("[", r"\[").replace("]", r"\]")):
        compose(overrides)


def test_the_llm_composes_with_gguf():
    cfg = compose(["recipe=llm_tiny", "export.formats=[gguf]", "export.gguf_type=q8_0"])
    assert (cfg.export.formats, cfg.export.gguf_type) == (["gguf"], "q8_0")
    cfg = compose(["recipe=llm_tiny", "finetune=lora", "run.dry_run=true", "export.formats=[gguf]"])
    assert (cfg.finetune, cfg.export.merge_lora, cfg.export.formats) == ("lora", False, ["gguf"])
    # a Qwen3 (q/k norms), and moe_tiny's Qwen3-MoE with experts in every layer (llama.cpp's qwen3moe)
    assert compose(["recipe=llm_tiny", "export.formats=[gguf]", "model.qk_norm=true"]).model.qk_norm
    cfg = compose(["recipe=moe_tiny", "export.formats=[gguf]", "model.moe.first_dense_layers=0"])
    assert (cfg.model.qk_norm, cfg.model.moe.num_experts, cfg.export.formats) == (True, 8, ["gguf"])


# ---- a LoRA adapter as a GGUF LoRA ------------------------------------------------------------------

LORA_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # Kiln's LORA_TARGETS
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def adapters(folders, qwens, tmp_path_factory):
    """A PEFT LoRA (rank 4, alpha 8) on every linear of the gqa folder (bf16, 2 kv heads: q and k permute by other
    head counts), A and B random (peft's init_lora_weights=False), as PeftModel.save_pretrained writes it; plain and
    rsLoRA; and a plain one on the Qwen3 (bf16 too). {variant: (base folder, adapter folder, peft's merge_and_unload
    state dict in float32)}."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root, out = tmp_path_factory.mktemp("lora"), {}
    for seed, variant in enumerate(("plain", "rslora", "qwen3")):
        base = qwens["qwen3"] if variant == "qwen3" else folders["gqa"]
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        torch.manual_seed(seed)
        config = LoraConfig(
            r=RANK,
            lora_alpha=ALPHA,
            target_modules=list(LORA_PARTS),
            init_lora_weights=False,
            use_rslora=variant == "rslora",
        )
        peft_model = get_peft_model(model, config)
        peft_model.save_pretrained(root / variant)
        merged = {k: v.detach().clone() for k, v in peft_model.merge_and_unload().state_dict().items()}
        out[variant] = base, root / variant, merged
    return out


def lora_tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


@pytest.mark.parametrize("variant", ["plain", "rslora", "qwen3"])
def test_a_lora_reads_back_as_peft_and_merges_as_peft(adapters, variant, tmp_path):
    """The adapter file: llama.cpp's adapter metadata (its base's architecture; rsLoRA's alpha / sqrt(rank) as an
    alpha over the rank), every A and B as peft saved it in F32 (a Llama's q/k B rows reordered, a Qwen3's as they
    are), and, as llama.cpp applies it (W + B A x alpha / rank, rank lora_b's width), the base GGUF plus the adapter's
    delta equal to peft's merged weights, tensor by tensor."""
    base_folder, adapter, merged = adapters[variant]
    config = json.loads((base_folder / "config.json").read_text())
    write_gguf(base_folder, tmp_path, "bf16", adapter=adapter)  # bf16: the bf16 base's weights bit for bit
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Modelfile", "adapter-f32.gguf", "model-bf16.gguf"]
    fields, tensors = read(tmp_path / "adapter-f32.gguf")
    alpha = ALPHA * RANK**0.5 if variant == "rslora" else ALPHA  # scale alpha / sqrt(r) = (alpha sqrt(r)) / r
    arch = "qwen3" if variant == "qwen3" else "llama"  # llama.cpp loads an adapter only on a base of its architecture
    expected = {"general.architecture": arch, "general.type": "adapter", "adapter.type": "lora"}
    assert {k: fields[k] for k in expected} == expected
    assert fields["adapter.lora.alpha"] == pytest.approx(alpha, rel=1e-7)
    layers = range(config["num_hidden_layers"])
    parts = [n for n in HF_NAMES if n.startswith(("attn_", "ffn_")) and not n.endswith(("norm", "_inp"))]
    assert sorted(tensors) == sorted(f"blk.{i}.{p}.weight.lora_{ab}" for i in layers for p in parts for ab in "ab")
    theirs = lora_tensors(adapter)
    _, base = read(tmp_path / "model-bf16.gguf")
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    if variant == "qwen3":  # llama.cpp's qwen3 rotates as transformers: no reordering
        heads = {}
    for layer in layers:
        for part in parts:
            name = f"blk.{layer}.{part}.weight"
            module = hf_name(name).removesuffix(".weight")
            a, b = (tensors[f"{name}.lora_{ab}"] for ab in "ab")
            assert a.tensor_type == b.tensor_type == gguf.GGMLQuantizationType.F32
            a, b = (t.data.reshape([int(n) for n in reversed(t.shape)]) for t in (a, b))
            peft_a, peft_b = (theirs[f"base_model.model.{module}.lora_{ab}.weight"].numpy() for ab in "AB")
            np.testing.assert_array_equal(a, peft_a, err_msg=name)
            unpermuted = unpermute(b, heads[part]) if part in heads else b
            np.testing.assert_array_equal(unpermuted, peft_b, err_msg=name)
            if part in heads:  # the reorder is there, and not the identity
                assert not np.array_equal(b, peft_b)
            delta = (b @ a) * (fields["adapter.lora.alpha"] / b.shape[1])  # llama.cpp's layout
            ours = back_to_hf(name, base[name], config) + (unpermute(delta, heads[part]) if part in heads else delta)
            np.testing.assert_allclose(ours, merged[hf_name(name)].numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    lines = (tmp_path / "Modelfile").read_text().splitlines()
    assert lines[:2] == ["FROM ./model-bf16.gguf", "ADAPTER ./adapter-f32.gguf"]


def test_a_lora_runs_export_writes_the_base_and_the_adapter(folders, tmp_path):
    """finetune=lora with export.formats=[gguf], through the export's own writer (recipes/llm/export.py write_export,
    a LoRA-wrapped Kiln model on model.init_from): export/gguf holds model.init_from's GGUF and the adapter's, every
    adapted linear's A and B, which the Modelfile names; with export.merge_lora the merged model's GGUF alone."""
    from omegaconf import OmegaConf

    from recipes.llm import lora as llm_lora
    from recipes.llm import weights
    from recipes.llm.sizing import llama_args

    base = folders["gqa"]
    cfg = compose(["recipe=llm_tiny", "finetune=lora", f"model.init_from={base}", "export.formats=[gguf]"])
    cfg = OmegaConf.structured(cfg)  # as scripts/export.py reads config.yaml
    tokenizer = weights.load_tokenizer(str(base))
    args = llama_args(cfg, len(tokenizer))
    model = llm_lora.adapted_model(args, cfg)  # the adapter still to be loaded: A and B drawn here
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.02)
    write_export(model.state_dict(), args, cfg, tmp_path / "export", tokenizer=tokenizer)
    gguf_dir = tmp_path / "export" / "gguf"
    assert sorted(p.name for p in gguf_dir.iterdir()) == ["Modelfile", "adapter-f32.gguf", "model-f16.gguf"]
    fields, _ = read(gguf_dir / "model-f16.gguf")
    assert fields["general.name"] == base.name  # the base's file, not a merged model's
    _, tensors = read(gguf_dir / "adapter-f32.gguf")
    assert len(tensors) == len(lora_tensors(tmp_path / "export")) == 2 * 7 * args.n_layers
    assert (gguf_dir / "Modelfile").read_text().splitlines()[:2] == [
        "FROM ./model-f16.gguf",
        "ADAPTER ./adapter-f32.gguf",
    ]
    cfg.export.merge_lora = True
    write_export(model.state_dict(), args, cfg, tmp_path / "merged_export", tokenizer=tokenizer)
    gguf_dir = tmp_path / "merged_export" / "gguf"
    assert sorted(p.name for p in gguf_dir.iterdir()) == ["Modelfile", "model-f16.gguf"]
    assert read(gguf_dir / "model-f16.gguf")[0]["general.name"] == "merged"


def test_what_a_gguf_lora_cannot_hold_stops_with_one_line(folders, qwens, adapters, tmp_path):
    from safetensors.torch import save_file

    _, adapter, _ = adapters["plain"]
    with pytest.raises(ConfigError, match=r"a LoRA on model_type='qwen3_moe': only a Llama's or a Qwen3's is written"):
        write_gguf(qwens["qwen3_moe"], tmp_path / "out", "f16", adapter=adapter)
    dora = Path(shutil.copytree(adapter, tmp_path / "dora"))
    spec = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**spec, "use_dora": True}))
    with pytest.raises(ConfigError, match=r"use_dora: DoRA's magnitude vectors is not written as a GGUF LoRA$"):
        write_gguf(folders["gqa"], tmp_path / "out", "f16", adapter=dora)
    head = Path(shutil.copytree(adapter, tmp_path / "lm_head"))  # the tied base has no output tensor in llama.cpp
    extra = {
        "base_model.model.lm_head.lora_A.weight": torch.zeros(RANK, 64),
        "base_model.model.lm_head.lora_B.weight": torch.zeros(512, RANK),
    }
    save_file({**lora_tensors(adapter), **extra}, head / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match=r"a LoRA on lm_head: llama.cpp has no tensor for it$"):
        write_gguf(folders["tied"], tmp_path / "out", "f16", adapter=head)
    assert not (tmp_path / "out").exists()
