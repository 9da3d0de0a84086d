"""Hugging Face folders in and out of the LLM recipe (Llama, Qwen3, and the MoEs Mixtral, Qwen3-MoE, Qwen2-MoE):
model.init_from's config.json as LlamaArgs (refusing what the model does not implement), sharded loading of its
safetensors, its tokenizer, and the export folder.

Loading reads only what each rank holds: the model is built on meta, split/parallelized, materialized
empty, and ``torch.distributed.checkpoint.load`` with ``HuggingFaceStorageReader`` fills the sharded
state dict (keys renamed by the adapter in recipes/llm/hf_adapter.py), each rank reading its own slices of
each tensor from the safetensors files (``get_slice``) and converting them to the parameters' dtype.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.errors import ConfigError, DataError
from common.lora import base_key, is_adapter_key
from common.weights import check_folder
from recipes.llm.hf_adapter import (
    HF_ARCHITECTURES,
    from_hf_state_dict,
    hf_model_type,
    is_expert_key,
    to_hf_config,
    to_hf_state_dict,
)
from recipes.llm.model import Llama3RopeScaling, LlamaArgs, MoEArgs, Transformer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

WEIGHT_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # a folder needs one of them
# What an export copies from the source folder: everything at its top level but the weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
_WEIGHT_INDEXES = (WEIGHT_INDEX, "pytorch_model.bin.index.json")
_IGNORED_WEIGHTS = ("rotary_emb.inv_freq",)  # older checkpoints saved the RoPE frequencies
# Model types people will try whose architecture Kiln's model lacks: what is missing, in a few words.
_UNSUPPORTED_TYPES = {
    "deepseek_v2": "multi-head latent attention and a sigmoid/grouped router are not implemented",
    "deepseek_v3": "multi-head latent attention and a sigmoid router with expert bias are not implemented",
    "olmoe": "its q/k RMSNorm over the whole projection (not per head) is not implemented",
    "qwen2": "dense Qwen2 (q/k/v biases without MoE) is not supported",
    "mistral": "Mistral's sliding-window attention is not implemented",
}


def _error(folder: Path | str, what: str) -> ConfigError:
    return ConfigError(f"model.init_from={folder}: {what}")


# ---- the folder and its config.json -------------------------------------------------------------


def checkpoint_args(folder: str | Path) -> LlamaArgs:
    """The architecture of the model in ``folder`` (one of HF_ARCHITECTURES), after checking that Kiln's Llama
    implements all of it and that its safetensors hold exactly its weights. ConfigError (one line) otherwise."""
    folder = Path(folder)
    config = _hf_config(folder)
    try:
        args = llama_args_from_hf(config)
    except ValueError as exc:  # e.g. a width the grouped GEMM cannot take
        raise _error(folder, f"config.json: {exc}") from None
    weights = safetensors_weights(folder)
    with torch.device("meta"):  # the weights this architecture has, under their Hugging Face names
        expected = {k: tuple(t.shape) for k, t in to_hf_state_dict(Transformer(args).state_dict(), args).items()}
    missing = sorted(expected.keys() - weights.keys())
    if missing:
        raise _error(
            folder,
            f"its safetensors lack {len(missing)} of the {len(expected)} weights its config.json "
            f"describes (first: {missing[0]})",
        )
    extra = sorted(
        k
        for k in weights.keys() - expected.keys()
        if not k.endswith(_IGNORED_WEIGHTS) and not (k == "lm_head.weight" and args.tie_embeddings)
    )
    if extra:
        raise _error(
            folder,
            f"{len(extra)} weights that a {HF_ARCHITECTURES[hf_model_type(args)]} does not have "
            f"(first: {extra[0]}); not supported",
        )
    for key, shape in expected.items():
        if weights[key][0] != shape:
            raise _error(folder, f"{key} has shape {list(weights[key][0])} but config.json implies {list(shape)}")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise _error(folder, f"no tokenizer ({' or '.join(TOKENIZER_FILES)}) in the folder")
    return args


def _hf_config(folder: Path):
    """The folder's transformers config, or ConfigError naming what makes it unusable or unsupported."""
    if not folder.is_dir():
        raise _error(folder, "no such directory")
    if (folder / "config.yaml").is_file() and (folder / "checkpoints").is_dir():
        raise _error(
            folder,
            f"a Kiln run dir, not a Hugging Face model folder; fine-tune from its export "
            f"(model.init_from={folder / 'export'}, see scripts/export.py) or continue it with run.resume",
        )
    if not (folder / "config.json").is_file():
        kind = " (a diffusers export: a DiT, not a Llama)" if (folder / "transformer").is_dir() else ""
        raise _error(folder, f"no config.json, so not a Hugging Face model folder{kind}")
    try:
        raw = json.loads((folder / "config.json").read_text())
    except ValueError as exc:
        raise _error(folder, f"config.json is not valid JSON ({exc})") from None
    model_type = raw.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        why = f": {_UNSUPPORTED_TYPES[model_type]}" if model_type in _UNSUPPORTED_TYPES else ""
        raise _error(
            folder,
            f"model_type={model_type!r} in config.json is not supported{why} "
            f"(supported: {', '.join(HF_ARCHITECTURES)})",
        )
    architecture = HF_ARCHITECTURES[model_type]
    architectures = raw.get("architectures") or [architecture]
    if architecture not in architectures:
        raise _error(
            folder,
            f"architectures={architectures} is not supported (only {architecture} for model_type={model_type!r})",
        )

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, local_files_only=True)  # also reads legacy rope_scaling
    rope = config.rope_parameters or {}
    unsupported = {
        "rope_type": (rope.get("rope_type", "default"), ("default", "llama3")),
        "partial_rotary_factor": (rope.get("partial_rotary_factor", 1.0), (1.0,)),
        "attention_bias": (getattr(config, "attention_bias", False), (False,)),
        "mlp_bias": (getattr(config, "mlp_bias", False), (False,)),
        "hidden_act": (config.hidden_act, ("silu",)),
        "attention_dropout": (getattr(config, "attention_dropout", 0.0), (0.0,)),  # Kiln's Llama has no dropout
        "quantization_config": (raw.get("quantization_config"), (None,)),
        # Sliding-window attention (Mixtral's sliding_window; the Qwens' use_sliding_window) is not implemented.
        "sliding_window": (getattr(config, "sliding_window", None) if model_type == "mixtral" else None, (None,)),
        "use_sliding_window": (getattr(config, "use_sliding_window", False), (False,)),
        "router_jitter_noise": (getattr(config, "router_jitter_noise", 0.0), (0.0,)),  # Mixtral's training-time noise
    }
    if model_type in ("qwen3_moe", "qwen2_moe"):
        layers = list(config.mlp_only_layers or [])
        # Kiln's dense layers come first (moe.first_dense_layers): mlp_only_layers must be 0..n-1.
        unsupported["mlp_only_layers"] = (layers, (list(range(len(layers))),))
        if config.num_experts <= 0:
            raise _error(folder, f"num_experts={config.num_experts} in config.json: no MoE layer (not supported)")
    for key, (value, allowed) in unsupported.items():
        if value not in allowed:
            shown = f"rope_scaling type {value!r}" if key == "rope_type" else f"{key}={value!r}"
            raise _error(
                folder, f"{shown} in config.json is not supported (supported: {', '.join(map(repr, allowed))})"
            )
    return config


def llama_args_from_hf(config) -> LlamaArgs:
    """A (checked) transformers config as Kiln's LlamaArgs; to_hf_config is the way back."""
    rope = config.rope_parameters
    scaling = None
    if rope.get("rope_type", "default") == "llama3":
        scaling = Llama3RopeScaling(
            factor=rope["factor"],
            low_freq_factor=rope["low_freq_factor"],
            high_freq_factor=rope["high_freq_factor"],
            original_max_position_embeddings=rope["original_max_position_embeddings"],
        )
    model_type = config.model_type
    moe = None
    if model_type == "mixtral":
        moe = MoEArgs(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            ffn_dim=config.intermediate_size,
            norm_topk_prob=True,
        )
    elif model_type in ("qwen3_moe", "qwen2_moe"):
        moe = MoEArgs(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            ffn_dim=config.moe_intermediate_size,
            norm_topk_prob=bool(config.norm_topk_prob),
            shared_ffn_dim=getattr(config, "shared_expert_intermediate_size", 0),
            shared_gate=True,
            first_dense_layers=len(config.mlp_only_layers or []),
            interval=config.decoder_sparse_step,
        )
    return LlamaArgs(
        dim=config.hidden_size,
        n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        vocab_size=config.vocab_size,
        ffn_dim=config.intermediate_size,
        norm_eps=config.rms_norm_eps,
        rope_theta=rope["rope_theta"],
        max_seq_len=config.max_position_embeddings,
        tie_embeddings=bool(config.tie_word_embeddings),
        head_dim=getattr(config, "head_dim", None) or 0,
        rope_scaling=scaling,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        qkv_bias=model_type == "qwen2_moe" and bool(config.qkv_bias),
        moe=moe,
    )


def safetensors_weights(folder: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor in the folder's *.safetensors (headers only, each checked against its
    file: no data read)."""
    from safetensors.torch import _getdtype

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in folder.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
        raise _error(
            folder,
            "no *.safetensors weights" + (f" (found {', '.join(found)}: only safetensors are read)" if found else ""),
        )
    index = folder / WEIGHT_INDEX
    if index.is_file():
        named = set(json.loads(index.read_text()).get("weight_map", {}).values())
        absent = sorted(named - {p.name for p in files})
        if absent:
            raise _error(folder, f"{WEIGHT_INDEX} names {len(absent)} missing file(s) (first: {absent[0]})")
    headers = check_folder(folder, f"model.init_from={folder}")  # one line for a file cut short (common/weights.py)
    return {
        key: (tuple(entry["shape"]), _getdtype(entry["dtype"]))
        for tensors in headers.values()
        for key, entry in tensors.items()
    }


def weights_dtype(folder: str | Path) -> torch.dtype:
    """The dtype of the checkpoint's weights on disk (the embedding's, if they are mixed)."""
    weights = safetensors_weights(Path(folder))
    return weights.get("model.embed_tokens.weight", next(iter(weights.values())))[1]


# ---- tokenizer ----------------------------------------------------------------------------------


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def check_same_tokenizer(data_tokenizer, checkpoint_tokenizer, data_root: str, folder: str) -> None:
    """DataError (one line) unless the data was tokenized with the checkpoint's tokenizer: the same
    vocabulary (added tokens included) and the same bos/eos ids."""
    a, b = data_tokenizer, checkpoint_tokenizer
    differs = [
        f"{name}_token_id {getattr(a, f'{name}_token_id')} vs {getattr(b, f'{name}_token_id')}"
        for name in ("bos", "eos")
        if getattr(a, f"{name}_token_id") != getattr(b, f"{name}_token_id")
    ]
    if len(a) != len(b):
        differs.insert(0, f"{len(a)} vs {len(b)} tokens")
    elif not differs and a.get_vocab() != b.get_vocab():
        differs.append("the same size but different tokens")
    if differs:
        raise DataError(
            f"data.root={data_root} was tokenized with another tokenizer than model.init_from={folder} "
            f"({'; '.join(differs)}); tokenize the data with the checkpoint's tokenizer "
            f"(the prepare_text builder: --tokenizer {folder} ...)"
        )


# ---- weights in: each rank reads its own slices --------------------------------------------------


def _tensor_at_a_time_reader(folder: str | Path):
    """torch's HuggingFaceStorageReader, mapping a safetensors file once per tensor instead of once per
    file. The reader copies each slice out of the memory-mapped file; the pages it touched stay resident
    (in the rank's RSS) until the file is unmapped, which per file means up to a whole shard (5 GB in
    released checkpoints) on top of the rank's weights. Per tensor, at most one tensor's pages are."""
    from safetensors import safe_open
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.futures import Future

    class Reader(HuggingFaceStorageReader):
        def read_data(self, plan, planner) -> Future:
            for item in plan.items:
                with safe_open(self.storage_data[item.storage_index].relative_path, framework="pt") as f:
                    self._process_read_request(f, item, planner)
            done: Future = Future()
            done.set_result(None)
            return done

    return Reader(str(folder))


def load_weights(model: Transformer, args: LlamaArgs, folder: str | Path) -> None:
    """Fill the (sharded, materialized) model from the safetensors in ``folder``: every rank reads only
    the slices of the tensors it holds, converted to its parameters' dtype (bf16 on disk -> fp32 master)."""
    import torch.distributed as tdist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    state = get_model_state_dict(model)
    # Under finetune=lora the checkpoint fills the base: a wrapped linear's weight under its own name (common/lora.py).
    names = {base_key(k): k for k in state if not is_adapter_key(k)}
    base = {k: state[v] for k, v in names.items()}
    hf_state = to_hf_state_dict(base, args)
    dcp.load(hf_state, storage_reader=_tensor_at_a_time_reader(folder), no_dist=not tdist.is_initialized())
    # The adapter back: the pipeline stage holding a tied output projection also gets its own entry. The
    # experts' per-expert entries were views of the stacked weights this rank holds: DCP wrote them in place.
    dense = {k for k in base if not is_expert_key(k)}
    loaded = from_hf_state_dict(to_hf_state_dict({k: base[k] for k in dense}, args), args)
    set_model_state_dict(
        model, {names[k]: loaded[k] for k in dense}, options=StateDictOptions(strict=len(dense) == len(state))
    )


# ---- the export folder --------------------------------------------------------------------------


def write_hf_folder(
    state_dict: dict[str, torch.Tensor],
    args: LlamaArgs,
    out: Path,
    *,
    tokenizer: PreTrainedTokenizerBase,
    source: str | Path | None = None,
) -> None:
    """A Hugging Face folder (:func:`hf_model_type`'s architecture) from a full (consolidated, CPU) Kiln state dict.

    With ``source`` (the run's model.init_from) the folder keeps the source's own files (config.json with
    its rope_scaling, tie and token ids, generation_config.json, tokenizer and chat template, license)
    and its weights' dtype, so a checkpoint that went through Kiln unchanged comes back bit for bit.
    Without, the config is derived from ``args`` and the tokenizer's ids, and the weights stay fp32.
    """
    from huggingface_hub import save_torch_state_dict
    from transformers import GenerationConfig

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    dtype = weights_dtype(source) if source else None
    hf_state = to_hf_state_dict(state_dict, args)
    for key in list(hf_state):  # converted one tensor at a time: no second full copy
        t = hf_state[key].detach().to(dtype or hf_state[key].dtype).contiguous()
        # An expert's slice is a view of its stacked weight: safetensors refuses tensors that share memory.
        hf_state[key] = t.clone() if t.untyped_storage().nbytes() != t.nbytes else t
    save_torch_state_dict(hf_state, out, max_shard_size="5GB", metadata={"format": "pt"})
    if source:
        for path in Path(source).iterdir():
            if path.is_file() and path.suffix not in _WEIGHT_SUFFIXES and path.name not in _WEIGHT_INDEXES:
                shutil.copy2(path, out / path.name)
        return
    config = to_hf_config(
        args,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures, config.dtype = [HF_ARCHITECTURES[hf_model_type(args)]], torch.float32  # as save_pretrained
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
