"""Typed schema shared by every recipe, registered in Hydra's ConfigStore, plus value checks.

Composition (scripts/train.py) catches unknown keys and wrong types through these
dataclasses; `validate` then catches impossible values. Both raise `ConfigError`, which
the launcher prints as one line. No family's keys are here: a family's `model`, `data` and `parallel`
schemas, and the sections only it has (`diffusion`, `vlm`), are in `recipes/<family>/config.py`,
named by its spec (recipes/registry.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from common.errors import ConfigError


@dataclass
class RecipeInfo:
    name: str = MISSING  # e.g. dit_tiny
    family: str = MISSING  # dit, vlm, llm, ...: its spec in recipes/registry.py


@dataclass
class RunConfig:
    dir: str = ""  # empty: outputs/<recipe>/<timestamp>, chosen by rank 0 and broadcast
    resume: str = "auto"  # auto | never | <checkpoint path>
    dry_run: bool = False


@dataclass
class TrainerConfig:
    max_steps: int = 100
    seed: int = 0
    log_every: int = 10
    micro_batch_size: int = 32
    grad_accum: int = 1
    progress_bar: bool = True
    eval: bool = True  # run the recipe's evaluation after training
    # A step with a non-finite loss or gradient is skipped (weights untouched) and counted; this
    # many in a row stop the run with a checkpoint of the last good weights. 0: never stop.
    max_bad_steps: int = 5


@dataclass
class CheckpointConfig:
    every: int = 0  # 0: only the final checkpoint
    keep: int = 2
    final: bool = True  # save one at the end of training
    async_save: bool = False  # LLM (DCP): stage a host copy, write it in the background while training goes on


@dataclass
class ParallelConfig:
    """What every family's `parallel` section has. A family's own schema adds its keys (DeepSpeed's
    `zero_stage` below; the LLM's tp/pp in recipes/llm/config.py); the degrees a family has no key for
    read as these class constants (no tensor or pipeline parallelism, no ZeRO partitioning)."""

    dp: int = -1  # data-parallel degree; -1 = world_size / (tp * pp * cp)
    timeout_s: int = 600  # collective timeout: a hang becomes an error
    # Context parallelism: every family's sequences split over cp ranks (one key, one meaning): the LLM's rows
    # (recipes/llm/context_parallel.py), the DiT's and text-to-image's patch tokens (Ulysses: common/ulysses.py), the
    # VLM's language model (recipes/vlm/context_parallel.py). cp_method: how the cp ranks exchange what attention needs
    # (allgather: keys and values; alltoall: heads for tokens, Ulysses). "" = the family's default: its spec's
    # cp_methods (recipes/registry.py; the LLM allgather, the others alltoall), filled in by common/compose.py.
    cp: int = 1
    cp_method: str = ""
    tp: ClassVar[int] = 1
    pp: ClassVar[int] = 1
    ep: ClassVar[int] = 1
    zero_stage: ClassVar[int] = 0


@dataclass
class ZeroParallelConfig(ParallelConfig):
    """The DeepSpeed recipes' (DiT, VLM): ZeRO data parallelism (configs/parallel/single|zero1|zero2|zero3)."""

    zero_stage: int = 0  # DeepSpeed ZeRO stage 0-3


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "cosine"  # constant | cosine | linear
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio (cosine, linear)
    grad_clip: float = 1.0  # 0 disables clipping


@dataclass
class TogglesConfig:
    precision: str = "fp32"  # fp32 | bf16 | fp16 | fp8
    tf32: bool = True
    compile: bool = False
    activation_checkpointing: str = "none"  # none | full | selective
    attention: str = "sdpa"  # sdpa | flash | eager


@dataclass
class ProfileConfig:
    enabled: bool = False
    wait: int = 1
    warmup: int = 1
    active: int = 3
    repeat: int = 1
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    count_flops: bool = True  # count the first step's FLOPs: achieved TFLOP/s and MFU per logged step
    peak_tflops: float = 0.0  # per-device peak for MFU; 0: the built-in GPU table, or a measured CPU matmul peak


@dataclass
class DataConfig:
    """What every family's `data` section has; a family's schema adds its own keys (recipes/<family>/config.py)."""

    name: str = "digits"
    root: str = "data/cache/digits"  # a relative path is taken from the working directory (run from the checkout)
    # The dataset's builder: the argv after `python -m` that builds it at `root` (the runtime
    # appends `--out <root>` and runs it from the repo root on rank 0 at start-up; builders leave
    # a complete dataset with the same settings alone). Empty: no builder, the dataset must exist.
    build: list[str] = field(default_factory=list)
    # For a dataset you build yourself (build empty): the command that builds it, named in the one-line
    # error when data.root holds none ("{root}" becomes data.root).
    build_hint: str = ""
    num_workers: int = 1
    shuffle_buffer: int = 256
    max_corrupt_shards: int = 0


@dataclass
class LoRAConfig:
    """`finetune=lora` (configs/finetune/lora.yaml): low-rank adapters on a frozen base (common/lora.py, on peft).
    The same keys for every family; each family names what its adapters may target (its spec's lora_targets)."""

    rank: int = 8
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input; > 0 draws random numbers per rank
    targets: list[str] = field(default_factory=list)  # module names; [] = the family's lora_targets (filled in)
    quantize_base: str = "none"  # none | nf4: QLoRA, the adapted linears' frozen weights in 4-bit NormalFloat


@dataclass
class ExportConfig:
    merge_lora: bool = False  # finetune=lora: also write the base with the adapter merged in (export/merged)
    # More artifacts written from the export at the end of a run (and by scripts/export.py --format): the formats its
    # family's spec offers (recipes/registry.py export_formats), e.g. the LLM's gguf (export/gguf/: a GGUF file for
    # llama.cpp and an ollama Modelfile, recipes/llm/gguf_export.py)
    formats: list[str] = field(default_factory=list)
    gguf_type: str = "f16"  # export.formats=[gguf]: the GGUF's tensor type, f16 | bf16 | q8_0


# preference.loss: the pairwise objectives (common/preference.py); the reference-free ones take no reference.
PREFERENCE_LOSSES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")
PREFERENCE_REFERENCE_FREE = ("simpo", "orpo")
PREFERENCE_REFERENCES = ("auto", "model", "precomputed", "none")


@dataclass
class PreferenceConfig:
    """The `preference` section: empty ``loss`` = supervised fine-tuning (the section is not read)."""

    loss: str = ""  # "" (off: SFT) | sigmoid | ipo | hinge | simpo | orpo
    beta: float = 0.1  # the reward scale (DPO's beta, IPO's tau, ORPO's lambda)
    label_smoothing: float = 0.0  # sigmoid, simpo: the probability that a pair's label is flipped (cDPO)
    gamma: float = 0.5  # simpo: the target reward margin
    # What the log ratios are taken against: auto (the reference-based losses: the frozen start; reference-free ones:
    # none), model (a frozen copy of the starting weights; under finetune=lora the base with the adapter disabled),
    # precomputed (the starting weights' log-probs of every pair, computed once before the first step and kept beside
    # the data: no reference forward in training), none (only for the reference-free losses)
    reference: str = "auto"

    @property
    def enabled(self) -> bool:
        return bool(self.loss)

    @property
    def needs_reference(self) -> bool:
        return self.enabled and self.loss not in PREFERENCE_REFERENCE_FREE


# grpo.* and reward.*: online RL with verifiable rewards (issue 46; common/grpo.py, common/rewards.py), TRL's names.
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
GRPO_SCALE_REWARDS = ("group", "batch", "none")
GRPO_IMPORTANCE_LEVELS = ("token", "sequence")
GRPO_VLLM_MODES = ("server", "colocate")  # where the rollout engine runs (colocate: refused, not built)


@dataclass
class RewardConfig:
    """The ``reward`` section: the reward functions, "module:function" each (common/rewards.py), and their weights."""

    functions: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # [] = 1.0 each, as TRL's reward_weights=None


@dataclass
class GRPOConfig:
    """The ``grpo`` section: TRL's GRPOConfig keys with TRL's meanings and defaults (trl 1.16). ``enabled`` is the
    switch: true trains by GRPO (recipes/llm/grpo.py) on prompt shards; false (the default) leaves the section and
    ``reward`` unread."""

    enabled: bool = False  # train by GRPO on prompt shards (data=prompt_shards) instead of next-token prediction
    num_generations: int = 8  # G completions sampled per prompt; advantages are normalized within each group
    max_completion_length: int = 512  # new tokens per completion; dr_grpo divides its loss by it
    temperature: float = 1.0  # sampling temperature; the log-probs are taken of logits / temperature, as TRL does
    top_p: float = 1.0  # nucleus sampling, in (0, 1]
    epsilon: float = 0.2  # the ratio is clipped to [1 - epsilon, 1 + epsilon_high]
    # None = epsilon; DAPO's clip-higher takes 0.28
    epsilon_high: Optional[float] = None  # noqa: UP045 (OmegaConf's structured configs read Optional)
    beta: float = 0.0  # KL to the frozen reference (k3 estimator); 0 = none, no reference kept (TRL's default)
    loss_type: str = "dapo"  # grpo | bnpo | dr_grpo | dapo (common/grpo.py says each normalization)
    scale_rewards: str = "group"  # group | batch | none: what the advantages are divided by (std + 1e-4)
    importance_sampling_level: str = "token"  # token | sequence (GSPO: one ratio per sequence)
    # where the rollout engine runs: server (vLLM in its own process, from its own environment .venv-serve, beside
    # the trainer's rank 0) | colocate (vLLM inside the trainer's process: refused, not built; docs/rl.md). TRL's
    # name; its default is colocate, Kiln's server
    vllm_mode: str = "server"

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def check_grpo(grpo: GRPOConfig, reward: RewardConfig) -> None:
    """One line for a grpo.* or reward.* value that cannot run (the reward functions themselves are loaded by
    common/rewards.py)."""
    for key, value, allowed in (
        ("loss_type", grpo.loss_type, GRPO_LOSS_TYPES),
        ("scale_rewards", grpo.scale_rewards, GRPO_SCALE_REWARDS),
        ("importance_sampling_level", grpo.importance_sampling_level, GRPO_IMPORTANCE_LEVELS),
        ("vllm_mode", grpo.vllm_mode, GRPO_VLLM_MODES),
    ):
        if value not in allowed:
            raise ConfigError(f"grpo.{key}={value!r} is not allowed; choose one of: {', '.join(allowed)}")
    if grpo.vllm_mode == "colocate":
        raise ConfigError(
            "grpo.vllm_mode=colocate is not built: vLLM pins its own torch, so Kiln runs it in its own environment "
            "(.venv-serve) and process; use grpo.vllm_mode=server (docs/rl.md)"
        )
    if grpo.num_generations < 2:
        raise ConfigError(
            f"grpo.num_generations={grpo.num_generations} must be >= 2 (advantages compare the completions of a prompt)"
        )
    if grpo.max_completion_length < 1:
        raise ConfigError(f"grpo.max_completion_length={grpo.max_completion_length} must be >= 1")
    if grpo.temperature <= 0:
        raise ConfigError(f"grpo.temperature={grpo.temperature} must be > 0")
    if not 0.0 < grpo.top_p <= 1.0:
        raise ConfigError(f"grpo.top_p={grpo.top_p} must be in (0, 1]")
    if not 0.0 <= grpo.epsilon < 1.0:
        raise ConfigError(f"grpo.epsilon={grpo.epsilon} must be in [0, 1) (the ratio's lower bound is 1 - epsilon)")
    if grpo.epsilon_high is not None and grpo.epsilon_high < 0:
        raise ConfigError(f"grpo.epsilon_high={grpo.epsilon_high} must be >= 0 (or null: equal to grpo.epsilon)")
    if grpo.beta < 0:
        raise ConfigError(f"grpo.beta={grpo.beta} must be >= 0 (0: no reference)")
    if not reward.functions:
        raise ConfigError('reward.functions is empty; name at least one, e.g. ["common.rewards:exact_match"]')
    if reward.weights and len(reward.weights) != len(reward.functions):
        raise ConfigError(
            f"reward.weights has {len(reward.weights)} values for {len(reward.functions)} reward.functions; "
            "give one per function (or none: 1.0 each)"
        )
    for name in reward.functions:
        module, _, function = str(name).partition(":")
        if not module or not function:
            raise ConfigError(f"reward.functions: {name!r} is not module:function (e.g. common.rewards:exact_match)")


@dataclass
class TrainConfig:
    recipe: RecipeInfo = field(default_factory=RecipeInfo)
    run: RunConfig = field(default_factory=RunConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: Any = MISSING  # a ParallelConfig: the family's schema comes with configs/parallel/<name>.yaml
    optim: OptimConfig = field(default_factory=OptimConfig)
    toggles: TogglesConfig = field(default_factory=TogglesConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    finetune: str = "full"  # full | lora (configs/finetune/)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)  # preference optimization (off: SFT)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)  # online RL with verifiable rewards (off: grpo.enabled=false)
    reward: RewardConfig = field(default_factory=RewardConfig)  # GRPO's reward functions (read under grpo.enabled)
    data: Any = MISSING  # a DataConfig: the family's schema comes with configs/data/<name>.yaml
    # The family's architecture; its schema comes from recipes/<family>/config.py. Sections only one family has
    # (the DiT's `diffusion`, the VLM's `vlm`) are its spec's `sections`, added by `schema` (recipes/registry.py).
    model: Any = MISSING

    def __reduce__(self):
        """Pickled by the families' section names: the class `schema` made for them is rebuilt on loading."""
        shared = {f.name for f in fields(TrainConfig)}
        return _restore, (tuple(f.name for f in fields(self) if f.name not in shared), dict(self.__dict__))


_SCHEMAS: dict[tuple[str, ...], type] = {}


def schema(sections: Iterable[str] = ()) -> type:
    """TrainConfig with one more top-level field per family section (`sections`: their names, e.g. `diffusion`),
    each None unless the run's family fills it from its config group (configs/<section>/*.yaml): the keys
    every run's config.yaml holds, the same class for the same names."""
    names = tuple(dict.fromkeys(sections))  # a section two families share (the diffusion core's) is one field
    if names not in _SCHEMAS:
        cls = TrainConfig
        if names:
            extra = [(name, Any, field(default=None)) for name in names]
            cls = make_dataclass("TrainConfig", extra, bases=(TrainConfig,))
            cls.__module__ = __name__
        _SCHEMAS[names] = cls
    return _SCHEMAS[names]


def _restore(sections: tuple[str, ...], state: dict) -> TrainConfig:
    cfg = object.__new__(schema(sections))
    cfg.__dict__.update(state)
    return cfg


CHOICES = {
    "toggles.precision": ("fp32", "bf16", "fp16", "fp8"),
    "toggles.activation_checkpointing": ("none", "full", "selective"),
    "toggles.attention": ("sdpa", "flash", "eager"),
    "optim.schedule": ("constant", "cosine", "linear"),
    "finetune": ("full", "lora"),
}

POSITIVE = (
    "trainer.max_steps",
    "trainer.log_every",
    "trainer.micro_batch_size",
    "trainer.grad_accum",
    "checkpoint.keep",
    "parallel.timeout_s",
    "data.shuffle_buffer",
    "profile.active",
    "lora.rank",
    "lora.alpha",
)
NON_NEGATIVE = (
    "trainer.max_bad_steps",
    "checkpoint.every",
    "optim.lr",
    "optim.weight_decay",
    "optim.warmup_steps",
    "optim.grad_clip",
    "data.num_workers",
    "data.max_corrupt_shards",
    "profile.wait",
    "profile.peak_tflops",
    "profile.warmup",
    "profile.repeat",
)


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def validate(cfg: TrainConfig) -> None:
    """Check values the type system cannot: choices, ranges, cross-key rules."""
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")
    for key in POSITIVE:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be > 0")
    for key in NON_NEGATIVE:
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be >= 0")
    if isinstance(cfg.parallel, ZeroParallelConfig) and cfg.parallel.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero_stage={cfg.parallel.zero_stage!r} is not allowed; choose one of: 0, 1, 2, 3")
    if cfg.parallel.cp < 1:
        raise ConfigError(f"parallel.cp={cfg.parallel.cp} must be >= 1 (1 = no context parallelism)")
    if cfg.parallel.dp == 0 or cfg.parallel.dp < -1:
        raise ConfigError(f"parallel.dp={cfg.parallel.dp} must be -1 (derive from world size) or >= 1")
    if not 0.0 <= cfg.lora.dropout < 1.0:
        raise ConfigError(f"lora.dropout={cfg.lora.dropout} must be in [0, 1)")
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} must be in [0, 1]")
    if not (0.0 <= cfg.optim.beta1 < 1.0 and 0.0 <= cfg.optim.beta2 < 1.0):
        raise ConfigError("optim.beta1 and optim.beta2 must be in [0, 1)")
    if cfg.toggles.attention == "flash" and cfg.toggles.precision not in ("bf16", "fp16", "fp8"):
        raise ConfigError(
            f"toggles.attention=flash needs toggles.precision=bf16 or fp16 (flash kernels have no "
            f"{cfg.toggles.precision} path); got toggles.precision={cfg.toggles.precision}"
        )
    build = cfg.data.build
    if build and (not build[0] or build[0].startswith("-")):
        raise ConfigError(
            f"data.build={build}: the first item must be the builder's module (it runs as python -m MODULE ARGS...)"
        )
    if any(arg == "--out" or arg.startswith("--out=") for arg in build):
        raise ConfigError(f"data.build={build} must not give --out: the run appends --out <data.root>")
    if cfg.checkpoint.async_save and isinstance(cfg.parallel, ZeroParallelConfig):
        raise ConfigError(
            "checkpoint.async_save=true is for the LLM recipes (DCP); DeepSpeed recipes save synchronously"
        )
    resume = cfg.run.resume
    if resume not in ("auto", "never") and not Path(resume).exists():
        raise ConfigError(f"run.resume={resume}: no such path (use auto, never, or a checkpoint path)")


ZERO_LAYOUTS = "parallel=single|zero1|zero2|zero3: parallel.dp, parallel.zero_stage"


def rename_saved(cfg: Any, renamed: dict[str, str]) -> None:
    """A config.yaml written before its family renamed keys (an OmegaConf DictConfig; `renamed`: the spec's old
    dotted key -> new) with their values under the new names, in place: an older run's folder still exports."""
    from omegaconf import OmegaConf

    absent = object()
    for old, new in renamed.items():
        value = OmegaConf.select(cfg, old, default=absent)
        if value is absent:
            continue
        parent, _, leaf = old.rpartition(".")
        del (OmegaConf.select(cfg, parent) if parent else cfg)[leaf]
        if OmegaConf.select(cfg, new, default=absent) is absent:
            OmegaConf.update(cfg, new, value, force_add=True)


def check_family_sections(
    cfg: TrainConfig, recipe: str, *, parallel: type, layouts: str, data: type, datasets: str
) -> None:
    """One line where a `parallel` or `data` option of another family was picked (each family's schema is
    its own: recipes/<family>/config.py)."""
    if not isinstance(cfg.parallel, parallel):
        raise ConfigError(f"the {recipe} recipe does not take this parallel layout; it shards with {layouts}")
    if not isinstance(cfg.data, data):
        raise ConfigError(f"data={cfg.data.name} is not a dataset of the {recipe} recipe; it reads data={datasets}")


def fill_from_checkpoint(model: Any, values: dict[str, tuple[str, Any]], command_line: set[str], source: str) -> None:
    """model.init_from's shape into `model` (the model.* section), in place: `values` maps a key under model.
    ("dim", "moe.top_k") to (its name in the checkpoint's config.json, its value). A key the command line set
    (`command_line` holds "model.<key>") to another value stops the run in one line; the recipe preset's values are
    replaced. The DiT, the VLM and the LLM complete their configs with it."""
    for key, (name, value) in values.items():
        section, _, leaf = key.rpartition(".")
        owner = _get(model, section) if section else model
        given = getattr(owner, leaf)
        if f"model.{key}" in command_line and given != value:
            raise ConfigError(
                f"model.{key}={given} disagrees with model.init_from={source}, whose config.json gives "
                f"{name}={value}; leave model.{key} out of the command line"
            )
        setattr(owner, leaf, value)


def register(sections: Iterable[str] = (), schemas: Iterable[tuple[str, str, type]] = ()) -> None:
    """Put the shared schema, with the families' `sections` (their names), and the families' group `schemas`
    ((group, name, dataclass): each family's config.SCHEMAS) into Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    for group, name, node in schemas:
        cs.store(group=group, name=name, node=node)
    cs.store(name="train_schema", node=schema(sections))
    cs.store(group="parallel", name="zero_schema", node=ZeroParallelConfig)
