"""common/preference.py against TRL's own code on the same weights and batch (fp32, within 1e-5).

The reference-based losses (sigmoid, ipo, hinge) against DPOTrainer itself: a real trainer built on the tiny policy
and reference, its `_compute_loss` run on TRL's collated batch (padded, one sequence per answer), its logged
rewards read back. Kiln's side runs each pair's two answers packed into one row (block-diagonal mask, per-document
positions), as training does. Label smoothing (cDPO), SimPO and ORPO, which TRL 1.16 has in CPOTrainer and
ORPOTrainer (trl.experimental), against their loss functions fed TRL's own per-sequence log-probs.
"""

from __future__ import annotations

import types

import pytest
import torch

from common.data.packing import IGNORE_INDEX, pack_rows
from common.errors import ConfigError
from common.preference import (
    PreferenceConfig,
    answer_logps,
    check_config,
    document_index,
    pairs,
    preference_loss,
)

TOL = dict(rtol=1e-5, atol=1e-5)
# Three pairs of unequal prompt and answer lengths (token ids of the tiny vocabulary).
EXAMPLES = [
    {"prompt_ids": [5, 17, 42, 9], "chosen_ids": [33, 61, 7], "rejected_ids": [88, 12, 19, 140, 3]},
    {"prompt_ids": [71, 8], "chosen_ids": [150, 22, 91, 4, 36, 57], "rejected_ids": [29]},
    {"prompt_ids": [11, 99, 23, 64, 2, 31], "chosen_ids": [45, 77], "rejected_ids": [45, 78]},
]


@pytest.fixture(scope="module")
def world():
    from tests.fixtures.llm import tiny_llamas

    tokenizer, (policy, reference) = tiny_llamas(2)
    return tokenizer, policy, reference


def packed_logps(model, examples) -> tuple[torch.Tensor, torch.Tensor]:
    """Kiln's side: per document (chosen, rejected per pair), the answer log-prob sums and counts, each pair's two
    answers one packed row."""
    rows = []
    for ex in examples:
        prompt = ex["prompt_ids"]
        row = []
        for answer in (ex["chosen_ids"], ex["rejected_ids"]):
            ids = torch.tensor(prompt + answer)
            labels = ids.clone()
            labels[: len(prompt)] = IGNORE_INDEX
            row.append({"input_ids": ids, "labels": labels})
        rows.append(row)
    row_len = max(sum(len(d["input_ids"]) for d in row) for row in rows) + 3  # a padding tail too
    packed = pack_rows(rows, row_len, pad_id=0)
    with torch.no_grad():
        logits = model(
            input_ids=packed.input_ids,
            attention_mask=packed.attention_mask_4d(),
            position_ids=packed.position_ids,
        ).logits
    return answer_logps(logits, packed.labels, document_index(packed.seq_lens, row_len), 2 * len(examples))


def trl_batch_logps(model, batch, average: bool) -> torch.Tensor:
    """TRL's side: CPOTrainer.get_batch_logps on the padded batch's logits ([chosen..., rejected...])."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX)
    return CPOTrainer.get_batch_logps(logits, labels, average_log_prob=average)


def as_pairs(trl_values: torch.Tensor) -> torch.Tensor:
    """TRL's [chosen..., rejected...] in Kiln's document order (chosen, rejected per pair)."""
    chosen, rejected = trl_values.chunk(2)
    return torch.stack([chosen, rejected], dim=1).flatten()


@pytest.fixture(scope="module")
def dpo_trainer(world, tmp_path_factory):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    tokenizer, policy, reference = world
    args = DPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), beta=0.3, report_to=[], use_cpu=True, bf16=False)
    data = Dataset.from_list([{"prompt": "What is up?", "chosen": " Down.", "rejected": " Left."}])
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=data, processing_class=tokenizer)
    return trainer, trainer.data_collator(EXAMPLES)


def test_answer_logps_of_packed_pairs_equal_trl_per_padded_sequence(world, dpo_trainer):
    _, policy, _ = world
    _, batch = dpo_trainer
    sums, counts = packed_logps(policy, EXAMPLES)
    torch.testing.assert_close(sums, as_pairs(trl_batch_logps(policy, batch, average=False)), **TOL)
    torch.testing.assert_close(sums / counts, as_pairs(trl_batch_logps(policy, batch, average=True)), **TOL)
    want = [len(ex[k]) for ex in EXAMPLES for k in ("chosen_ids", "rejected_ids")]
    assert counts.tolist() == want


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge"])
def test_reference_losses_and_rewards_equal_dpo_trainer(world, dpo_trainer, loss):
    _, policy, reference = world
    trainer, batch = dpo_trainer
    trainer.loss_types, trainer.loss_weights = [loss], [1.0]
    mode = "train" if trainer.model.training else "eval"  # where TRL logs
    trainer._metrics[mode].clear()
    with torch.no_grad():
        want = trainer._compute_loss(trainer.model, batch, return_outputs=False)
    logged = {k: v[-1] for k, v in trainer._metrics[mode].items()}

    logps, counts = packed_logps(policy, EXAMPLES)
    ref_logps, _ = packed_logps(reference, EXAMPLES)
    got, metrics = preference_loss(PreferenceConfig(loss=loss, beta=0.3), logps, counts, ref_logps)
    torch.testing.assert_close(got.mean(), want, **TOL)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        assert metrics[name].mean().item() == pytest.approx(logged[name], rel=1e-5, abs=1e-5), name
    assert 0 < logged["rewards/accuracies"] < 1  # the batch has pairs either way: the accuracy's test can fail


def test_label_smoothing_equals_trl_cdpo(world, dpo_trainer):
    """cDPO: DPOTrainer 1.16's sigmoid takes no label smoothing; CPOTrainer's sigmoid is the cDPO form, fed log
    ratios it gives DPO's."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    _, policy, reference = world
    _, batch = dpo_trainer
    ratios = trl_batch_logps(policy, batch, False) - trl_batch_logps(reference, batch, False)
    me = types.SimpleNamespace(
        alpha=0.0, beta=0.3, label_smoothing=0.2, loss_type="sigmoid", accelerator=types.SimpleNamespace(device="cpu")
    )
    want, _, _ = CPOTrainer.cpo_loss(me, *ratios.chunk(2))
    logps, counts = packed_logps(policy, EXAMPLES)
    ref_logps, _ = packed_logps(reference, EXAMPLES)
    got, _ = preference_loss(PreferenceConfig(loss="sigmoid", beta=0.3, label_smoothing=0.2), logps, counts, ref_logps)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_simpo_equals_trl_cpo_trainer(world, dpo_trainer, smoothing):
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    _, policy, _ = world
    _, batch = dpo_trainer
    means = trl_batch_logps(policy, batch, average=True)  # CPOTrainer averages for simpo
    me = types.SimpleNamespace(
        alpha=0.0,
        beta=2.0,
        label_smoothing=smoothing,
        loss_type="simpo",
        simpo_gamma=0.7,
        accelerator=types.SimpleNamespace(device="cpu"),
    )
    want, want_c, want_r = CPOTrainer.cpo_loss(me, *means.chunk(2))
    logps, counts = packed_logps(policy, EXAMPLES)
    pref = PreferenceConfig(loss="simpo", beta=2.0, gamma=0.7, label_smoothing=smoothing)
    got, metrics = preference_loss(pref, logps, counts)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(metrics["rewards/chosen"], want_c, **TOL)
    torch.testing.assert_close(metrics["rewards/rejected"], want_r, **TOL)


def test_orpo_equals_trl_orpo_trainer(world, dpo_trainer):
    """The odds-ratio term and the rewards equal ORPOTrainer's; the SFT term is the chosen answer's token-mean NLL
    (TRL's takes the prompt in: common/preference.py says why)."""
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    _, policy, _ = world
    _, batch = dpo_trainer
    means = trl_batch_logps(policy, batch, average=True)
    me = types.SimpleNamespace(beta=0.25, accelerator=types.SimpleNamespace(device="cpu"))
    ratio_term, want_c, want_r, _, _ = ORPOTrainer.odds_ratio_loss(me, *means.chunk(2))
    logps, counts = packed_logps(policy, EXAMPLES)
    got, metrics = preference_loss(PreferenceConfig(loss="orpo", beta=0.25), logps, counts)
    chosen_mean, _ = pairs(logps / counts)
    torch.testing.assert_close(got, -chosen_mean - ratio_term, **TOL)
    torch.testing.assert_close(metrics["rewards/chosen"], want_c, **TOL)
    torch.testing.assert_close(metrics["rewards/rejected"], want_r, **TOL)


def test_gradient_flows_to_the_policy_only_through_answer_tokens(world):
    """A prompt token's logit at a position whose next token is the prompt's does not move the loss."""
    _, policy, reference = world
    logits = torch.randn(1, 9, 20, requires_grad=True)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 4, IGNORE_INDEX, IGNORE_INDEX, 7, 8, IGNORE_INDEX]])
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, -1]])
    sums, counts = answer_logps(logits, labels, docs, 2)
    assert counts.tolist() == [2.0, 2.0]
    loss, _ = preference_loss(PreferenceConfig(loss="simpo"), sums, counts)
    loss.sum().backward()
    touched = logits.grad.abs().sum(-1)[0].nonzero().flatten().tolist()
    assert touched == [1, 2, 5, 6]  # the positions predicting labels 2, 3 and 6, 7


@pytest.mark.parametrize(
    "pref, message",
    [
        (PreferenceConfig(loss="dpo"), "preference.loss='dpo' is not allowed; choose one of: sigmoid, ipo, hinge"),
        (PreferenceConfig(loss="simpo", reference="model"), "preference.loss=simpo is reference-free"),
        (PreferenceConfig(loss="orpo", reference="model"), "preference.loss=orpo is reference-free"),
        (PreferenceConfig(loss="sigmoid", reference="none"), "preference.loss=sigmoid needs a reference"),
        (PreferenceConfig(loss="sigmoid", beta=0.0), "preference.beta=0.0 must be > 0"),
        (PreferenceConfig(loss="hinge", label_smoothing=0.1), "applies to the sigmoid and simpo losses only"),
    ],
)
def test_bad_settings_get_one_line(pref, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_config(pref, "llm", offered=True)


def test_a_family_without_preference_training_is_refused():
    with pytest.raises(ConfigError, match="preference.loss=sigmoid: the dit recipes have no preference training"):
        check_config(PreferenceConfig(loss="sigmoid"), "dit", offered=False)
    check_config(PreferenceConfig(), "dit", offered=False)  # off: nothing to refuse


@pytest.mark.parametrize(
    "override, needle",
    [
        ("recipe=dit_tiny preference.loss=sigmoid", "preference.loss=sigmoid: the dit recipes have no preference"),
        ("recipe=t2i_tiny preference.loss=simpo", "preference.loss=simpo: the t2i recipes have no preference"),
        ("recipe=vlm_tiny preference.loss=sigmoid preference.reference=precomputed", "precomputed is not offered by"),
        ("recipe=vlm_tiny preference.loss=sigmoid parallel.cp=2", "preference.loss=sigmoid does not run with parallel"),
        ("recipe=llm_tiny preference.loss=dpo", "preference.loss='dpo' is not allowed"),
        ("recipe=llm_tiny preference.loss=orpo preference.reference=model", "preference.loss=orpo is reference-free"),
        ("recipe=llm_tiny preference.loss=ipo parallel.pp=2", "preference.loss=ipo does not run with parallel.pp=2"),
        ("recipe=llm_tiny preference.loss=hinge parallel.cp=2", "preference.loss=hinge does not run with parallel.cp"),
        ("recipe=moe_tiny preference.loss=sigmoid", "preference.loss=sigmoid does not run on an MoE model"),
    ],
)
def test_composition_refuses_what_cannot_run(override, needle):
    from scripts.kiln.launch import compose

    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(").replace("'", "'")):
        compose(override.split())


def test_preference_composes_on_the_llm_and_is_off_by_default():
    from scripts.kiln.launch import compose

    assert not compose(["recipe=llm_tiny"]).preference.enabled
    cfg = compose(["recipe=llm_tiny", "data=preference_shards", "preference.loss=simpo", "preference.gamma=1.0"])
    assert (cfg.preference.loss, cfg.preference.gamma, cfg.preference.reference) == ("simpo", 1.0, "auto")


@pytest.mark.parametrize("family", ["llm", "vlm"])
def test_pairs_and_preference_loss_go_together_or_get_one_line(family):
    """Each family's check of its data: pairs without preference.loss, and preference.loss on other data."""
    import importlib

    from common.errors import DataError

    module = importlib.import_module(f"recipes.{family}.preference")
    pair_meta = {"format": module.PAIR_FORMAT, "longest_sample": 10}

    def cfg(loss: str):
        data = types.SimpleNamespace(root="data/x", max_seq_len=64)
        return types.SimpleNamespace(preference=PreferenceConfig(loss=loss), data=data)

    with pytest.raises(DataError, match="data.root=data/x holds preference pairs: set preference.loss"):
        module.check_data(cfg(""), pair_meta)
    with pytest.raises(DataError, match="preference.loss=sigmoid trains on preference pairs; .* build pairs with"):
        module.check_data(cfg("sigmoid"), {"format": "something-else"})
    module.check_data(cfg("sigmoid"), pair_meta)  # pairs with a loss: nothing to say
    module.check_data(cfg(""), {"format": "something-else"})  # neither: supervised training
