"""Preference optimization in the VLM recipe (preference.loss): pairs with images, the frozen reference, and the step's
loss with TRL's metrics. The objective itself is common/preference.py's, the one the LLM recipe trains.

A pair (``python -m data.prepare_preference --images``: format llava-preference) is a prompt (turns with ``<image>``
where its images go), its images, and a chosen and a rejected answer. Decoding makes its two conversations, prompt +
chosen and prompt + rejected, and tokenizes each with the architecture's own conversation encoder (LLaVA's or
Qwen-VL's, recipes/vlm/inputs.py), as supervised conversations are, labelled on the final answer only (its text and
end of turn; the prompt's earlier answers are prompt). A pair either side of which does not fit data.max_seq_len
whole is dropped, never cut, and counted (``skipped_pairs`` in metrics.jsonl).

Both documents of every pair of a micro-batch go through one forward: the architecture's collate packs them
(data.packing: no attention across documents, positions per document) or pads them, and ``sample_index`` maps each
position back to its document, chosen of pair k = 2k, rejected = 2k+1, whatever row the packer chose. The loss is
summed over the rank's pairs and the step divides by the global count of pairs (common/trainer.py): a mean over pairs.

The reference (the losses that need one), built once from where the policy started (model.init_from, or the same
seeded fresh weights): under ZeRO-3 a frozen copy sharded over the ranks as the policy (a DeepSpeed engine without an
optimizer), under ZeRO 0-2 a frozen copy on every rank in the policy's dtype; under finetune=lora the policy itself
with its adapter disabled (no copy). preference.reference=precomputed is refused on the VLM (recipes/vlm/config.py).
"""

from __future__ import annotations

import contextlib
import functools
import json

import torch

from common.config import TrainConfig
from common.data.webdataset import global_train_loader, iter_samples
from common.lora import adapters_disabled
from common.preference import METRICS, PairTraining, answer_logps, check_pair_data, preference_loss, sample_index
from common.seed import seed_everything
from recipes.vlm.data import PAIRS as PAIR_FORMAT
from recipes.vlm.data import decode_image, pack_plan
from recipes.vlm.qwen import ImageTokensExceed


def check_data(cfg: TrainConfig, meta: dict) -> None:
    """One line for pairs without preference.loss, or preference.loss on other data."""
    builder = "python -m data.prepare_preference --images"
    check_pair_data(cfg.data.root, cfg.preference.loss, meta, PAIR_FORMAT, other="digits", builder=builder)


def final_answer(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` with only the last run of labelled positions kept: the final assistant turn (a turn's labels are
    contiguous, turns are rendered in order, and every labelled run is an assistant turn)."""
    labelled = (labels != -100).nonzero().flatten()
    if not labelled.numel():
        return labels
    gaps = (labelled[1:] - labelled[:-1] > 1).nonzero().flatten()
    start = int(labelled[gaps[-1] + 1]) if gaps.numel() else int(labelled[0])
    out = labels.clone()
    out[:start] = -100
    return out


def decode_pair(sample: dict, encode) -> dict:
    """Raw pair sample -> ``{"docs": [chosen, rejected], "key"}``, each document the encoder's training sequence
    labelled on its answer; ``{"skipped": reason, "key"}`` when either does not fit whole. ``encode(messages,
    images)``: the architecture's conversation encoder, cutting at data.max_seq_len (module-level partials, so the
    loader's workers can run it)."""
    record = json.loads(sample["json"])
    images = [decode_image(sample[f"image{i}"]) for i in range(record["num_images"])]
    docs = []
    for answer in (record["chosen"], record["rejected"]):
        try:
            doc = encode([*record["prompt"], {"role": "assistant", "content": answer}], images)
        except ImageTokensExceed as exc:  # Qwen-VL: its image tokens alone over data.max_seq_len
            return {"skipped": str(exc), "key": record["id"]}
        if doc.get("truncated") or "skipped" in doc:
            return {"skipped": "a side over data.max_seq_len", "key": record["id"]}
        docs.append({**doc, "labels": final_answer(doc["labels"])})
    return {"docs": docs, "key": record["id"]}


def measure_pair(sample: dict, measure) -> tuple[int, int]:
    """A raw pair's (language-model tokens, tower patches), both documents, for data.pack_buffer's plan: the
    architecture's ``measure`` of a raw conversation sample, run on each side's."""
    record = json.loads(sample["json"])
    sizes = [
        measure(
            sample
            | {
                "json": json.dumps(
                    {**record, "messages": [*record["prompt"], {"role": "assistant", "content": answer}]}
                )
            }
        )
        for answer in (record["chosen"], record["rejected"])
    ]
    return sizes[0][0] + sizes[1][0], sizes[0][1] + sizes[1][1]


def collate_pairs(pairs: list[dict], collate) -> dict:
    """This rank's pairs as one micro-batch of documents (chosen, rejected per pair), through the architecture's
    ``collate``, with ``doc_index`` (each position's document), ``pairs``, ``keys`` and ``skipped_pairs``."""
    kept = [p for p in pairs if "docs" in p]
    docs = [doc for p in kept for doc in p["docs"]]
    batch = collate(docs)
    packed = batch["packed"] if "packed" in batch else batch["batch"].packed
    batch["doc_index"] = sample_index(packed.seq_lens, packed.order, packed.input_ids.shape[1], len(docs))
    return batch | {"pairs": len(kept), "keys": [p["key"] for p in kept], "skipped_pairs": len(pairs) - len(kept)}


def frozen_reference(cfg: TrainConfig, meta: dict, engine, dp: int) -> torch.nn.Module:
    """The starting weights, frozen: model.init_from's (or the seeded fresh weights, drawn as the policy's were), in
    the policy's dtype; under ZeRO-3 sharded over the ranks by a DeepSpeed engine without an optimizer (``dp``: the
    data-parallel ranks, as the policy's engine counts them)."""
    from common import deepspeed as ds
    from recipes.vlm.weights import load_model

    seed_everything(cfg.trainer.seed)  # the policy's fresh parts (a projector) drawn again, identically
    model = load_model(cfg, meta)[0].requires_grad_(False).eval()
    return ds.frozen_copy(model, cfg, dp, next(engine.module.parameters()))


class PreferenceTraining(PairTraining):
    """What VLMTrainer runs instead of supervised fine-tuning when preference.loss is set (recipes/vlm/train.py)."""

    def __init__(self, trainer, reference: torch.nn.Module | None = None):
        self.trainer, self.pref = trainer, trainer.cfg.preference
        self.adapter_off = self.pref.needs_reference and bool(trainer.lora_base)
        self.reference = reference  # built here unless given (tests/unit/test_vlm_preference.py gives TRL's)
        if self.reference is None and self.pref.needs_reference and not self.adapter_off:
            tr = trainer
            self.reference = frozen_reference(tr.cfg, tr.meta, tr.engine, tr.dims.dp)
        self.sums: dict[str, torch.Tensor] = {}

    def loader(self, inputs, *, rank: int, dp: int):
        """Data-parallel rank `rank` of `dp`'s loader of pairs: the global stream of pairs, this rank's share."""
        cfg = self.trainer.cfg
        decode = functools.partial(decode_pair, encode=inputs.conversation_encoder(cfg.data.max_seq_len))
        collate = functools.partial(collate_pairs, collate=inputs.collate_documents(cfg))
        plan = pack_plan(cfg, functools.partial(measure_pair, measure=inputs.measure()))
        urls = self.trainer.meta["train_urls"]
        return global_train_loader(cfg, urls, decode=decode, collate=collate, rank=rank, dp=dp, plan=plan)

    def logps(self, model, batch: dict, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Per document, the answer's summed log-prob and token count by ``model``."""
        labels = self.trainer.inputs.labels(batch).to(self.trainer.device)
        logits = model(**inputs, use_cache=False).logits.view(*labels.shape, -1)
        return answer_logps(logits, labels, batch["doc_index"].to(labels.device), 2 * batch["pairs"])

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per pair, the loss and TRL's metrics: the reference's forward (no grad), then the policy's."""
        tr = self.trainer
        inputs = tr.model_inputs(batch)
        inputs.pop("labels", None)  # the log-probs are read from the logits; no language-model loss
        ref = None
        if self.pref.needs_reference:
            reference = tr.engine.module if self.adapter_off else self.reference
            with torch.no_grad(), adapters_disabled(reference) if self.adapter_off else contextlib.nullcontext():
                ref = self.logps(reference, batch, inputs)[0]
        logps, counts = self.logps(tr.engine.model, batch, inputs)
        return preference_loss(self.pref, logps, counts, ref)

    @torch.no_grad()
    def evaluate(self, inputs, limit: int) -> dict:
        """The held-out loss and TRL's metrics over the val split's first `limit` pairs, in micro-batches of
        trainer.micro_batch_size pairs; every rank runs every batch (ZeRO-3 gathers weights collectively), so every
        rank holds the same means."""
        tr = self.trainer
        decode = functools.partial(decode_pair, encode=inputs.conversation_encoder(tr.cfg.data.max_seq_len))
        collate = inputs.collate_documents(tr.cfg)
        pairs = [decode(s) for s, _ in zip(iter_samples(tr.meta.get("val_urls", [])), range(limit))]
        size = tr.cfg.trainer.micro_batch_size
        totals = torch.zeros(2 + len(METRICS), dtype=torch.float64)
        for i in range(0, len(pairs), size):
            batch = collate_pairs(pairs[i : i + size], collate)
            if not batch["pairs"]:
                continue
            losses, metrics = self.forward(batch)
            totals += torch.tensor(
                [losses.sum().item(), batch["pairs"], *(metrics[k].sum().item() for k in METRICS)], dtype=torch.float64
            )
        count = max(float(totals[1]), 1.0)
        rest = {k: float(v) / count for k, v in zip(METRICS, totals[2:])}
        return {"val_loss": float(totals[0]) / count, "num_pairs": int(totals[1])} | rest
