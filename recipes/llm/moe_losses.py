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
    mask = (
        torch.ones(routing.probs.shape[0], device=routing.probs.device)
        if token_mask is None
        else token_mask.reshape(-1).to(routing.probs.device, torch.float32)
    )
    counts = torch.zeros(num_experts, dtype=torch.float32, device=mask.device).scatter_add_(
        0, routing.experts.reshape(-1), mask.repeat_interleave(routing.experts.shape[-1])
    )
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
    counts = torch.cat(
        [sums.tokens_per_expert, sums.num_tokens.reshape(1), weight.reshape(1).float(), layer_counts.flatten()]
    )
    tdist.all_reduce(counts, group=group)
    return (
        sums._replace(tokens_per_expert=counts[:num_experts], num_tokens=counts[num_experts]),
        counts[num_experts + 1],
        counts[num_experts + 2 :].view_as(layer_counts),
    )


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


class MoEAux:
    """A run's MoE auxiliary losses: ``coef * load-balancing loss + coef * z-loss`` of each micro-batch's routing over
    its real tokens (padding left out, as transformers' attention_mask does), weighted by its labelled-token count; with
    the logged terms and the expert load they come with. The plain step (recipes/llm/train.py) and each pipeline stage
    (recipes/llm/pipeline_parallel.py) use it alike.

    Global: the token counts (per expert, in all), the weight and the per-layer load are all-reduced over ``group`` (the
    dp ranks, ep included; under context parallelism dp x cp, whose cp ranks route chunks of the same rows) and each
    rank keeps its own router-probability and z sums (:func:`global_counts`), so the ranks' terms add up to the loss,
    and the gradient, of one rank holding the whole micro-batch: every layout computes the same aux. Per micro-batch,
    not per step: the loss is a ratio of sums whose gradient needs every token's counts, which a step's later
    micro-batches do not have yet, so like transformers (one forward) and Megatron the aux belongs to a forward;
    grad_accum=2 x 4 documents is a different objective from 1 x 8 documents (and under pipeline parallelism, the unit
    is the pipeline's microbatch).

    Why weighted: the step divides the loss sum by the global labelled-token count (common/trainer.py), while these
    losses are already means over tokens. Times the micro-batch's global count, the step's objective is the
    token-weighted mean over micro-batches of ``ce + coef * aux``: on one micro-batch exactly transformers'
    ``loss + router_aux_loss_coef * aux_loss``, and its gradient.
    """

    def __init__(self, layers: dict[int, MoE], aux_coef: float, z_coef: float, group=None):
        self.layers, self.coefs, self.group = layers, (aux_coef, z_coef), group  # layers: this rank's, by layer index
        self.terms: dict[str, Tensor] = {}  # the step's unscaled aux_loss, z_loss, each times its weight
        self.load: dict[int, Tensor] = {}  # the step's global tokens per expert [E], by layer index

    def routed(self, real: Tensor, weight: Tensor, ids: list[int] | None = None) -> tuple[RouterSums, Tensor]:
        """The pooled sums of the last forward of layers ``ids`` (default: all of this rank's) over the tokens that
        ``real`` [T] marks, and ``weight`` (this rank's labelled tokens), counts made global; the load recorded."""
        ids = list(self.layers) if ids is None else ids
        per_layer = [router_sums(self.layers[i].routing, real) for i in ids]
        sums, load = pooled(per_layer), torch.stack([s.tokens_per_expert for s in per_layer])
        if self.group is not None:
            sums, weight, load = global_counts(sums, weight.float(), load, self.group)
        for i, row in zip(ids, load):
            self.load[i] = self.load[i] + row if i in self.load else row
        return sums, weight

    def loss(self, sums: RouterSums, weight: Tensor) -> Tensor:
        """The weighted aux of ``sums`` (to add to a micro-batch's summed cross-entropy); its terms recorded."""
        aux, z = load_balancing_loss(sums), z_loss(sums)
        for name, value in (("aux_loss", aux), ("z_loss", z)):  # logged unscaled: LLMTrainer.loss_terms
            self.terms[name] = self.terms.get(name, 0) + value.detach() * weight
        return (self.coefs[0] * aux + self.coefs[1] * z) * weight

    def pop_terms(self, device: torch.device) -> dict[str, Tensor]:
        """The step's terms, reset; zeros on a rank that routed nothing (a pipeline stage without MoE layers), so that
        every rank reduces the same terms."""
        terms, self.terms = self.terms, {}
        return {name: torch.as_tensor(terms.get(name, 0.0), device=device) for name in ("aux_loss", "z_loss")}

    def pop_load(self, ids: list[int], num_experts: int, device: torch.device) -> Tensor:
        """The step's load [len(ids), E] of layers ``ids``, zeros for layers this rank does not hold; reset."""
        load, self.load = self.load, {}
        zeros = torch.zeros(num_experts, device=device)
        return torch.stack([load.get(i, zeros) for i in ids])
