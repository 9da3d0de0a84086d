"""Rewards as plain Python, TRL's reward-function convention: ``fn(completions, **fields) -> list[float | None]``.

``reward.functions`` names them as "module:function" (any importable module: ``common.rewards:exact_match``,
``my_rewards:brevity`` from the working directory); ``reward.weights`` weighs them (1.0 each when empty). A
function is called once per batch with keyword arguments, as TRL's GRPOTrainer calls it:

    completions     list[str], the decoded completions (B x G, a prompt's G consecutive)
    prompts         list, each completion's prompt (a string or a message list, as the prompts file holds it)
    completion_ids  list[list[int]], the completions' token ids
    <field>         list, one value per completion, for every other field of the prompt's row (``answer``, ...)
    max_completion_length   int, ``grpo.max_completion_length``

and returns one float per completion, or None where it does not apply (left out of its mean; a completion no
function scores gets advantage 0: common/grpo.py). Take ``**kwargs`` for what you do not read.

:class:`Rewards` loads and calls them: a name that does not load is one ConfigError line; a function that raises
is one :class:`RewardError` line naming it and the first sample it fails on (the batch is re-scored one completion
at a time to find it), and so is a wrong count or a value that is not a number.

Built-ins:

- :func:`exact_match`: 1.0 when the completion's answer equals the row's ``answer``, else 0.0. An answer is
  extracted GSM8K-style from both (:func:`extract_answer`): the text after the last ``####``, else the last
  ``\\boxed{...}``, else the last number; numbers compare by value (``1,000`` = ``1000.0``, ``$5`` = ``5``).
- :func:`format_match`: 1.0 when the completion matches the row's ``format_pattern`` (a regex, matched from the
  start with DOTALL and MULTILINE), or TRL's ``think_format_reward`` pattern when the row has none;
  :func:`regex_reward` makes a reward of your own pattern.
- :func:`length_penalty`: DAPO's soft overlong punishment (eq. 13, TRL's ``get_soft_overlong_punishment``) on the
  completion's tokens: 0 up to ``max_completion_length`` - cache, then falling linearly to -1 at
  ``max_completion_length``, -1 beyond; the cache is a fifth of ``max_completion_length`` (DAPO's 4,096 of 20,480).
  :func:`overlong_penalty` makes one with other lengths.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from common.config import RewardConfig
from common.errors import ConfigError, UserError
from common.grpo import reward_metrics

__all__ = [
    "RewardError",
    "Rewards",
    "exact_match",
    "extract_answer",
    "format_match",
    "length_penalty",
    "load_function",
    "overlong_penalty",
    "regex_reward",
]

RewardFn = Callable[..., Sequence[float | None]]


class RewardError(UserError):
    """A reward function that raised, or returned what is not one number (or None) per completion."""


def load_function(name: str) -> RewardFn:
    """The function a "module:function" string names; ConfigError (one line) when it cannot be had."""
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"reward.functions: {name!r} is not module:function (e.g. common.rewards:exact_match)")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 (a user's module: any error while importing it is one line)
        raise ConfigError(
            f"reward.functions: {name}: module {module_name!r} cannot be imported ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"reward.functions: {name}: module {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise ConfigError(f"reward.functions: {name}: {attr!r} is not callable ({type(fn).__name__})")
    return fn


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _column(values: object, name: str, n: int) -> list[float]:
    """A function's output as n floats (None -> NaN); RewardError when it is not."""
    try:
        values = list(values)
    except TypeError:
        raise RewardError(f"reward function {name} returned a {type(values).__name__}, not a list") from None
    if len(values) != n:
        raise RewardError(f"reward function {name} returned {len(values)} rewards for {n} completions")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
        elif (isinstance(v, (int, float)) and not isinstance(v, bool)) or (
            isinstance(v, torch.Tensor) and v.numel() == 1
        ):
            out.append(float(v))
        else:
            raise RewardError(f"reward function {name} returned {v!r} for sample {i}, not a number or None")
    return out


@dataclass
class Rewards:
    """The run's reward functions (names, callables, weights), scoring a batch into ``[N, F]`` rewards."""

    names: list[str]
    functions: list[RewardFn]
    weights: torch.Tensor
    max_completion_length: int = 512

    @classmethod
    def from_config(cls, reward: RewardConfig, max_completion_length: int) -> Rewards:
        functions = [load_function(n) for n in reward.functions]
        weights = list(reward.weights) or [1.0] * len(functions)
        if len(weights) != len(functions):
            raise ConfigError(f"reward.weights has {len(weights)} values for {len(functions)} reward.functions")
        return cls(list(reward.functions), functions, torch.tensor(weights, dtype=torch.float32), max_completion_length)

    def _call(self, i: int, completions: list[str], kwargs: dict) -> list[float]:
        return _column(
            self.functions[i](completions=completions, max_completion_length=self.max_completion_length, **kwargs),
            self.names[i],
            len(completions),
        )

    def _failing_sample(self, i: int, completions: list[str], kwargs: dict) -> tuple[int, BaseException] | None:
        """The first completion the function raises on alone, and what it raised."""
        for k in range(len(completions)):
            one = {key: value[k : k + 1] for key, value in kwargs.items()}
            try:
                self._call(i, completions[k : k + 1], one)
            except RewardError:
                continue
            except Exception as exc:  # noqa: BLE001 (a user's function)
                return k, exc
        return None

    def score(
        self,
        completions: list[str],
        prompts: list | None = None,
        completion_ids: list[list[int]] | None = None,
        **fields: list,
    ) -> torch.Tensor:
        """``[N, F]`` float32: each function's reward of each completion (NaN where it returned None). ``fields``:
        the prompts' other row fields, one value per completion."""
        n = len(completions)
        kwargs = dict(fields, prompts=prompts if prompts is not None else [None] * n)
        kwargs["completion_ids"] = completion_ids if completion_ids is not None else [None] * n
        for key, value in kwargs.items():
            if len(value) != n:
                raise ValueError(f"reward field {key!r} has {len(value)} values for {n} completions")
        out = torch.empty(n, len(self.functions), dtype=torch.float32)
        for i, name in enumerate(self.names):
            try:
                out[:, i] = torch.tensor(self._call(i, completions, kwargs))
            except RewardError:
                raise
            except Exception as exc:  # noqa: BLE001 (a user's function: one line, naming it and the sample)
                found = self._failing_sample(i, completions, kwargs)
                where = f"on sample {found[0]} of {n}" if found else f"on the batch of {n} (no sample alone)"
                raise RewardError(
                    f"reward function {name} raised {where}: {_one_line(found[1] if found else exc)}"
                ) from None
        return out

    def metrics(self, per_function: torch.Tensor, zero_std: torch.Tensor) -> dict[str, float]:
        """TRL's reward metrics, a function named by its "module:function"'s function part."""
        names = [n.rpartition(":")[2] for n in self.names]
        return reward_metrics(per_function, self.weights, names, zero_std)


# --- built-ins --------------------------------------------------------------------------------------

_HASHES = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+")


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _canonical(answer: str) -> str:
    """A number as its value (1,000 / $1000.00 / 1000. -> 1000), anything else stripped of spaces and a final dot."""
    text = answer.strip().rstrip(".").strip()
    plain = text.replace(",", "").replace("$", "").strip()
    try:
        value = float(plain)
    except ValueError:
        return text
    return str(int(value)) if value.is_integer() else repr(value)


def extract_answer(text: str) -> str | None:
    """The answer in a GSM8K-style text: after the last ``####``, else the last ``\\boxed{}``, else the last
    number; canonical (numbers by value). None when there is none."""
    hashes = _HASHES.findall(text)
    if hashes and hashes[-1].strip():
        return _canonical(hashes[-1])
    boxed = _boxed(text)
    if boxed is not None and boxed.strip():
        return _canonical(boxed)
    numbers = _NUMBER.findall(text)
    return _canonical(numbers[-1]) if numbers else None


def exact_match(completions: list[str], answer: list, **kwargs) -> list[float]:
    """1.0 where the completion's extracted answer equals the row's ``answer`` (extracted the same way), else 0.0."""
    out = []
    for completion, truth in zip(completions, answer, strict=True):
        want = extract_answer(str(truth))
        out.append(float(want is not None and extract_answer(completion) == want))
    return out


THINK_FORMAT = r"^<think>(?!.*<think>)(.*?)</think>.*$"  # TRL's think_format_reward


def regex_reward(pattern: str, name: str = "regex_reward") -> RewardFn:
    """A reward of 1.0 where a completion matches ``pattern`` (re.match, DOTALL | MULTILINE), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL | re.MULTILINE)

    def reward(completions: list[str], **kwargs) -> list[float]:
        return [1.0 if compiled.match(c) else 0.0 for c in completions]

    reward.__name__ = name
    return reward


def format_match(completions: list[str], format_pattern: list | None = None, **kwargs) -> list[float]:
    """1.0 where the completion matches its row's ``format_pattern`` (TRL's think format when absent), else 0.0."""
    patterns = format_pattern or [None] * len(completions)
    return [
        1.0 if re.match(p or THINK_FORMAT, c, re.DOTALL | re.MULTILINE) else 0.0
        for c, p in zip(completions, patterns, strict=True)
    ]


def overlong_penalty(max_completion_length: int, cache: int) -> RewardFn:
    """DAPO's soft overlong punishment with the given lengths (the module doc), on ``completion_ids``."""

    def reward(completion_ids: list[list[int]], **kwargs) -> list[float]:
        start = max_completion_length - cache
        out = []
        for ids in completion_ids:
            n = len(ids)
            out.append(0.0 if n <= start else (start - n) / cache if n <= max_completion_length else -1.0)
        return out

    reward.__name__ = "overlong_penalty"
    return reward


def length_penalty(completion_ids: list[list[int]], max_completion_length: int, **kwargs) -> list[float]:
    """DAPO's soft overlong punishment, its cache a fifth of ``grpo.max_completion_length``."""
    cache = max(1, max_completion_length // 5)
    return overlong_penalty(max_completion_length, cache)(completion_ids)
