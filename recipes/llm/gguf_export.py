"""GGUF for llama.cpp and ollama from an LLM export (a Hugging Face folder): the file llama.cpp's own converter
(convert_hf_to_gguf.py) writes for a Llama, a Mixtral, a Qwen3 or a Qwen3-MoE, written with the `gguf` package
(llama.cpp's writer), and an ollama `Modelfile` beside it, so that `ollama create NAME -f Modelfile` takes the folder
as it is.

    write_gguf(export, out, "f16")   # out/model-f16.gguf + out/Modelfile
    write_gguf(base, out, "f16", adapter=peft_folder)   # + out/adapter-f32.gguf, the Modelfile's ADAPTER

What goes in, as the converter writes it:
- the tensors under llama.cpp's names for its architecture (the gguf package's own TensorNameMap: llama for Llama and
  Mixtral, qwen3, qwen3moe), a Llama's q_proj/k_proj rows reordered for llama.cpp's RoPE (Hugging Face rotates the two
  halves of each head, llama.cpp's llama adjacent pairs: `_permute`; its qwen3 and qwen3moe rotate the halves, NeoX
  style, so a Qwen's rows stay as they are), an MoE layer's experts stacked per projection (Mixtral: llama.cpp's
  llama architecture with experts; Qwen3-MoE: qwen3moe's ffn_*_exps), norms (Qwen3's q/k norms too) and the router in
  F32, the rest in F16, BF16 or Q8_0 (gguf's quants module; a tensor whose rows do not split into Q8_0's 32-wide
  blocks stays F16, as the converter does); Llama 3's RoPE scaling as the `rope_freqs` factors; a tied output
  projection is not written (llama.cpp reuses token_embd);
- the hyperparameters the converter writes for the architecture (a Qwen3's explicit head_dim as key_length and
  value_length; a Qwen3-MoE's expert count, experts per token and expert width, expert_feed_forward_length);
- the tokenizer as tokenizer.ggml.* (a byte-level BPE: its tokens, types, merges, special ids, add_bos) and the chat
  template (gguf's SpecialVocab reads both from the folder's tokenizer files).

A PEFT LoRA folder on the base (`adapter=`) is written as llama.cpp's LoRA adapter file, as its convert_lora_to_gguf.py
writes one: general.type "adapter", adapter.type "lora", adapter.lora.alpha, and per adapted linear
`<base tensor name>.lora_a` (A, [rank, in]) and `.lora_b` (B, [out, rank]; on a Llama q/k's rows reordered as the
base's, A unchanged; on a Qwen3 as peft saved them), in F32 (the converter's default --outtype: the adapter as
trained, bit for bit; it is small). llama.cpp scales B A by alpha / rank (rank: lora_b's width); rsLoRA's
alpha / sqrt(rank) is written as alpha x sqrt(rank). A LoRA on an MoE (Mixtral, Qwen3-MoE) is not written.

Refused in one line (ConfigError): an architecture other than Llama, Mixtral, Qwen3 and Qwen3-MoE (Qwen2-MoE's shared
expert and q/k/v biases among them: llama.cpp's converter takes those folders), a Qwen3-MoE that llama.cpp's qwen3moe
cannot compute as transformers does (dense layers: mlp_only_layers or decoder_sparse_step != 1; top-k probabilities not
renormalized, norm_topk_prob=false: qwen3moe always renormalizes them), a Qwen with RoPE scaling, a quant type gguf
cannot write in numpy (K-quants need llama.cpp's llama-quantize), a tokenizer whose pre-tokenizer llama.cpp would not
split the same way; an adapter on an MoE, or with more than LoRA's A and B (bias, modules_to_save), DoRA, a rank or
alpha per module, or a LoRA on a module llama.cpp has no tensor for.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

from common.errors import ConfigError

# export.gguf_type: the file types written here (gguf's quants module quantizes them in numpy).
GGUF_TYPES = ("f16", "bf16", "q8_0")
# tokenizer.ggml.pre: llama.cpp's name for a pre-tokenizer split, by the split's regex (tokenizer.json). llama.cpp's
# converter tells them apart by hashing a test string's tokens, which only a released tokenizer matches; a trained
# tokenizer with the same split tokenizes the same way. Byte-level BPE without a Split: ByteLevel's own GPT-2 regex.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's split (transformers' Qwen2Tokenizer PRETOKENIZE_REGEX, the Qwen2/2.5/3 releases'): digits one at a time.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2", "gpt2": "gpt-2"}
# Hugging Face model_type -> llama.cpp's architecture (gguf.MODEL_ARCH), as convert_hf_to_gguf.py maps them.
ARCHITECTURES = {"llama": "LLAMA", "mixtral": "LLAMA", "qwen3": "QWEN3", "qwen3_moe": "QWEN3MOE"}


def _error(folder: Path, what: str) -> ConfigError:
    return ConfigError(f"GGUF export of {folder}: {what}")


def check_type(gguf_type: str) -> None:
    if gguf_type not in GGUF_TYPES:
        why = " (K-quants: quantize the f16 file with llama.cpp's llama-quantize)" if "_k" in gguf_type.lower() else ""
        raise ConfigError(
            f"export.gguf_type={gguf_type!r} is not written here{why}; choose one of: {', '.join(GGUF_TYPES)}"
        )


def write_gguf(export: Path, out: Path, gguf_type: str = "f16", *, adapter: Path | None = None) -> Path:
    """export (a Hugging Face Llama, Mixtral, Qwen3 or Qwen3-MoE folder) as out/model-<type>.gguf with out/Modelfile
    beside it; with `adapter` (a PEFT LoRA folder on export) also out/adapter-f32.gguf, named by the Modelfile's
    ADAPTER; returns the model's file."""
    import gguf

    check_type(gguf_type)
    export, out = Path(export), Path(out)
    config = json.loads((export / "config.json").read_text())
    arch = architecture(export, config)  # before anything is written
    lora = _lora_tensors(Path(adapter), config) if adapter else None  # before anything is written
    pre = pre_tokenizer(export)  # before anything is written
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"model-{gguf_type}.gguf"
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    _write_parameters(writer, config, export, gguf_type)
    _write_vocab(writer, export, config, pre)
    for name, data, qtype in _tensors(export, config, gguf_type):
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    adapter_name = _write_lora(Path(adapter), out, arch, *lora).name if adapter else None
    (out / "Modelfile").write_text(modelfile(export, path.name, adapter_name))
    return path


def architecture(folder: Path, config: dict):
    """llama.cpp's architecture (a gguf.MODEL_ARCH) for the folder's config.json, or one line for what this writer or
    llama.cpp's architecture cannot say as transformers computes it."""
    import gguf

    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise _error(
            folder,
            f"model_type={model_type!r}: only Llama, Mixtral, Qwen3 and Qwen3-MoE are written as GGUF here "
            "(llama.cpp's converter, convert_hf_to_gguf.py, takes the other folders it knows)",
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if model_type.startswith("qwen3") and rope.get("rope_type", rope.get("type", "default")) != "default":
        raise _error(folder, f"a Qwen with rope_type={rope.get('rope_type', rope.get('type'))!r} is not written here")
    if model_type == "qwen3_moe":  # llama.cpp's qwen3moe: experts in every layer, top-k renormalized, no shared expert
        not_written = {
            "mlp_only_layers": (config.get("mlp_only_layers") or [], "dense layers"),
            "decoder_sparse_step": (config.get("decoder_sparse_step", 1), "dense layers between the MoE ones"),
            "shared_expert_intermediate_size": (config.get("shared_expert_intermediate_size") or 0, "a shared expert"),
        }
        for key, (value, what) in not_written.items():
            if value not in ([], 1, 0):
                raise _error(folder, f"{key}={value!r}: {what}, which llama.cpp's qwen3moe does not have")
        if not config.get("norm_topk_prob", False):
            raise _error(
                folder,
                "norm_topk_prob=false: llama.cpp's qwen3moe always renormalizes the top-k router probabilities",
            )
    return getattr(gguf.MODEL_ARCH, ARCHITECTURES[model_type])


def _experts(config: dict) -> int:
    """The routed expert count (Mixtral's num_local_experts; a Qwen MoE's num_experts, which transformers 5 saves
    as num_local_experts); 0 for a dense model."""
    return config.get("num_local_experts") or config.get("num_experts") or 0


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _write_parameters(writer, config: dict, export: Path, gguf_type: str) -> None:
    import gguf

    file_types = {"f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
    rope = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)}
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(export.resolve().parent.name if export.name == "export" else export.name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    writer.add_key_length(_head_dim(config))
    writer.add_value_length(_head_dim(config))
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config["model_type"] in ("llama", "mixtral"):  # the converter's LlamaModel adds these; its Qwen models do not
        writer.add_rope_dimension_count(_head_dim(config))
        writer.add_vocab_size(config["vocab_size"])
    if _experts(config):  # Mixtral: llama.cpp's llama architecture with experts; Qwen3-MoE: qwen3moe
        writer.add_expert_count(_experts(config))
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("moe_intermediate_size"):  # Qwen3-MoE's experts are narrower than intermediate_size
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_file_type(getattr(gguf.LlamaFileType, file_types[gguf_type]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_vocab(writer, export: Path, config: dict, pre: str) -> None:
    """tokenizer.ggml.*: a byte-level BPE's tokens and types as the converter lists them (every id below vocab_size;
    added tokens CONTROL when special, USER_DEFINED otherwise; ids without a token [PADn], UNUSED), its merges,
    special ids, add_bos/add_eos and the chat template (gguf.SpecialVocab)."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export, local_files_only=True)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    reverse = {i: token for token, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(config["vocab_size"]):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(reverse[i])
        if i in added:
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    quiet = logging.getLogger("gguf.vocab")  # its notes on a TemplateProcessing's pair template are not the user's
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        special = gguf.SpecialVocab(export, load_merges=True, n_vocab=config["vocab_size"])
    finally:
        quiet.setLevel(level)
    if not special.merges:
        raise _error(export, "its tokenizer has no BPE merges (only byte-level BPE tokenizers are written)")
    special.add_to_gguf(writer, quiet=True)


def pre_tokenizer(export: Path) -> str:
    """llama.cpp's name for the split of the folder's tokenizer (PRE_TOKENIZERS), or ConfigError: a byte-level BPE
    split by Llama 3's regex, Qwen2's, or by ByteLevel's own (GPT-2's)."""
    path = export / "tokenizer.json"
    if not path.is_file():
        raise _error(export, "no tokenizer.json (only byte-level BPE tokenizers are written)")
    spec = json.loads(path.read_text())
    if (spec.get("model") or {}).get("type") != "BPE":
        raise _error(export, f"a {(spec.get('model') or {}).get('type')} tokenizer (only byte-level BPE is written)")
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    regexes = [s["pattern"].get("Regex") for s in steps if s.get("type") == "Split"]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    own_regex = len(byte_level) == 1 and byte_level[0].get("use_regex", True)
    if own_regex and not regexes:
        regexes = ["gpt2"]
    elif own_regex:  # a Split, then ByteLevel splitting again: not a split llama.cpp has
        regexes = []
    if len(byte_level) != 1 or len(regexes) != 1 or regexes[0] not in PRE_TOKENIZERS:
        raise _error(
            export,
            "its pre-tokenizer is not one llama.cpp splits the same way here (Llama 3's split, Qwen2's, or byte-level "
            "BPE's GPT-2 regex)",
        )
    return PRE_TOKENIZERS[regexes[0]]


def _permute(weight, n_heads: int):
    """q_proj/k_proj rows from Hugging Face's RoPE layout (each head's first half, then its second) to llama.cpp's
    (the halves interleaved: row pairs rotate together), as convert_hf_to_gguf.py's LlamaModel.permute."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute(weight, n_heads: int):
    """_permute's inverse (the tests read a GGUF back to Hugging Face's layout)."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _tensors(export: Path, config: dict, gguf_type: str):
    """(llama.cpp name, numpy data, GGML type) of every tensor: the folder's safetensors renamed, a Llama's q/k
    permuted, an MoE layer's experts stacked into one tensor each (ffn_gate_exps, ffn_down_exps, ffn_up_exps,
    [experts, out, in], as the converter merges them), quantized; Llama 3's rope_freqs last."""
    import gguf
    import numpy as np

    names = gguf.get_tensor_name_map(architecture(export, config), config["num_hidden_layers"])
    experts: dict[str, dict[int, np.ndarray]] = {}  # merged name -> expert -> weight, until every expert is read
    for key, data in _hf_tensors(export, config):
        merged = _EXPERT.sub(".experts.", key)
        if merged != key:  # one expert's weight: stacked once the layer's last expert is read
            experts.setdefault(merged, {})[int(_EXPERT.search(key)[1])] = data
            if len(experts[merged]) < _experts(config):
                continue
            key, data = merged, np.stack([w for _, w in sorted(experts.pop(merged).items())])
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise _error(export, f"tensor {key} has no llama.cpp name")
        yield (name, *_quantized(data, gguf_type, router=name.endswith("ffn_gate_inp.weight")))
    factors = rope_factors(config)
    if factors is not None:
        name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        yield name, np.asarray(factors, np.float32), gguf.GGMLQuantizationType.F32


_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _hf_tensors(export: Path, config: dict):
    """(Hugging Face name, float32 numpy) of the folder's weights, a Llama's q_proj/k_proj rows in llama.cpp's order
    (a Qwen's as they are: llama.cpp's qwen3 and qwen3moe rotate NeoX style, as transformers)."""
    from safetensors import safe_open

    permute = config["model_type"] in ("llama", "mixtral")
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    for file in sorted(export.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if key.endswith("rotary_emb.inv_freq"):
                    continue
                data = f.get_tensor(key).float().numpy()
                if permute and key.endswith("q_proj.weight"):
                    data = _permute(data, heads)
                elif permute and key.endswith("k_proj.weight"):
                    data = _permute(data, kv_heads)
                yield key, data


def _quantized(data, gguf_type: str, router: bool = False):
    """(data, GGML type): vectors and the MoE router in F32 (as the converter keeps them), the rest in gguf_type; a
    tensor whose rows do not split into Q8_0's 32-wide blocks in F16, the converter's fallback."""
    import gguf

    types = gguf.GGMLQuantizationType
    qtype = {"f16": types.F16, "bf16": types.BF16, "q8_0": types.Q8_0}[gguf_type]
    if data.ndim == 1 or router:
        qtype = types.F32
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError:
        return gguf.quants.quantize(data, types.F16), types.F16


def rope_factors(config: dict) -> list[float] | None:
    """Llama 3's RoPE scaling as llama.cpp takes it: one divisor per frequency (rope_freqs), as the converter computes
    them from config.json's rope parameters; None without llama3 scaling."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return None
    dim, base = _head_dim(config), float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < context / high:
            factors.append(1.0)
        elif wavelen > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


# ---- a LoRA adapter ------------------------------------------------------------------------------

_PEFT_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")


def _lora_alpha(adapter: Path, lora: dict) -> float:
    """adapter.lora.alpha: what llama.cpp divides by the rank to scale B A as peft does (rsLoRA: alpha x sqrt(rank));
    one line for what llama.cpp's scale cannot say."""
    not_written = {
        "use_dora": "DoRA's magnitude vectors",
        "rank_pattern": "a rank per module",
        "alpha_pattern": "an alpha per module (llama.cpp has one alpha per adapter)",
    }
    for key, what in not_written.items():
        if lora.get(key):
            raise _error(adapter, f"{key}: {what} is not written as a GGUF LoRA")
    if lora.get("bias", "none") != "none" or lora.get("modules_to_save"):
        raise _error(adapter, "it trains weights besides LoRA's A and B (bias, modules_to_save): not a GGUF LoRA")
    alpha, rank = float(lora["lora_alpha"]), int(lora["r"])  # > 0 (lora.alpha's check): llama.cpp reads 0 as none
    return alpha * math.sqrt(rank) if lora.get("use_rslora") else alpha


def _lora_tensors(adapter: Path, config: dict):
    """(alpha, [(llama.cpp name, float32 numpy)]) of a PEFT LoRA folder on a Llama or a Qwen3: each adapted linear's A
    and B under its base tensor's name + .lora_a / .lora_b, a Llama's B rows in llama.cpp's q/k order (a Qwen3's as
    peft saved them, as its base's). Read before anything is written: one line for a folder llama.cpp cannot take."""
    import gguf
    from safetensors import safe_open

    if config.get("model_type") not in ("llama", "qwen3"):
        kind = config.get("model_type")
        raise _error(adapter, f"a LoRA on model_type={kind!r}: only a Llama's or a Qwen3's is written as GGUF")
    if not (adapter / "adapter_config.json").is_file() or not (adapter / "adapter_model.safetensors").is_file():
        raise _error(adapter, "not a PEFT LoRA folder (adapter_config.json, adapter_model.safetensors)")
    alpha = _lora_alpha(adapter, json.loads((adapter / "adapter_config.json").read_text()))
    names = gguf.get_tensor_name_map(architecture(adapter, config), config["num_hidden_layers"])
    heads = {"q_proj": config["num_attention_heads"]}
    heads["k_proj"] = config.get("num_key_value_heads") or heads["q_proj"]
    if config["model_type"] != "llama":  # a Qwen3's q/k rows stay in Hugging Face's order
        heads = {}
    pairs: dict[str, dict[str, object]] = {}
    with safe_open(adapter / "adapter_model.safetensors", framework="pt") as f:
        for key in sorted(f.keys()):
            match = _PEFT_KEY.fullmatch(key)
            if match is None:
                raise _error(adapter, f"tensor {key} is not a LoRA A or B weight (all a GGUF LoRA holds)")
            module, part = match.groups()
            name = names.get_name(module + ".weight", try_suffixes=(".weight",))
            if name is None or (name == "output.weight" and config.get("tie_word_embeddings")):
                raise _error(adapter, f"a LoRA on {module}: llama.cpp has no tensor for it")
            data = f.get_tensor(key).float().numpy()
            if part == "B" and module.rpartition(".")[2] in heads:
                data = _permute(data, heads[module.rpartition(".")[2]])
            pairs.setdefault(name, {})[part] = data
    if not pairs:
        raise _error(adapter, "its adapter_model.safetensors holds no LoRA weights")
    tensors = []
    for name, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise _error(adapter, f"the LoRA on {name} lacks its {'B' if 'A' in pair else 'A'}")
        tensors += [(f"{name}.lora_a", pair["A"]), (f"{name}.lora_b", pair["B"])]
    return alpha, tensors


def _write_lora(adapter: Path, out: Path, arch, alpha: float, tensors: list) -> Path:
    """out/adapter-f32.gguf: llama.cpp's LoRA adapter file of `tensors` (_lora_tensors), for a base of llama.cpp's
    architecture `arch` (llama.cpp refuses an adapter of another)."""
    import gguf

    path = out / "adapter-f32.gguf"
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    writer.add_name(adapter.resolve().parent.name if adapter.name == "export" else adapter.name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, data in tensors:
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---- the ollama Modelfile ------------------------------------------------------------------------

# ollama's Go template for Llama 3's chat format (the tests' tokenizer and Meta's): a header per message, the
# content, <|eot_id|>; then the assistant's header. ollama adds bos itself (tokenizer.ggml.add_bos_token).
LLAMA3_TEMPLATE = (
    "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n"
    "{{ .Content }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n"
)
CHATML_TEMPLATE = (
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
)


def modelfile(export: Path, gguf_name: str, adapter_name: str | None = None) -> str:
    """The ollama Modelfile of the GGUF beside it: FROM, ADAPTER (the LoRA adapter's GGUF, where there is one), the
    chat template in Go template syntax where the folder's
    is a known format (Llama 3, ChatML; another ollama reads from the file's tokenizer.chat_template; none: the prompt
    as it is), a stop per end-of-turn or end-of-text token, and the sampling parameters of generation_config.json."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export, local_files_only=True)
    chat = tokenizer.chat_template or ""
    lines = [f"FROM ./{gguf_name}"] + ([f"ADAPTER ./{adapter_name}"] if adapter_name else [])
    if "<|start_header_id|>" in chat and "<|eot_id|>" in chat:
        lines.append(f'TEMPLATE """{LLAMA3_TEMPLATE}"""')
    elif "<|im_start|>" in chat:
        lines.append(f'TEMPLATE """{CHATML_TEMPLATE}"""')
    elif chat:
        lines.append("# no TEMPLATE: ollama takes the chat template from the GGUF's tokenizer.chat_template")
    else:  # no chat template: the prompt as it is
        lines.append('TEMPLATE """{{ .Prompt }}"""')
    generation = {}
    if (export / "generation_config.json").is_file():
        generation = json.loads((export / "generation_config.json").read_text())
    eos = generation.get("eos_token_id", tokenizer.eos_token_id)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    stops = [tokenizer.convert_ids_to_tokens(i) for i in ids]
    stops += [t for t in ("<|eot_id|>", "<|im_end|>") if t in tokenizer.get_vocab() and t in chat]
    for stop in dict.fromkeys(stops):
        lines.append(f'PARAMETER stop "{stop}"')
    for key, name in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k")):
        if generation.get("do_sample") and key in generation:
            lines.append(f"PARAMETER {name} {generation[key]}")
    return "\n".join(lines) + "\n"
