"""Schema of the LLM recipe's `model` section (a Llama; see recipes/llm/model.py:LlamaArgs)."""

from __future__ import annotations

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

from common.config import TrainConfig
from common.errors import ConfigError


@dataclass
class LLMModelConfig:
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 344
    vocab_size: int = 0  # 0: the size of the data's tokenizer
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 256
    loss_parallel: bool = False  # TP: keep logits sharded over the vocabulary for the loss


def register() -> None:
    ConfigStore.instance().store(group="model", name="llm_schema", node=LLMModelConfig)


def validate(cfg: TrainConfig) -> None:
    m, p = cfg.model, cfg.parallel
    if not isinstance(m, LLMModelConfig):
        raise ConfigError("recipe.family=llm needs a model=llm_* config group")
    if m.dim % m.n_heads or m.n_heads % m.n_kv_heads:
        raise ConfigError("model.n_heads must divide model.dim and be a multiple of model.n_kv_heads")
    if m.n_kv_heads % p.tp or m.ffn_dim % p.tp:
        raise ConfigError(f"parallel.tp={p.tp} must divide model.n_kv_heads={m.n_kv_heads} and model.ffn_dim={m.ffn_dim}")
    if p.pp > 1:
        stages = p.pp * (2 if p.pp_schedule == "interleaved_1f1b" else 1)
        if m.n_layers < stages:
            raise ConfigError(f"parallel.pp={p.pp} with pp_schedule={p.pp_schedule} needs {stages} pipeline stages "
                              f"but model.n_layers={m.n_layers}")
        if m.loss_parallel:
            raise ConfigError("model.loss_parallel is not supported with parallel.pp>1 yet")
        if p.pp_microbatches < 0:
            raise ConfigError("parallel.pp_microbatches must be >= 0 (0 = parallel.pp)")
        if p.pp_schedule == "interleaved_1f1b" and (p.pp_microbatches or p.pp) % p.pp:
            raise ConfigError("parallel.pp_schedule=interleaved_1f1b needs parallel.pp_microbatches divisible by parallel.pp")
    if p.zero_stage:
        raise ConfigError("parallel.zero_stage: the LLM recipe shards with FSDP2 over parallel.dp, not DeepSpeed ZeRO")
    if cfg.data.max_seq_len > m.max_seq_len:
        raise ConfigError(f"data.max_seq_len={cfg.data.max_seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if cfg.toggles.precision == "fp16":
        # Loss-scaled fp16 under FSDP2 (a sharded grad scaler) is not implemented; bf16 needs no scaling.
        raise ConfigError("toggles.precision=fp16 is not offered by the LLM recipe; use bf16 (or fp32)")
    if cfg.toggles.precision == "fp8" and p.tp > 1:
        # torchao's float8 linears need their own tensor-parallel styles (Float8ColwiseParallel, ...).
        raise ConfigError(f"toggles.precision=fp8 with parallel.tp={p.tp}: the LLM recipe converts to fp8 without "
                          "tensor parallelism only (parallel.tp=1)")
    if cfg.toggles.attention == "eager":
        raise ConfigError("toggles.attention=eager is not in the LLM recipe: its own Llama runs sdpa (a dense mask) "
                          "or flash (the varlen kernel on packed rows)")
