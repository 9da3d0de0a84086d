"""Schemas of the LLM recipe's own config sections: `model` (a Llama, optionally MoE; see
recipes/llm/model.py:LlamaArgs), `parallel` (the ("pp", "dp", "tp") mesh, ep inside dp x cp) and `data` (packed token
rows)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from common.config import DataConfig, ParallelConfig, TrainConfig, check_family_sections, fill_from_checkpoint
from common.errors import ConfigError
from common.parallel_dims import check_ep_divides_dp

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# parallel.cp_method (its spec's cp_methods, the default first; common/compose.py fills and checks the key):
# recipes/llm/context_parallel.py.
CP_METHODS = ("allgather", "alltoall")
# finetune=lora (common/lora.py): the linears an adapter may target, all of them by default (recipes/llm/model.py's
# names; the export names them as Hugging Face does: q_proj, k_proj, v_proj, o_proj, gate_proj, down_proj, up_proj).
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


@dataclass
class RopeScalingConfig:
    rope_type: str = "default"  # default (plain RoPE) | llama3 (Llama 3.1+: the keys below, as in config.json)
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class MoEConfig:
    """model.moe.*: Mixture-of-Experts feed-forwards (recipes/llm/model.py:MoEArgs); num_experts 0 = a dense model."""

    num_experts: int = 0
    top_k: int = 2
    ffn_dim: int = 256  # each expert's SwiGLU width (HF moe_intermediate_size)
    norm_topk_prob: bool = True  # renormalize the chosen experts' probabilities (Mixtral: yes; Qwen: norm_topk_prob)
    shared_ffn_dim: int = 0  # an always-on shared expert of this width (Qwen2-MoE); 0 = none
    shared_gate: bool = True  # the shared expert's sigmoid gate (Qwen2-MoE)
    first_dense_layers: int = 0  # the first layers stay dense (Qwen's mlp_only_layers = 0..n-1)
    interval: int = 1  # then layer i is MoE iff (i + 1) % interval == 0 (Qwen's decoder_sparse_step)
    aux_loss_coef: float = 0.001  # load-balancing loss weight (transformers' router_aux_loss_coef); 0 = off
    z_loss_coef: float = 0.0  # router z-loss weight (ST-MoE uses 1e-3); 0 = off


@dataclass
class LLMModelConfig:
    # A local Hugging Face LlamaForCausalLM folder (config.json, *.safetensors, tokenizer): the keys
    # below then come from its config.json (a disagreeing command-line value stops the run), the
    # weights from its safetensors and the tokenizer from the folder. "" = random init.
    init_from: str = ""
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 344
    vocab_size: int = 0  # 0: the size of the data's tokenizer
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 256  # the longest row the model accepts (HF's max_position_embeddings)
    head_dim: int = 0  # 0: dim // n_heads
    tie_embeddings: bool = False  # the output projection is the input embedding (Llama 3.2 1B/3B)
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    qk_norm: bool = False  # Qwen3's RMSNorm on each query/key head
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2-MoE)
    moe: MoEConfig = field(default_factory=MoEConfig)
    loss_parallel: bool = False  # TP: keep logits sharded over the vocabulary for the loss


@dataclass
class MeshParallelConfig(ParallelConfig):
    """The LLM's layout (configs/parallel/mesh.yaml): FSDP2 over dp, tensor parallelism, pipeline stages, and
    expert parallelism inside dp x cp (ep of those ranks split the experts; common/parallel_dims.py)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1  # MoE: the experts split over this many of the dp x cp ranks (which still read different tokens)
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b
    pp_microbatches: int = 0  # 0 = pp


@dataclass
class LLMDataConfig(DataConfig):
    """Token shards, always packed into rows of max_seq_len with document masking."""

    max_seq_len: int = 256
    eval_docs: int = 64  # trainer.eval: the held-out loss over the val split's first eval_docs documents


# The model.* keys a checkpoint's config.json decides (LlamaArgs fields of the same name) -> its config.json key.
CHECKPOINT_KEYS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_dim": "intermediate_size",
    "vocab_size": "vocab_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "max_seq_len": "max_position_embeddings",
    "head_dim": "head_dim",
    "tie_embeddings": "tie_word_embeddings",
    "qk_norm": "qk_norm",
    "qkv_bias": "qkv_bias",
    "moe.num_experts": "num_experts",
    "moe.top_k": "num_experts_per_tok",
    "moe.ffn_dim": "moe_intermediate_size",
    "moe.norm_topk_prob": "norm_topk_prob",
    "moe.shared_ffn_dim": "shared_expert_intermediate_size",
    "moe.shared_gate": "shared_expert_gate",
    "moe.first_dense_layers": "mlp_only_layers",
    "moe.interval": "decoder_sparse_step",
}


# The schemas of this family's config groups (its spec's `config.SCHEMAS`): (group, name, dataclass), stored in
# Hydra's ConfigStore by common/compose.py; the group files name them in their defaults (`- llm_schema`).
SCHEMAS = [
    ("model", "llm_schema", LLMModelConfig),
    ("parallel", "llm_schema", MeshParallelConfig),
    ("data", "llm_schema", LLMDataConfig),
]


def complete(cfg: TrainConfig, command_line: set[str]) -> None:
    """With model.init_from: the model.* keys from the checkpoint's config.json, in place (so config.yaml,
    run.dry_run and the memory planner see the real model). ``command_line``: the keys the user set; one
    of them that disagrees with the checkpoint stops the run (the recipe preset's values are replaced)."""
    m = cfg.model
    if not isinstance(m, LLMModelConfig) or not m.init_from:
        return
    from recipes.llm.weights import checkpoint_args  # transformers: imported only for init_from runs

    m.init_from = str(Path(m.init_from).expanduser().absolute())
    args = checkpoint_args(m.init_from)
    scaling = args.rope_scaling
    moe = args.moe
    values = {key: getattr(args, key) for key in CHECKPOINT_KEYS if not key.startswith("moe.")}
    values["rope_scaling.rope_type"] = "llama3" if scaling else "default"
    if scaling is not None:
        values.update({f"rope_scaling.{k}": v for k, v in dataclasses.asdict(scaling).items()})
    # A dense checkpoint sets model.moe.num_experts=0 (the other moe.* keys then mean nothing).
    values["moe.num_experts"] = moe.num_experts if moe else 0
    if moe is not None:
        values.update({f"moe.{k}": v for k, v in dataclasses.asdict(moe).items()})
    named = {key: (CHECKPOINT_KEYS.get(key, key), value) for key, value in values.items()}
    fill_from_checkpoint(m, named, command_line, m.init_from)


def validate(cfg: TrainConfig) -> None:
    m, p = cfg.model, cfg.parallel
    if not isinstance(m, LLMModelConfig):
        raise ConfigError("recipe.family=llm needs a model=llm_* config group")
    check_family_sections(
        cfg,
        "LLM",
        parallel=MeshParallelConfig,
        layouts="FSDP2 over parallel.dp, tensor, pipeline and expert parallelism "
        "(parallel=mesh: parallel.dp/tp/pp/ep), not DeepSpeed ZeRO",
        data=LLMDataConfig,
        datasets="pydoc_text, text_shards, chat_shards, preference_shards or prompt_shards (token shards)",
    )
    for key in ("tp", "pp", "ep"):
        if getattr(p, key) <= 0:
            raise ConfigError(f"parallel.{key}={getattr(p, key)} must be > 0")
    if p.pp_schedule not in PP_SCHEDULES:
        raise ConfigError(
            f"parallel.pp_schedule={p.pp_schedule!r} is not allowed; choose one of: {', '.join(PP_SCHEDULES)}"
        )
    if cfg.data.max_seq_len <= 0:
        raise ConfigError(f"data.max_seq_len={cfg.data.max_seq_len} must be > 0")
    if cfg.data.eval_docs <= 0:
        raise ConfigError(f"data.eval_docs={cfg.data.eval_docs} must be > 0 (trainer.eval=false turns the eval off)")
    check_model(cfg)
    check_pipeline(cfg)
    check_context_parallel(cfg)
    if cfg.data.max_seq_len > m.max_seq_len:
        # With init_from, model.max_seq_len is the checkpoint's max_position_embeddings: rows longer
        # than the positions it was trained on are refused rather than extrapolated.
        source = f" (max_position_embeddings of model.init_from={m.init_from})" if m.init_from else ""
        raise ConfigError(f"data.max_seq_len={cfg.data.max_seq_len} exceeds model.max_seq_len={m.max_seq_len}{source}")
    check_finetune_and_toggles(cfg)
    check_preference_layout(cfg)
    check_grpo_layout(cfg)
    check_gguf_export(cfg)


def check_gguf_export(cfg: TrainConfig) -> None:
    """export.gguf_type, and export.formats=[gguf] against the model: what recipes/llm/gguf_export.py writes (a Llama,
    a Mixtral, a Qwen3 or a Qwen3-MoE with experts in every layer and the top-k renormalized, as llama.cpp's qwen3moe
    computes it; under finetune=lora the merged model with export.merge_lora, else the base and the adapter as a GGUF
    LoRA)."""
    from recipes.llm.gguf_export import check_type, pre_tokenizer

    check_type(cfg.export.gguf_type)
    if "gguf" not in cfg.export.formats:
        return
    m, moe = cfg.model, cfg.model.moe
    kind = None
    if m.qkv_bias or moe.shared_ffn_dim:
        kind = "a Qwen2 or Qwen2-MoE (model.qkv_bias, model.moe.shared_ffn_dim)"
    elif moe.num_experts and (moe.first_dense_layers or moe.interval != 1):
        kind = "an MoE with dense layers (model.moe.first_dense_layers, model.moe.interval), which llama.cpp's "
        kind += "qwen3moe and Mixtral's layout do not have"
    elif moe.num_experts and not moe.norm_topk_prob:
        kind = "an MoE without top-k renormalization (model.moe.norm_topk_prob=false), which llama.cpp's qwen3moe and "
        kind += "Mixtral's layout always do"
    if kind:
        raise ConfigError(
            f"export.formats=[gguf]: this run's model is {kind}; only Llama, Mixtral, Qwen3 and Qwen3-MoE are written "
            "as GGUF here (llama.cpp's convert_hf_to_gguf.py converts the export folder)"
        )
    if m.init_from and Path(m.init_from).expanduser().is_dir():  # its tokenizer goes into the file: one llama.cpp has
        pre_tokenizer(Path(m.init_from).expanduser())


def check_grpo_layout(cfg: TrainConfig) -> None:
    """GRPO (recipes/llm/grpo.py) runs on dp (FSDP2) x tp ranks, with any trainer.grad_accum, where a rank's logits
    are whole rows of the full vocabulary (not split over pipeline stages, context-parallel ranks or, under loss
    parallel, vocabulary shards), in float32 (the engine's dtype: the probe check compares float32 log-probs), full
    fine-tuning or LoRA (not QLoRA) of a dense model."""
    if not cfg.grpo.enabled:
        return
    p, m = cfg.parallel, cfg.model
    if cfg.preference.enabled:
        raise ConfigError(f"grpo.enabled=true and preference.loss={cfg.preference.loss}: choose one objective")
    for key, degree in (("pp", p.pp), ("cp", p.cp), ("ep", p.ep)):
        if degree > 1:
            raise ConfigError(f"grpo.enabled=true does not run with parallel.{key}={degree} yet (use dp and tp)")
    not_yet = {
        "model.loss_parallel=true under tp>1": m.loss_parallel and p.tp > 1,
        "lora.quantize_base=nf4 (the engine serves the base unquantized)": cfg.lora.quantize_base != "none",
        f"toggles.precision={cfg.toggles.precision} (float32 only: the engine's dtype)": cfg.toggles.precision
        != "fp32",
        "an MoE model (model.moe.num_experts>0)": bool(m.moe.num_experts),
    }
    for what, refused in not_yet.items():
        if refused:
            raise ConfigError(f"grpo.enabled=true does not run with {what} yet")


def check_preference_layout(cfg: TrainConfig) -> None:
    """Preference optimization (recipes/llm/preference.py) runs where a rank's logits are whole rows of the full
    vocabulary: not yet split over pipeline stages, context-parallel ranks, or (loss parallel) vocabulary shards."""
    p, loss = cfg.parallel, cfg.preference.loss
    if not loss:
        return
    for key, degree in (("pp", p.pp), ("cp", p.cp)):
        if degree > 1:
            raise ConfigError(f"preference.loss={loss} does not run with parallel.{key}={degree} yet (use dp and tp)")
    if cfg.model.loss_parallel and p.tp > 1:
        raise ConfigError(f"preference.loss={loss} does not run with model.loss_parallel=true under tp>1 yet")
    if cfg.model.moe.num_experts:
        raise ConfigError(f"preference.loss={loss} does not run on an MoE model (model.moe.num_experts>0) yet")


def check_model(cfg: TrainConfig) -> None:
    """model.*'s shape against itself and the mesh (tensor and expert parallelism), and the MoE's keys."""
    m, p = cfg.model, cfg.parallel
    if m.rope_scaling.rope_type not in ("default", "llama3"):
        raise ConfigError(
            f"model.rope_scaling.rope_type={m.rope_scaling.rope_type!r} is not allowed; choose default or llama3"
        )
    if not m.head_dim and m.dim % m.n_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} must divide model.dim={m.dim} (or set model.head_dim)")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} must be a multiple of model.n_kv_heads={m.n_kv_heads}")
    if m.n_kv_heads % p.tp or m.ffn_dim % p.tp:
        raise ConfigError(
            f"parallel.tp={p.tp} must divide model.n_kv_heads={m.n_kv_heads} and model.ffn_dim={m.ffn_dim}"
        )
    if p.ep > 1 and not m.moe.num_experts:
        raise ConfigError(
            f"parallel.ep={p.ep} needs an MoE model (model.moe.num_experts > 0): a dense model has no experts to split"
        )
    if p.dp > 0:
        check_ep_divides_dp(p.ep, p.dp, p.cp)
    if m.moe.num_experts:
        validate_moe(cfg)
    elif m.qkv_bias:
        raise ConfigError(
            "model.qkv_bias=true without MoE (dense Qwen2) is not supported; it goes with model.moe.shared_ffn_dim"
        )


def check_pipeline(cfg: TrainConfig) -> None:
    """parallel.pp > 1: enough layers for the schedule's stages, and what the pipeline does not compose with yet."""
    m, p = cfg.model, cfg.parallel
    if p.pp <= 1:
        return
    stages = p.pp * (2 if p.pp_schedule == "interleaved_1f1b" else 1)
    if m.n_layers < stages:
        raise ConfigError(
            f"parallel.pp={p.pp} with pp_schedule={p.pp_schedule} needs {stages} pipeline stages "
            f"but model.n_layers={m.n_layers}"
        )
    if m.loss_parallel:
        raise ConfigError("model.loss_parallel is not supported with parallel.pp>1 yet")
    if p.pp_microbatches < 0:
        raise ConfigError("parallel.pp_microbatches must be >= 0 (0 = parallel.pp)")
    if p.pp_schedule == "interleaved_1f1b" and (p.pp_microbatches or p.pp) % p.pp:
        raise ConfigError(
            "parallel.pp_schedule=interleaved_1f1b needs parallel.pp_microbatches divisible by parallel.pp"
        )


def check_finetune_and_toggles(cfg: TrainConfig) -> None:
    """finetune=lora (and QLoRA) and the toggles against the layout: what the LLM recipe does not offer (yet)."""
    m, p = cfg.model, cfg.parallel
    if cfg.finetune == "lora" and not m.init_from and not cfg.run.dry_run:  # sizing reads no weights
        raise ConfigError(
            "finetune=lora trains an adapter on a base checkpoint: set model.init_from=<a Hugging Face Llama folder>"
        )
    if cfg.finetune == "lora" and p.tp > 1:
        # peft wraps nn.Linear; tensor parallelism would need its own styles for lora_A/lora_B (A replicated
        # beside a column-sharded base, row-sharded beside wo/w2) and DTensor-aware merging: not done yet.
        raise ConfigError(
            f"finetune=lora with parallel.tp={p.tp}: LoRA runs under FSDP2 (parallel.dp) and pipeline "
            "parallelism (parallel.pp), not tensor parallelism yet (parallel.tp=1)"
        )
    check_qlora_layout(cfg, max(p.dp, 1), p.tp, p.pp)  # dp=-1 (the world's) is checked again once it is known
    if cfg.lora.quantize_base == "nf4" and cfg.toggles.compile:
        raise ConfigError(
            "lora.quantize_base=nf4 with toggles.compile=true is not supported yet: torch.compile of the "
            "NF4 weights is untested here; use toggles.compile=false"
        )
    if cfg.finetune == "lora" and m.moe.num_experts:
        # The experts are stacked weights, not linears: adapters on them need peft's target_parameters, and a
        # PEFT folder for Mixtral/Qwen-MoE names per-expert modules. Not done yet.
        raise ConfigError(
            f"finetune=lora on an MoE model (model.moe.num_experts={m.moe.num_experts}) is not supported yet; "
            "LoRA fine-tunes dense models"
        )
    if cfg.toggles.precision == "fp16":
        # Loss-scaled fp16 under FSDP2 (a sharded grad scaler) is not implemented; bf16 needs no scaling.
        raise ConfigError("toggles.precision=fp16 is not offered by the LLM recipe; use bf16 (or fp32)")
    if cfg.toggles.precision == "fp8" and p.tp > 1:
        # torchao's float8 linears need their own tensor-parallel styles (Float8ColwiseParallel, ...).
        raise ConfigError(
            f"toggles.precision=fp8 with parallel.tp={p.tp}: the LLM recipe converts to fp8 without "
            "tensor parallelism only (parallel.tp=1)"
        )
    if cfg.toggles.attention == "eager":
        raise ConfigError(
            "toggles.attention=eager is not in the LLM recipe: its own Llama runs sdpa (a dense mask) "
            "or flash (the varlen kernel on packed rows)"
        )


def check_context_parallel(cfg: TrainConfig) -> None:
    """parallel.cp / cp_method: what the LLM's context parallelism composes with (one line for what it does not); the
    method is one of CP_METHODS already (common/compose.py)."""
    p, cp = cfg.parallel, cfg.parallel.cp
    if cp == 1:
        return
    if cfg.data.max_seq_len % (2 * cp):
        raise ConfigError(
            f"data.max_seq_len={cfg.data.max_seq_len} must be divisible by 2*parallel.cp={2 * cp}: each row is cut "
            "into 2*cp equal chunks, cp rank r holding chunks r and 2*cp-1-r (the causal load balance)"
        )
    m, attention = cfg.model, cfg.toggles.attention
    kv_heads = m.n_kv_heads // p.tp
    if p.cp_method == "alltoall" and kv_heads % cp:
        raise ConfigError(
            f"parallel.cp={cp} with parallel.cp_method=alltoall needs cp to divide the key/value heads per tp rank "
            f"(model.n_kv_heads={m.n_kv_heads} / parallel.tp={p.tp} = {kv_heads}): each cp rank attends with whole "
            "heads; cp_method=allgather has no such limit"
        )
    if attention == "flash" and p.pp > 1:
        raise ConfigError(
            f"parallel.cp={cp} with toggles.attention={attention} is not supported yet: under parallel.pp>1 the "
            "pipeline's stages take the cp ranks' dense mask rows; the varlen segments are built outside the stages "
            "(toggles.attention=sdpa runs cp x pp)"
        )


def check_qlora_layout(cfg: TrainConfig, dp: int, tp: int, pp: int) -> None:
    if cfg.lora.quantize_base == "nf4" and (dp, tp, pp) != (1, 1, 1):
        # FSDP2 would have to shard and gather NF4 tensors (torchao implements it, Kiln does not wire it yet).
        raise ConfigError(
            f"lora.quantize_base=nf4 runs on one GPU (parallel.dp=1, tp=1, pp=1); this run has "
            f"dp={dp}, tp={tp}, pp={pp}"
        )


def validate_moe(cfg: TrainConfig) -> None:
    """model.moe.* (model.moe.num_experts > 0): each bad value or combination in one line."""
    m, moe, p = cfg.model, cfg.model.moe, cfg.parallel
    if moe.num_experts < 0:
        raise ConfigError(f"model.moe.num_experts={moe.num_experts} must be >= 0 (0 = a dense model)")
    if not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.num_experts={moe.num_experts}")
    for key in ("ffn_dim", "shared_ffn_dim", "first_dense_layers"):
        if getattr(moe, key) < 0 or (key == "ffn_dim" and not moe.ffn_dim):
            raise ConfigError(f"model.moe.{key}={getattr(moe, key)} must be {'> 0' if key == 'ffn_dim' else '>= 0'}")
    # torch._grouped_mm needs 16-byte aligned rows: 8 elements in bf16.
    for key, value in (("model.moe.ffn_dim", moe.ffn_dim), ("model.dim", m.dim)):
        if value % 8:
            raise ConfigError(f"{key}={value} must be a multiple of 8 with MoE (the experts' grouped GEMM alignment)")
    if moe.interval < 1:
        raise ConfigError(f"model.moe.interval={moe.interval} must be >= 1")
    if not any(i >= moe.first_dense_layers and (i + 1) % moe.interval == 0 for i in range(m.n_layers)):
        raise ConfigError(
            f"model.moe.first_dense_layers={moe.first_dense_layers} and model.moe.interval={moe.interval} "
            f"leave no MoE layer among model.n_layers={m.n_layers}"
        )
    for key in ("aux_loss_coef", "z_loss_coef"):
        if getattr(moe, key) < 0:
            raise ConfigError(f"model.moe.{key}={getattr(moe, key)} must be >= 0")
    if moe.num_experts % p.ep:
        raise ConfigError(
            f"parallel.ep={p.ep} must divide model.moe.num_experts={moe.num_experts} (each ep rank holds "
            "num_experts / ep experts)"
        )
    if p.tp > 1:
        raise ConfigError(
            f"parallel.tp={p.tp} with model.moe.num_experts={moe.num_experts}: the MoE layers have no "
            "tensor-parallel plan (parallel.ep splits the experts instead) yet"
        )
    if cfg.toggles.precision == "fp8":
        raise ConfigError(
            "toggles.precision=fp8 with model.moe.num_experts>0: the experts' grouped GEMM has no fp8 path"
        )
    if cfg.toggles.compile and cfg.toggles.precision != "bf16":
        # torch.compile traces torch._grouped_mm through its meta kernel, which takes bf16 only (torch 2.13; eager
        # runs fp32 too): checked here, fp32 stops in the trace, bf16 trains (ep=2 included).
        raise ConfigError(
            f"toggles.compile=true with model.moe.num_experts>0 needs toggles.precision=bf16 (got "
            f"{cfg.toggles.precision}): the experts' grouped GEMM compiles in bf16 only"
        )
    if p.ep > 1 and cfg.toggles.activation_checkpointing == "selective":
        # The experts are an FSDP2 unit of their own inside each checkpointed block: its hooks run other ops in the
        # recompute than in the forward, and selective AC replays a forward's ops by position. Full AC does not.
        raise ConfigError(
            f"toggles.activation_checkpointing=selective with parallel.ep={p.ep} is not supported yet; "
            "use toggles.activation_checkpointing=full"
        )
    from recipes.llm.hf_adapter import hf_model_type
    from recipes.llm.model import LlamaArgs, MoEArgs

    try:  # every model is exported in a Hugging Face format: refuse one that has none
        hf_model_type(
            LlamaArgs(
                dim=8,
                n_layers=m.n_layers,
                n_heads=1,
                n_kv_heads=1,
                qk_norm=m.qk_norm,
                qkv_bias=m.qkv_bias,
                moe=MoEArgs(
                    num_experts=moe.num_experts,
                    top_k=moe.top_k,
                    ffn_dim=8,
                    norm_topk_prob=moe.norm_topk_prob,
                    shared_ffn_dim=moe.shared_ffn_dim,
                    shared_gate=moe.shared_gate,
                    first_dense_layers=moe.first_dense_layers,
                    interval=moe.interval,
                ),
            )
        )
    except ValueError as exc:
        raise ConfigError(f"model.moe: no Hugging Face architecture to export to: {exc}") from None
