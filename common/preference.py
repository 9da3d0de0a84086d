"""Preference optimization's objective, written once for every family that trains on pairs: the answers' log-probs
from a forward's logits, and the pairwise losses with the metrics TRL logs under the same names.

A pair is a prompt with a chosen and a rejected answer. Both answers of a pair go through one forward (packed into
one row as two documents that never attend to each other), so a batch's logits hold 2 x pairs documents, numbered
in row-major order: document 2k is pair k's chosen answer (its prompt included), 2k+1 its rejected one. Only the
answer tokens are labelled; ``answer_logps`` sums their log-probs per document.

The losses (``preference.loss``), per pair, with c/r the chosen/rejected answers, ``logp`` the policy's summed
answer log-prob, ``ref`` the reference's, ``n`` the answer's token count, beta/epsilon/gamma
``preference.beta``/``label_smoothing``/``gamma``:

    sigmoid  DPO (Rafailov et al. 2023) with conservative label smoothing (cDPO):
             -(1-eps) logsig(beta d) - eps logsig(-beta d),  d = (logp_c - ref_c) - (logp_r - ref_r)
    ipo      IPO (Azar et al. 2023, eq. 17) on per-token log ratios, as TRL normalizes it (with the authors):
             ((logp_c - ref_c)/n_c - (logp_r - ref_r)/n_r - 1/(2 beta))^2
    hinge    SLiC (Zhao et al. 2023): relu(1 - beta d)
    simpo    SimPO (Meng et al. 2024), reference-free, on the mean answer log-prob m = logp/n:
             -(1-eps) logsig(beta (m_c - m_r) - gamma) - eps logsig(-(beta (m_c - m_r) - gamma))
    orpo     ORPO (Hong et al. 2024), reference-free: -mean log-prob of the chosen answer's tokens (the SFT term)
             - beta logsig(log odds(m_c) - log odds(m_r)),  log odds(m) = m - log(1 - exp(m))

The rewards TRL logs: beta (logp - ref) for the reference-based losses (DPOTrainer), beta m for SimPO and ORPO
(CPOTrainer, ORPOTrainer). ``rewards/margins`` is chosen - rejected, ``rewards/accuracies`` the fraction of pairs
whose chosen reward is the higher, ``logps/chosen|rejected`` the log-probs the loss reads (sums; means for SimPO and
ORPO). tests/unit/test_preference.py holds each loss and each reward equal to TRL's own code on the same batch.

One difference from TRL, on purpose: TRL's ORPOTrainer takes its SFT term over the prompt's tokens too (a token mean
over the whole batch); here it is the chosen answer's tokens only, per pair, as in the ORPO paper's L_SFT, and as
Kiln's supervised fine-tuning trains on the assistant's tokens only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from common.config import PREFERENCE_LOSSES as LOSSES
from common.config import PREFERENCE_REFERENCE_FREE as REFERENCE_FREE
from common.config import PREFERENCE_REFERENCES as REFERENCES
from common.config import PreferenceConfig
from common.data.packing import IGNORE_INDEX
from common.errors import ConfigError, DataError

__all__ = [
    "LOSSES",
    "PairTraining",
    "REFERENCE_FREE",
    "PreferenceConfig",
    "answer_logps",
    "check_pair_data",
    "check_config",
    "eval_summary",
    "preference_loss",
    "sample_index",
]

# TRL's names (DPOTrainer, CPOTrainer, ORPOTrainer) for what metrics.jsonl logs of a preference step.
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


def check_config(pref: PreferenceConfig, family: str, offered: bool) -> None:
    """One line for a preference setting that cannot run: an unknown loss, a family without preference training,
    a reference given to a reference-free loss (or none to one that needs it), values out of range."""
    if not pref.enabled:
        return
    if pref.loss not in LOSSES:
        raise ConfigError(f"preference.loss={pref.loss!r} is not allowed; choose one of: {', '.join(LOSSES)}")
    if not offered:
        raise ConfigError(
            f"preference.loss={pref.loss}: the {family} recipes have no preference training (the llm and vlm "
            "recipes do)"
        )
    if pref.reference not in REFERENCES:
        raise ConfigError(
            f"preference.reference={pref.reference!r} is not allowed; choose one of: {', '.join(REFERENCES)}"
        )
    if pref.loss in REFERENCE_FREE and pref.reference in ("model", "precomputed"):
        raise ConfigError(
            f"preference.loss={pref.loss} is reference-free: it takes no preference.reference (got "
            f"{pref.reference}); drop it"
        )
    if pref.loss not in REFERENCE_FREE and pref.reference == "none":
        raise ConfigError(
            f"preference.loss={pref.loss} needs a reference (preference.reference=auto, model or precomputed); "
            f"the reference-free losses are {', '.join(REFERENCE_FREE)}"
        )
    if pref.beta <= 0:
        raise ConfigError(f"preference.beta={pref.beta} must be > 0")
    if not 0.0 <= pref.label_smoothing < 0.5:
        raise ConfigError(f"preference.label_smoothing={pref.label_smoothing} must be in [0, 0.5)")
    if pref.label_smoothing and pref.loss not in ("sigmoid", "simpo"):
        raise ConfigError(
            f"preference.label_smoothing={pref.label_smoothing} applies to the sigmoid and simpo losses only "
            f"(preference.loss={pref.loss})"
        )


def check_pair_data(root: str, loss: str, meta: dict, pair_format: str, *, other: str, builder: str) -> None:
    """One line (DataError) for pair data without preference.loss (``loss`` empty), or preference.loss on other data:
    ``meta`` is the dataset's meta.json, ``pair_format`` the family's pair format, ``other`` what its other data is
    called when meta names no format, ``builder`` the command that builds pairs."""
    pairs = meta.get("format") == pair_format
    if pairs and not loss:
        raise DataError(f"data.root={root} holds preference pairs: set preference.loss ({', '.join(LOSSES)})")
    if loss and not pairs:
        raise DataError(
            f"preference.loss={loss} trains on preference pairs; data.root={root} holds "
            f"{meta.get('format') or other} data: build pairs with {builder}"
        )


def answer_logps(
    logits: torch.Tensor, labels: torch.Tensor, doc_index: torch.Tensor, num_docs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per document, the sum of its labelled tokens' log-probs and their count (float32, ``[num_docs]`` each).

    ``logits`` ``[R, L, V]``, ``labels`` ``[R, L]`` unshifted (IGNORE_INDEX where unlabelled: prompts, padding, each
    document's first position), ``doc_index`` ``[R, L]``: the document of each position (-1 on padding). Position t's
    logits predict label t+1, which belongs to the document of position t+1. Only the labelled positions are
    normalized (a gather of ``[N, V]``, N the answer tokens), in float32 whatever the logits' dtype."""
    targets, docs = labels[:, 1:], doc_index[:, 1:]
    keep = (targets != IGNORE_INDEX) & (docs >= 0)
    picked = logits[:, :-1][keep].float()  # [N, V]
    target = targets[keep]
    token_logps = picked.gather(-1, target[:, None]).squeeze(-1) - torch.logsumexp(picked, dim=-1)
    owner = docs[keep]
    sums = torch.zeros(num_docs, dtype=torch.float32, device=logits.device).index_add(0, owner, token_logps)
    counts = torch.zeros(num_docs, dtype=torch.float32, device=logits.device).index_add(
        0, owner, torch.ones_like(token_logps)
    )
    return sums, counts


def document_index(seq_lens: list[list[int]], row_len: int) -> torch.Tensor:
    """``[R, L]`` long: each position's document, numbered in row-major order (a PackedBatch's ``seq_lens``), -1 on
    the padding that ends a row."""
    out = torch.full((len(seq_lens), row_len), -1, dtype=torch.long)
    doc = 0
    for r, lens in enumerate(seq_lens):
        start = 0
        for n in lens:
            out[r, start : start + n] = doc
            start, doc = start + n, doc + 1
    return out


def sample_index(seq_lens: list[list[int]], order: list[int], row_len: int, num_samples: int) -> torch.Tensor:
    """``[R, L]`` long: each position's sample, for a batch packed in any order (a PackedBatch's ``seq_lens`` and
    ``order``: the samples of its segments in row-major order); -1 on padding and on the samples numbered
    ``num_samples`` or more (a stand-in a collate added, which holds no labels)."""
    owner = torch.tensor([i if i < num_samples else -1 for i in order] + [-1], dtype=torch.long)
    return owner[document_index(seq_lens, row_len)]  # a padding position's -1 picks the appended -1


def pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) of per-document values in pair order (document 2k chosen, 2k+1 rejected)."""
    return values[0::2], values[1::2]


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (Maechler 2012)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _smoothed(logits: torch.Tensor, eps: float) -> torch.Tensor:
    return -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)


def preference_loss(
    pref: PreferenceConfig,
    logps: torch.Tensor,
    counts: torch.Tensor,
    ref_logps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per pair, the loss and TRL's metrics (``[pairs]`` tensors each; ``rewards/accuracies`` 1.0 or 0.0 per pair;
    the metrics detached). ``logps``/``counts``: :func:`answer_logps` of the policy over 2 x pairs documents;
    ``ref_logps``: the reference's sums over the same documents (None for the reference-free losses)."""
    beta, eps = pref.beta, pref.label_smoothing
    chosen, rejected = pairs(logps)
    n_chosen, n_rejected = (n.clamp(min=1.0) for n in pairs(counts))
    if pref.loss in REFERENCE_FREE:
        if ref_logps is not None:
            raise ValueError(f"preference.loss={pref.loss} is reference-free: no reference log-probs")
        seen_c, seen_r = chosen / n_chosen, rejected / n_rejected  # mean answer log-probs
        reward_c, reward_r = beta * seen_c, beta * seen_r
        if pref.loss == "simpo":
            loss = _smoothed(beta * (seen_c - seen_r) - pref.gamma, eps)
        else:  # orpo: the chosen answer's token-mean NLL minus beta x the log-sigmoid of the log odds ratio
            log_odds = (seen_c - seen_r) - (_log1mexp(seen_c) - _log1mexp(seen_r))
            loss = -seen_c - beta * F.logsigmoid(log_odds)
    else:
        if ref_logps is None:
            raise ValueError(f"preference.loss={pref.loss} needs the reference's log-probs")
        ref_c, ref_r = pairs(ref_logps)
        ratio_c, ratio_r = chosen - ref_c, rejected - ref_r
        seen_c, seen_r = chosen, rejected
        reward_c, reward_r = beta * ratio_c, beta * ratio_r
        if pref.loss == "sigmoid":
            loss = _smoothed(beta * (ratio_c - ratio_r), eps)
        elif pref.loss == "hinge":
            loss = torch.relu(1 - beta * (ratio_c - ratio_r))
        elif pref.loss == "ipo":
            loss = (ratio_c / n_chosen - ratio_r / n_rejected - 1 / (2 * beta)) ** 2
        else:
            raise ValueError(f"unknown preference loss {pref.loss!r}")
    reward_c, reward_r = reward_c.detach(), reward_r.detach()
    metrics = {
        "rewards/chosen": reward_c,
        "rewards/rejected": reward_r,
        "rewards/margins": reward_c - reward_r,
        "rewards/accuracies": (reward_c > reward_r).float(),
        "logps/chosen": seen_c.detach(),
        "logps/rejected": seen_r.detach(),
    }
    return loss, metrics


def eval_summary(result: dict) -> str:
    """The line a held-out preference evaluation prints (any family)."""
    return (
        f"kiln: eval preference loss {result['val_loss']:.4f}, rewards/accuracies "
        f"{result['rewards/accuracies']:.3f} on {result['num_pairs']} held-out pairs"
    )


class PairTraining:
    """What a family's preference training shares (recipes/llm/preference.py, recipes/vlm/preference.py): the step's
    loss summed over a micro-batch's pairs, and TRL's metrics summed beside it. The family gives ``forward(batch) ->
    (per-pair losses, metrics)``."""

    sums: dict[str, torch.Tensor]
    forward: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]  # the family's own method

    def loss(self, batch) -> torch.Tensor:
        """The micro-batch's loss summed over its pairs; its metrics summed into the step's (``terms``)."""
        losses, metrics = self.forward(batch)
        for name in METRICS:
            self.sums[name] = self.sums.get(name, 0.0) + metrics[name].sum().double()
        return losses.sum()

    def terms(self) -> dict[str, torch.Tensor]:
        """The step's metric sums over this rank's pairs (the step divides them by the global count of pairs)."""
        out, self.sums = self.sums, {}
        return out
