"""common/grpo.py against TRL 1.16's own GRPOTrainer on the same batch (fp32, within 1e-6).

A real GRPOTrainer is built on a tiny LlamaForCausalLM (as tests/unit/test_preference.py builds its DPOTrainer). Its
``rollout_func`` hands back fixed completions (1 to 6 tokens, some ending in eos, the others cut) and
its two reward functions fixed rewards (one group all equal, a None somewhere), so TRL's own
``_generate_and_score_completions`` computes the advantages, the reward metrics and the completion lengths; its
``_compute_loss`` then takes that batch with old and reference log-probs added, and runs the model itself. Kiln's
side scores the same tokens with :func:`token_logps` on the model's logits and feeds :func:`grpo_loss`; the loss and
the gradient it sends into the model's weights must agree, for each loss_type, both importance levels, beta 0 and not.
``pytest -s`` prints each case's gaps (docs/rl.md quotes them).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from common.config import RewardConfig
from common.errors import ConfigError, DataError
from common.grpo import (
    GRPOConfig,
    check_grpo,
    completion_metrics,
    group_advantages,
    grpo_loss,
    reward_metrics,
    token_logps,
)

TOL = dict(rtol=1e-6, atol=1e-6)
G = 4
MAX_NEW = 6
PROMPTS = ["What is two and two?", "Name a colour."]
# Rewards of the 8 completions from two functions (None: the function does not score that sample, as TRL allows).
REWARDS_A = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]  # the second group has std 0
REWARDS_B = [0.2, None, -0.4, 0.9, 0.1, 0.1, 0.1, 0.1]
WEIGHTS = [1.0, 0.5]


@pytest.fixture(scope="module")
def world():
    from tests.fixtures.llm import tiny_llamas

    tokenizer, (model,) = tiny_llamas(1)
    return tokenizer, model


def completions(tokenizer) -> list[list[int]]:
    """8 completions: a few end in eos, the others are cut at MAX_NEW tokens; lengths differ."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(len(PROMPTS) * G):
        n = 1 + i % MAX_NEW
        ids = torch.randint(20, len(tokenizer), (n,), generator=g).tolist()
        if i % 3 == 0:
            ids[-1] = tokenizer.eos_token_id
        out.append(ids)
    return out


def reward_a(completions, **kwargs):
    return REWARDS_A[: len(completions)]


def reward_b(completions, **kwargs):
    return REWARDS_B[: len(completions)]


def make_trainer(world, tmp_path, **overrides):
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    tokenizer, policy = world
    wanted = completions(tokenizer)

    def rollout(prompts, trainer):
        ids = [tokenizer(p)["input_ids"] for p in prompts]
        return {"prompt_ids": ids, "completion_ids": wanted, "logprobs": [[0.0] * len(c) for c in wanted]}

    args = TRLConfig(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        bf16=False,
        num_generations=G,
        per_device_train_batch_size=len(PROMPTS) * G,
        max_completion_length=MAX_NEW,
        reward_weights=WEIGHTS,
        temperature=0.7,
        **overrides,
    )
    data = Dataset.from_list([{"prompt": p} for p in PROMPTS])
    return GRPOTrainer(
        model=policy,
        reward_funcs=[reward_a, reward_b],
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        rollout_func=rollout,
    )


@pytest.fixture(scope="module")
def scored(world, tmp_path_factory):
    """TRL's batch and logged metrics from _generate_and_score_completions (train mode)."""
    trainer = make_trainer(world, tmp_path_factory.mktemp("trl"))
    trainer.model.train()
    inputs = [{"prompt": p} for p in PROMPTS for _ in range(G)]
    batch = trainer._generate_and_score_completions(inputs)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    trainer.model.eval()
    return trainer, batch, logged


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item()


def per_function() -> torch.Tensor:
    return torch.tensor([[a, math.nan if b is None else b] for a, b in zip(REWARDS_A, REWARDS_B)])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_and_reward_metrics_equal_trl(world, tmp_path, scored, scale):
    from common.grpo import weighted_sum

    trainer, batch, logged = scored
    if scale != "group":  # the module's trainer is group; build one per other scaling (the same rollout)
        trainer = make_trainer(world, tmp_path, scale_rewards=scale)
        batch = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(G)])
        logged = {k: v[-1] for k, v in trainer._metrics["eval" if not trainer.model.training else "train"].items()}
    rewards = per_function()
    total = weighted_sum(rewards, torch.tensor(WEIGHTS))
    advantages, zero_std = group_advantages(total, G, scale)
    torch.testing.assert_close(advantages, batch["advantages"], **TOL)
    print(f"grpo parity: advantages scale_rewards={scale} max |kiln - trl| {gap(advantages, batch['advantages']):.1e}")
    got = reward_metrics(rewards, torch.tensor(WEIGHTS), ["reward_a", "reward_b"], zero_std)
    for name, value in got.items():
        assert value == pytest.approx(logged[name], rel=1e-6, abs=1e-6), name
    assert 0 < got["frac_reward_zero_std"] < 1 or scale == "batch"  # group 2 has std 0: counted
    assert advantages[G:].abs().max() < 1e-3 and advantages[:G].abs().max() > 0.1


def test_completion_metrics_equal_trl(world, scored):
    tokenizer, _ = world
    _, _, logged = scored
    ids = completions(tokenizer)
    got = completion_metrics([len(c) for c in ids], [c[-1] == tokenizer.eos_token_id for c in ids])
    assert 0 < got["completions/clipped_ratio"] < 1
    for name, value in got.items():
        assert value == pytest.approx(logged[name], rel=1e-6), name


def kiln_logps(trainer, model, batch) -> torch.Tensor:
    """The completion tokens' log-probs from the model's logits, Kiln's way (token_logps at TRL's temperature)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=attention).logits
    n = batch["completion_ids"].size(1)
    return token_logps(logits[:, -n - 1 : -1], batch["completion_ids"], trainer.temperature)


CASES = [
    (loss, level, beta)
    for loss in ("grpo", "bnpo", "dr_grpo", "dapo")
    for level in ("token", "sequence")
    for beta in (0.0, 0.04)
]


@pytest.mark.parametrize("loss_type, level, beta", CASES)
def test_loss_gradient_and_metrics_equal_trl_compute_loss(world, scored, loss_type, level, beta):
    trainer, batch, _ = scored
    _, model = world
    trainer.loss_type, trainer.importance_sampling_level, trainer.beta = loss_type, level, beta
    trainer.epsilon_low, trainer.epsilon_high = 0.2, 0.28  # DAPO's clip-higher: asymmetric bounds
    mask = batch["completion_mask"].float()
    with torch.no_grad():
        here = kiln_logps(trainer, model, batch)
    g = torch.Generator().manual_seed(2)
    old = here + 0.3 * torch.randn(here.shape, generator=g)  # ratios well past both clip bounds
    ref = here + 0.5 * torch.randn(here.shape, generator=g)
    inputs = {**batch, "old_per_token_logps": old, "ref_per_token_logps": ref}

    trainer._metrics["eval"].clear()
    model.zero_grad()
    want = trainer._compute_loss(model, inputs)
    want.backward()
    want_grad = [p.grad.clone() for p in model.parameters()]
    logged = {k: v[-1] for k, v in trainer._metrics["eval"].items()}

    model.zero_grad()
    cfg = GRPOConfig(
        loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon=0.2, epsilon_high=0.28,
        max_completion_length=MAX_NEW,
    )  # fmt: skip
    got, metrics = grpo_loss(
        cfg,
        kiln_logps(trainer, model, batch),
        old,
        batch["advantages"],
        mask,
        ref,
        num_items=batch["num_items_in_batch"],
    )
    got.backward()
    grad_gap = max(gap(p.grad, theirs) for p, theirs in zip(model.parameters(), want_grad))
    print(
        f"grpo parity: {loss_type} {level} beta={beta}: loss {want.item():.6f}, |kiln - trl| {gap(got, want):.1e}, "
        f"gradient max |kiln - trl| {grad_gap:.1e} (max |gradient| {max(t.abs().max().item() for t in want_grad):.2e})"
    )
    torch.testing.assert_close(got, want, **TOL)
    for mine, theirs in zip((p.grad for p in model.parameters()), want_grad):
        torch.testing.assert_close(mine, theirs, **TOL)
    for name, value in metrics.items():
        assert value == pytest.approx(logged[name], rel=1e-6, abs=1e-6), name
    assert ("kl" in metrics) == (beta > 0)
    if level == "token":  # the case can fail: both bounds clip some tokens
        assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0


def test_grad_accum_and_dapo_token_count_scale_as_trl_in_training(world, scored):
    """In training TRL divides grpo/bnpo/dr_grpo by the micro-batches of a step, and dapo by the step's tokens."""
    trainer, batch, _ = scored
    _, model = world
    trainer.importance_sampling_level, trainer.beta = "token", 0.0
    trainer.current_gradient_accumulation_steps = 2  # two micro-batches a step, the generation batch split in two:
    steps_per_generation, trainer.args.steps_per_generation = trainer.args.steps_per_generation, 2
    with torch.no_grad():
        here = kiln_logps(trainer, model, batch)
    old = here + 0.1
    mask = batch["completion_mask"].float()
    model.train()
    try:
        for loss_type in ("grpo", "dapo"):
            trainer.loss_type = loss_type
            with torch.no_grad():
                want = trainer._compute_loss(model, {**batch, "old_per_token_logps": old})
                got, _ = grpo_loss(
                    GRPOConfig(loss_type=loss_type), here, old, batch["advantages"], mask,
                    num_items=batch["num_items_in_batch"], grad_accum=2,
                )  # fmt: skip
            torch.testing.assert_close(got, want, **TOL)
    finally:
        model.eval()
        trainer.args.steps_per_generation = steps_per_generation


def test_the_default_config_is_trls():
    from trl import GRPOConfig as TRLConfig

    theirs = {f.name: f.default for f in dataclasses.fields(TRLConfig)}
    mine = GRPOConfig()
    for key in (
        "num_generations", "max_completion_length", "temperature", "top_p", "epsilon", "epsilon_high", "beta",
        "loss_type", "scale_rewards", "importance_sampling_level",
    ):  # fmt: skip
        assert getattr(mine, key) == theirs[key], key
    assert mine.clip_high == mine.epsilon  # None: the upper bound is epsilon's, as TRL's __post_init__ sets it


REWARD = RewardConfig(functions=["common.rewards:exact_match"])


@pytest.mark.parametrize(
    "grpo, reward, message",
    [
        (GRPOConfig(loss_type="ppo"), REWARD, "grpo.loss_type='ppo' is not allowed; choose one of: grpo, bnpo,"),
        (GRPOConfig(scale_rewards="std"), REWARD, "grpo.scale_rewards='std' is not allowed; choose one of: group,"),
        (GRPOConfig(importance_sampling_level="seq"), REWARD, "grpo.importance_sampling_level='seq' is not allowed"),
        (GRPOConfig(num_generations=1), REWARD, "grpo.num_generations=1 must be >= 2"),
        (GRPOConfig(temperature=0.0), REWARD, "grpo.temperature=0.0 must be > 0"),
        (GRPOConfig(top_p=1.5), REWARD, "grpo.top_p=1.5 must be in (0, 1]"),
        (GRPOConfig(epsilon=1.0), REWARD, "grpo.epsilon=1.0 must be in [0, 1)"),
        (GRPOConfig(beta=-0.1), REWARD, "grpo.beta=-0.1 must be >= 0"),
        (GRPOConfig(vllm_mode="local"), REWARD, "grpo.vllm_mode='local' is not allowed; choose one of: server,"),
        (GRPOConfig(vllm_mode="colocate"), REWARD, "grpo.vllm_mode=colocate is not built: vLLM pins its own torch"),
        (GRPOConfig(), RewardConfig(), "reward.functions is empty"),
        (GRPOConfig(), RewardConfig(REWARD.functions, [1.0, 2.0]), "reward.weights has 2 values for 1 reward."),
        (GRPOConfig(), RewardConfig(["common.rewards.exact_match"]), "is not module:function"),
    ],
)
def test_bad_settings_get_one_line(grpo, reward, message):
    check_grpo(GRPOConfig(), REWARD)  # the defaults pass
    with pytest.raises(ConfigError) as err:
        check_grpo(grpo, reward)
    assert message in str(err.value) and "\n" not in str(err.value)


# ---- the switch and what composition refuses (recipes/llm/config.py:check_grpo_layout, common/grpo.py:check_config)
ON = "grpo.enabled=true reward.functions=[common.rewards:exact_match]"


def test_grpo_composes_on_the_llm_and_is_off_by_default():
    from scripts.kiln.launch import compose

    off = compose(["recipe=llm_tiny"])
    assert not off.grpo.enabled and off.reward.functions == []
    cfg = compose(["recipe=llm_tiny", "data=prompt_shards", *ON.split(), "grpo.num_generations=4"])
    assert cfg.grpo.enabled and cfg.grpo.num_generations == 4 and cfg.data.name == "prompt_shards"
    assert cfg.reward.functions == ["common.rewards:exact_match"]


@pytest.mark.parametrize(
    "override, needle",
    [
        ("recipe=dit_tiny " + ON, "grpo.enabled=true: the dit recipes have no GRPO training"),
        ("recipe=vlm_tiny " + ON, "grpo.enabled=true: the vlm recipes have no GRPO training"),
        ("recipe=llm_tiny reward.functions=[common.rewards:exact_match]", "reward.functions is set but grpo.enabled"),
        ("recipe=llm_tiny grpo.enabled=true", "reward.functions is empty"),
        ("recipe=llm_tiny grpo.loss_type=ppo " + ON, "grpo.loss_type='ppo' is not allowed"),
        ("recipe=llm_tiny preference.loss=simpo " + ON, "grpo.enabled=true and preference.loss=simpo: choose one"),
        ("recipe=llm_tiny parallel.pp=2 " + ON, "does not run with parallel.pp=2 yet (use dp and tp)"),
        ("recipe=llm_tiny parallel.cp=2 " + ON, "does not run with parallel.cp=2 yet (use dp and tp)"),
        ("recipe=moe_tiny parallel.ep=2 " + ON, "does not run with parallel.ep=2 yet (use dp and tp)"),
        (
            "recipe=llm_tiny parallel.tp=2 model.loss_parallel=true " + ON,
            "grpo.enabled=true does not run with model.loss_parallel=true under tp>1 yet",
        ),
        ("recipe=llm_tiny toggles.precision=bf16 " + ON, "grpo.enabled=true does not run with toggles.precision=bf16"),
        ("recipe=moe_tiny " + ON, "grpo.enabled=true does not run with an MoE model"),
        (
            "recipe=llm_tiny finetune=lora lora.quantize_base=nf4 run.dry_run=true " + ON,
            "grpo.enabled=true does not run with lora.quantize_base=nf4 (the engine serves the base unquantized)",
        ),
    ],
)
def test_composition_refuses_what_grpo_cannot_run(override, needle):
    from scripts.kiln.launch import compose

    with pytest.raises(ConfigError) as err:
        compose(override.split())
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_grpo_composes_on_dp_and_tp_ranks_with_several_micro_batches():
    """What check_grpo_layout lets through (recipes/llm/grpo.py runs it: tests/distributed/test_grpo_layouts.py)."""
    from scripts.kiln.launch import compose

    for layout in ("parallel.dp=2", "parallel.tp=2", "parallel.dp=2 parallel.tp=2", "trainer.grad_accum=2"):
        cfg = compose(["recipe=llm_tiny", "data=prompt_shards", *ON.split(), *layout.split()])
        assert cfg.grpo.enabled, layout


def test_prompt_shards_and_grpo_go_together():
    from recipes.llm.grpo import check_data
    from scripts.kiln.launch import compose

    on = compose(["recipe=llm_tiny", "data=prompt_shards", *ON.split(), "grpo.max_completion_length=16"])
    off = compose(["recipe=llm_tiny"])
    prompts = {"format": "prompts", "longest_sample": 40}
    check_data(on, prompts)  # 40 + 16 <= 256
    check_data(off, {"format": "text"})
    for cfg, meta, needle in [
        (off, prompts, "holds prompts: train them with grpo.enabled=true"),
        (on, {"format": "text"}, "grpo.enabled=true trains on prompts; data.root=data/my_prompts holds text data"),
        (on, {"format": "prompts", "longest_sample": 250}, "they need data.max_seq_len >= 266 (it is 256)"),
    ]:
        with pytest.raises(DataError) as err:
            check_data(cfg, meta)
        assert needle in str(err.value) and "\n" not in str(err.value)


def test_samples_are_laid_with_the_mask_on_their_completion_tokens():
    from recipes.llm.grpo import lay_samples, sample_seeds

    rows = [([1, 5, 6], [7, 8], [-0.1, -0.2]), ([1, 9], [3, 4, 2], [-0.3, -0.4, -0.5])]
    ids, mask, logps = lay_samples(rows, pad_id=0)
    assert ids.tolist() == [[1, 5, 6, 7, 8], [1, 9, 3, 4, 2]]
    for i, (_, completion, lp) in enumerate(rows):  # the targets under the mask are the completion, in order
        assert ids[i, 1:][mask[i] == 1].tolist() == completion
        assert logps[i][mask[i] == 1].tolist() == pytest.approx(lp)
    seeds = [s + k for step in (1, 2) for s in sample_seeds(step, 3, 4) for k in range(4)]
    assert len(set(seeds)) == len(seeds) == 24  # no two samples of two steps share a seed
