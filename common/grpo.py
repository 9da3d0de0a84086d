"""GRPO's objective, written once on per-token log-probs and masks (no model inside), with TRL's names and meanings.

A batch holds B x G completions: G (``grpo.num_generations``) per prompt, a prompt's G consecutive. Rewards ``[B*G]``
become advantages by :func:`group_advantages` (TRL's ``scale_rewards``):

    A_i = r_i - mean(group of i)                       then, unless scale_rewards=none,
    A_i = A_i / (std + 1e-4)     std: of the group (group) or of the whole batch (batch), unbiased as TRL's nanstd

A reward that is NaN (every reward function returned None for the sample: common/rewards.py) is left out of the
group's mean and std and gets advantage 0. A group whose rewards are all equal teaches nothing under any scaling:
its advantages are 0. ``frac_reward_zero_std`` is the share of samples whose std is 0: their group's (the batch's
under scale_rewards=batch), as TRL logs it.

:func:`grpo_loss` is TRL's ``GRPOTrainer._compute_loss`` (trl 1.16) on given log-probs. Per completion token t, with
``logp`` the policy's log-prob (of the logits / temperature, as TRL takes it: :func:`token_logps`), ``old`` the
rollout's (the weights that sampled it), ``ref`` the frozen reference's:

    token     (importance_sampling_level=token)     w_t = exp(logp_t - old_t)
    sequence  (GSPO, Zheng et al. 2025)             w   = exp(mean over the completion's tokens of (logp_t - old_t))
    loss_t = -min(w A, clip(w, 1 - epsilon, 1 + epsilon_high) A)  +  beta w k3_t,
    k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1  (Schulman's k3 estimator of KL(policy || reference); beta 0:
           none, no reference needed)

The KL term is weighted by the (unclipped) ratio w, as TRL 1.16 does by default (``use_bias_correction_kl``,
DeepSeek-V3.2): the rollout's tokens were sampled from the old policy, so w makes its gradient the reverse KL's.

and the loss over the batch (``loss_type``), m the completion mask:

    grpo     per completion the mean of its tokens' loss, then the mean over completions
    bnpo     sum of the tokens' loss / the tokens of this batch
    dr_grpo  sum of the tokens' loss / (completions x max_completion_length)  (Dr. GRPO: a constant)
    dapo     sum of the tokens' loss / ``num_items``: the completion tokens of the whole optimizer step (every
             micro-batch, every rank) divided by the ranks whose gradients are averaged (TRL's num_items_in_batch /
             num_processes); this batch's tokens by default

grpo, bnpo and dr_grpo are divided by ``grad_accum`` too (the micro-batches one step sums), as TRL does; dapo's
``num_items`` already spans them. The metrics are TRL's names: ``clip_ratio/low_mean`` (tokens whose ratio fell under
1 - epsilon with A < 0: clipped), ``clip_ratio/high_mean`` (over 1 + epsilon_high with A > 0),
``clip_ratio/region_mean``, ``clip_ratio/low_min`` and ``clip_ratio/high_max`` (over completions), ``kl`` (the
tokens' mean w k3, when beta > 0); :func:`reward_metrics` and :func:`completion_metrics` the rest.
tests/unit/test_grpo.py holds all of it equal to TRL's own code on the same tensors.
"""

from __future__ import annotations

import torch

from common.config import GRPO_IMPORTANCE_LEVELS, GRPO_LOSS_TYPES, GRPO_SCALE_REWARDS, GRPOConfig, check_grpo

__all__ = [
    "GRPOConfig",
    "check_grpo",
    "completion_metrics",
    "group_advantages",
    "grpo_loss",
    "reward_metrics",
    "token_logps",
]

STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


def token_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B, T]`` float32 log-probs of ``targets`` ``[B, T]`` under ``logits`` ``[B, T, V]`` / temperature (the logits
    at position t predict target t): what TRL scores a completion with, at the sampling temperature."""
    scaled = logits.float() / temperature
    return scaled.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased std over the non-NaN values (as TRL's nanstd)."""
    keep = dict(dim=dim, keepdim=True) if dim is not None else {}
    mean = torch.nanmean(x, **keep)
    count = (~torch.isnan(x)).sum(**keep)
    var = torch.nanmean((x - mean) ** 2, **keep) * count / (count - 1)
    std = var.sqrt()
    return std.squeeze(dim) if dim is not None else std


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages ``[B*G]``, ``[B*G]`` bool: the sample's scale had std 0) of summed rewards ``[B*G]`` (NaN: not
    scored). ``scale_rewards``: group | batch | none (the module doc)."""
    if scale_rewards not in GRPO_SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}; one of {GRPO_SCALE_REWARDS}")
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards are not groups of num_generations={num_generations}")
    rewards = rewards.float()
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:  # group; under none the group's std only counts the groups that teach nothing
        std = _nanstd(grouped, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0), zero_std


def reward_metrics(
    per_function: torch.Tensor, weights: torch.Tensor, names: list[str], zero_std: torch.Tensor
) -> dict[str, float]:
    """TRL's reward metrics of ``per_function`` ``[N, F]`` rewards (NaN: a function that did not score the sample):
    ``rewards/<name>/mean|std`` per function, ``reward`` and ``reward_std`` of the weighted sum, and
    ``frac_reward_zero_std`` (:func:`group_advantages`' second value)."""
    out = {}
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = torch.nanmean(per_function[:, i]).item()
        out[f"rewards/{name}/std"] = _nanstd(per_function[:, i]).item()
    total = weighted_sum(per_function, weights)
    out["reward"] = torch.nanmean(total).item()
    out["reward_std"] = _nanstd(total).item()
    out["frac_reward_zero_std"] = zero_std.float().mean().item()
    return out


def weighted_sum(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[N]``: each sample's weighted sum over the functions that scored it; NaN where none did (as TRL)."""
    total = (per_function * weights.to(per_function)[None, :]).nansum(dim=1)
    return total.masked_fill(torch.isnan(per_function).all(dim=1), float("nan"))


def completion_metrics(lengths: list[int], terminated: list[bool]) -> dict[str, float]:
    """TRL's ``completions/*``: lengths' mean/min/max, ``clipped_ratio`` (the share that hit max_completion_length
    without an end token) and the terminated ones' mean/min/max (0 when none ended)."""
    t = torch.tensor(lengths, dtype=torch.float32)
    ended = torch.tensor(terminated, dtype=torch.bool)
    done = t[ended] if ended.any() else torch.zeros(1)
    return {
        "completions/mean_length": t.mean().item(),
        "completions/min_length": t.min().item(),
        "completions/max_length": t.max().item(),
        "completions/clipped_ratio": (~ended).float().mean().item(),
        "completions/mean_terminated_length": done.mean().item(),
        "completions/min_terminated_length": done.min().item(),
        "completions/max_terminated_length": done.max().item(),
    }


def _reduce(cfg: GRPOConfig, per_token: torch.Tensor, mask: torch.Tensor, num_items, grad_accum: int) -> torch.Tensor:
    """The batch's loss from per-token losses by ``cfg.loss_type`` (the module doc)."""
    masked = per_token * mask
    if cfg.loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / grad_accum
    if cfg.loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / grad_accum
    if cfg.loss_type == "dr_grpo":
        return masked.sum() / (per_token.size(0) * cfg.max_completion_length) / grad_accum
    if cfg.loss_type == "dapo":
        items = mask.sum() if num_items is None else torch.as_tensor(num_items, dtype=masked.dtype)
        return masked.sum() / items.clamp(min=1.0)
    raise ValueError(f"grpo.loss_type={cfg.loss_type!r}; one of {GRPO_LOSS_TYPES}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """The tokens' mean (one value per sequence at the sequence level: the sequences' mean)."""
    if x.shape[1] == 1:
        return x.mean().item()
    return ((x * mask).sum() / mask.sum().clamp(min=1.0)).item()


def _per_sequence(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each completion's mean, the completions without a token left out (TRL's nanmin/nanmax)."""
    values = x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)
    return values[~torch.isnan(values)]


def grpo_loss(
    cfg: GRPOConfig,
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logps: torch.Tensor | None = None,
    *,
    num_items: float | torch.Tensor | None = None,
    grad_accum: int = 1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss (a scalar) and TRL's metrics of one batch: ``logps``, ``old_logps``, ``ref_logps`` ``[B, T]``
    (the policy's with grad; the rollout's; the reference's, needed iff beta > 0), ``advantages`` ``[B]``, ``mask``
    ``[B, T]`` (1 on completion tokens). ``num_items`` and ``grad_accum``: the module doc."""
    if cfg.importance_sampling_level not in GRPO_IMPORTANCE_LEVELS:
        raise ValueError(
            f"importance_sampling_level={cfg.importance_sampling_level!r}; one of {GRPO_IMPORTANCE_LEVELS}"
        )
    mask = mask.to(logps.dtype)
    adv = advantages.to(logps.dtype)[:, None]
    log_ratio = logps - old_logps
    if cfg.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - cfg.epsilon, 1 + cfg.clip_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    metrics = {}
    if cfg.beta != 0.0:
        if ref_logps is None:
            raise ValueError(f"grpo.beta={cfg.beta} needs the reference's log-probs")
        delta = ref_logps - logps
        kl = (torch.exp(delta) - delta - 1) * ratio  # weighted by the ratio: TRL's use_bias_correction_kl (default)
        per_token = per_token + cfg.beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)
    loss = _reduce(cfg, per_token, mask, num_items, grad_accum)
    ratio = ratio.detach()
    low = ((ratio < 1 - cfg.epsilon) & (adv < 0)).float()
    high = ((ratio > 1 + cfg.clip_high) & (adv > 0)).float()
    metrics["clip_ratio/low_mean"] = _masked_mean(low, mask)
    metrics["clip_ratio/high_mean"] = _masked_mean(high, mask)
    metrics["clip_ratio/region_mean"] = _masked_mean(torch.maximum(low, high), mask)
    metrics["clip_ratio/low_min"] = _per_sequence(low, mask).min().item()
    metrics["clip_ratio/high_max"] = _per_sequence(high, mask).max().item()
    return loss, metrics
