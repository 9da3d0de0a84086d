"""common/rewards.py: "module:function" loading (one line when it cannot), the weighted scoring and its metrics, a
reward that raises named with the sample, and the built-ins: exact match with GSM8K-style extraction, the format
check and the length penalty against TRL's own think_format_reward and get_soft_overlong_punishment."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from common.config import RewardConfig
from common.errors import ConfigError
from common.rewards import (
    RewardError,
    Rewards,
    exact_match,
    extract_answer,
    format_match,
    length_penalty,
    load_function,
    regex_reward,
)

USER_MODULE = """
def picky(completions, answer, **kwargs):
    out = []
    for c in completions:
        if "boom" in c:
            raise ValueError("cannot read " + repr(c))
        out.append(1.0 if c.endswith(str(answer[0])) else 0.0)
    return out

def sometimes(completions, **kwargs):
    return [None if c.startswith("skip") else len(c) / 10 for c in completions]

def miscounted(completions, **kwargs):
    return [0.0]

def wordy(completions, **kwargs):
    return ["good" for _ in completions]

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's own rewards file, importable from the working directory as ``my_rewards``."""
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"


def rewards(*names: str, weights=()) -> Rewards:
    return Rewards.from_config(RewardConfig(functions=list(names), weights=list(weights)), max_completion_length=10)


def test_load_function_one_line_errors(user_module):
    assert load_function("common.rewards:exact_match") is exact_match
    assert callable(load_function("my_rewards:picky"))
    for name, needle in [
        ("no_such_module:f", "module 'no_such_module' cannot be imported (ModuleNotFoundError"),
        ("my_rewards:nope", "module 'my_rewards' has no 'nope'"),
        ("my_rewards:NOT_A_FUNCTION", "'NOT_A_FUNCTION' is not callable (int)"),
        ("my_rewards.picky", "is not module:function"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_function(name)
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_weighted_scores_none_and_metrics(user_module):
    r = rewards("my_rewards:picky", "my_rewards:sometimes", weights=[1.0, 2.0])
    completions = ["it is 4", "skip it", "five", "so 4"]
    scores = r.score(completions, prompts=["p"] * 4, answer=[4] * 4)
    want = torch.tensor([[1.0, 0.7], [0.0, math.nan], [0.0, 0.4], [1.0, 0.4]])
    torch.testing.assert_close(scores, want, equal_nan=True)
    metrics = r.metrics(scores, torch.zeros(4, dtype=torch.bool))
    assert metrics["rewards/picky/mean"] == pytest.approx(0.5)
    assert metrics["rewards/sometimes/mean"] == pytest.approx(0.5)  # the None is left out: (0.7 + 0.4 + 0.4) / 3
    assert metrics["reward"] == pytest.approx((2.4 + 0.0 + 0.8 + 1.8) / 4)  # a None adds nothing to its sum
    assert metrics["frac_reward_zero_std"] == 0.0


def test_a_reward_that_raises_is_one_line_naming_it_and_the_sample(user_module):
    r = rewards("common.rewards:exact_match", "my_rewards:picky")
    with pytest.raises(RewardError) as err:
        r.score(["4", "4", "boom 4", "4"], answer=[4] * 4)
    want = "reward function my_rewards:picky raised on sample 2 of 4: ValueError: cannot read 'boom 4'"
    assert str(err.value) == want
    with pytest.raises(RewardError, match=r"my_rewards:miscounted returned 1 rewards for 2 completions"):
        rewards("my_rewards:miscounted").score(["a", "b"])
    with pytest.raises(RewardError, match=r"my_rewards:wordy returned 'good' for sample 0, not a number or None"):
        rewards("my_rewards:wordy").score(["a", "b"])
    with pytest.raises(ConfigError, match="reward.weights has 1 values for 2"):
        rewards("my_rewards:picky", "my_rewards:wordy", weights=[1.0])


@pytest.mark.parametrize(
    "text, want",
    [
        ("Natalia sold 48/2 = 24 clips in May.\n48+24 = 72 clips.\n#### 72", "72"),  # GSM8K's answer field
        ("so the total is 1,000 dollars\n#### 1,000", "1000"),
        ("The answer is \\boxed{\\frac{1}{2}} (that is 0.5)", "\\frac{1}{2}"),  # \boxed{} before the last number
        ("We get \\boxed{42}.", "42"),
        ("First 3 apples, then 5, so 8.", "8"),  # the last number
        ("It costs $12.50 in all.", "12.5"),
        ("a loss of -7", "-7"),
        ("no number here", None),
    ],
)
def test_extract_answer_gsm8k_style(text, want):
    assert extract_answer(text) == want


def test_exact_match_compares_extracted_answers_by_value():
    answers = ["... so 72 in all\n#### 72"] * 4 + ["#### 1,000"]
    completions = ["She sold 72 clips.", "#### 72.0", "\\boxed{71}", "I don't know", "That makes $1000."]
    assert exact_match(completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_format_match_is_trls_think_format_and_takes_a_row_pattern():
    from trl.rewards import think_format_reward

    texts = [
        "<think>\nreason\n</think>\nanswer",
        "<think>\nreason\nanswer",
        "answer <think>x</think>",
        "<think>a</think><think>b</think>",
    ]
    want = think_format_reward([[{"content": t}] for t in texts])
    assert format_match(texts) == want and 0 < sum(want) < len(want)
    tagged = ["<answer>4</answer>", "4"]
    assert format_match(tagged, format_pattern=[r"^<answer>\d+</answer>$"] * 2) == [1.0, 0.0]
    assert regex_reward(r"^<answer>\d+</answer>$")(tagged) == [1.0, 0.0]


def test_length_penalty_is_dapos_soft_overlong_punishment_as_trl():
    from trl.rewards import get_soft_overlong_punishment

    ids = [[1] * n for n in (0, 5, 8, 9, 10, 11, 30)]
    # max_completion_length 10: the cache is 2 (a fifth), so the penalty starts after 8 tokens
    assert length_penalty(ids, max_completion_length=10) == get_soft_overlong_punishment(10, 2)(ids)
    assert length_penalty(ids, max_completion_length=10)[2:6] == [0.0, -0.5, -1.0, -1.0]
    scores = rewards("common.rewards:length_penalty").score(["x"] * 2, completion_ids=[[1] * 9, [1] * 3])
    assert scores[:, 0].tolist() == [-0.5, 0.0]  # the run's max_completion_length (10) is passed in


def test_the_grpo_demo_rewards_the_right_answer_ending_in_an_exclamation_mark():
    """data.grpo_demo's prompts through format_match: 1 for the prompt's own answer ending in "!" (whatever follows it:
    the engine runs on past the chat's end of turn), 0 for it ending in ".", for another word's answer, or a cut one."""
    from data.grpo_demo import prompt_rows
    from data.preference_demo import HELD_OUT_WORDS, TRAIN_WORDS

    rows = prompt_rows()
    words = [*TRAIN_WORDS, *HELD_OUT_WORDS]
    assert len(rows) == 51 == len({row["prompt"][0]["content"] for row in rows})
    for i, row in enumerate(rows):
        a, b = words[i // 3]
        other = words[(i // 3 + 1) % len(words)][1]
        assert a in row["prompt"][0]["content"]
        completions = [
            f"The opposite of {a} is {b}!",
            f"The opposite of {a} is {b}! is thin!",
            f"The opposite of {a} is {b}.",
            f"The opposite of {a} is {other}!",
            f"The opposite of {a} is",
            f" The opposite of {a} is {b}!",
        ]
        assert format_match(completions, format_pattern=[row["format_pattern"]] * 6) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
