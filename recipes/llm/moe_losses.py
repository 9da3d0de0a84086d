"""MoE auxiliary losses from per-layer routing sums: the load-balancing loss exactly as transformers computes it
for Mixtral / Qwen2-MoE / Qwen3-MoE (``load_balancing_loss_func``) and the router z-loss (ST-MoE).

Both are built from SUMS over tokens (expert counts, router-probability sums, squared-logsumexp sums, the
token count) so that they can be added up across micro-batches, layers and ranks before the ratios are
taken: under expert or data parallelism, all-reducing the non-differentiable sums (counts, tokens) gives
the same loss and the same gradient as one rank holding every token (see :func:`load_balancing_loss`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from recipes.llm.model import MoE, Routing


class RouterSums(NamedTuple):
    """One or more layers' routing, summed over their (real) tokens."""

    tokens_per_expert: Tensor  # [E] fp32: how many (token, choice) pairs picked each expert; no gradient
    prob_sum: Tensor  # [E] fp32: the router's softmax probabilities summed over tokens; differentiable
    z_sum: Tensor  # () fp32: sum over tokens of logsumexp(logits)^2; differentiable
    num_tokens: Tensor  # () fp32: the tokens summed over (per layer, added over layers as transformers does)

    def __add__(self, other: RouterSums) -> RouterSums:  # type: ignore[override]
        return RouterSums(*(a + b for a, b in zip(self, other)))


def router_sums(routing: Routing, token_mask: Tensor | None = None) -> RouterSums:
    """The sums of one layer's routing over its tokens; ``token_mask`` ``[T]`` (bool or 0/1) leaves out padding,
    as transformers' attention_mask does."""
    num_experts = routing.probs.shape[-1]
    mask = (torch.ones(routing.probs.shape[0], device=routing.probs.device) if token_mask is None
            else token_mask.reshape(-1).to(routing.probs.device, torch.float32))
    counts = torch.zeros(num_experts, dtype=torch.float32, device=mask.device).scatter_add_(
        0, routing.experts.reshape(-1), mask.repeat_interleave(routing.experts.shape[-1]))
    prob_sum = (routing.probs * mask[:, None]).sum(0)
    z_sum = (torch.logsumexp(routing.logits, dim=-1).square() * mask).sum()
    return RouterSums(counts, prob_sum, z_sum, mask.sum())


def model_router_sums(moe_layers: list[MoE], token_mask: Tensor | None = None) -> RouterSums:
    """The sums of every MoE layer's last forward, added over the layers (transformers concatenates the
    layers' router logits before taking its means: one pool of layer-tokens)."""
    return pooled([router_sums(layer.routing, token_mask) for layer in moe_layers])


def pooled(sums: list[RouterSums]) -> RouterSums:
    total = sums[0]
    for s in sums[1:]:
        total = total + s
    return total


def global_counts(sums: RouterSums, weight: Tensor, layer_counts: Tensor, group) -> tuple[RouterSums, Tensor, Tensor]:
    """``sums`` with ``tokens_per_expert`` and ``num_tokens`` summed over the ranks of ``group`` (each rank's own
    ``prob_sum`` and ``z_sum`` kept), and ``weight`` and the per-layer ``layer_counts`` [L, E] summed too: one
    all-reduce, no host read. Over the ranks that share a micro-batch, :func:`load_balancing_loss` and
    :func:`z_loss` of the result add up over the ranks to the losses of the whole micro-batch, and so do their
    gradients."""
    import torch.distributed as tdist

    num_experts = sums.tokens_per_expert.shape[0]
    counts = torch.cat([sums.tokens_per_expert, sums.num_tokens.reshape(1), weight.reshape(1).float(),
                        layer_counts.flatten()])
    tdist.all_reduce(counts, group=group)
    return (sums._replace(tokens_per_expert=counts[:num_experts], num_tokens=counts[num_experts]),
            counts[num_experts + 1], counts[num_experts + 2:].view_as(layer_counts))


def expert_load(layer_counts: Tensor) -> tuple[Tensor, Tensor]:
    """Per layer, from its tokens per expert [L, E]: the busiest expert's load over the mean load (1 = perfectly
    balanced, E = every token on one expert) and the entropy of the load distribution over log E (1 = balanced,
    0 = one expert)."""
    num_experts = layer_counts.shape[-1]
    total = layer_counts.sum(-1).clamp(min=1)
    max_over_mean = layer_counts.max(-1).values * num_experts / total
    share = layer_counts / total[:, None]
    entropy = -(share * share.clamp(min=1e-30).log()).sum(-1) / math.log(num_experts)
    return max_over_mean, entropy


def load_balancing_loss(sums: RouterSums) -> Tensor:
    """``E * sum_e f_e * P_e`` with f = tokens_per_expert / N and P = prob_sum / N (Switch Transformer eq. 4-6;
    transformers' ``load_balancing_loss_func``, whose f sums to top_k).

    Only ``prob_sum`` carries a gradient. To get the loss of tokens spread over ranks (expert/data
    parallelism), all-reduce ``tokens_per_expert`` and ``num_tokens`` first and keep each rank's own
    ``prob_sum``: the ranks' losses then add up to the global loss, and so do their gradients.
    """
    num_experts = sums.prob_sum.shape[0]
    n = sums.num_tokens.clamp(min=1)
    return num_experts * torch.sum((sums.tokens_per_expert / n) * (sums.prob_sum / n))


def z_loss(sums: RouterSums) -> Tensor:
    """Router z-loss (ST-MoE): the mean over tokens (and MoE layers) of logsumexp(router logits)^2."""
    return sums.z_sum / sums.num_tokens.clamp(min=1)
