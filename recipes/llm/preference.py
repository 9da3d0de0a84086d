"""Preference optimization in the LLM recipe (preference.loss): the pair shards decoded and packed, the frozen
reference, and the step's loss with TRL's metrics. The objective itself is common/preference.py's.

A pair (data/prepare_preference.py) is one sample in the stream: laid whole into a row (never cut), then split into its
two documents, chosen then rejected, which the packed row's block-diagonal mask keeps from attending to each other
(per-document positions, as every packed document). So a pair's two answers go through one forward, and a micro-batch
is ``trainer.micro_batch_size`` rows of ``data.max_seq_len`` tokens per data-parallel rank, as in SFT. The loss is
summed over the rank's pairs and the step divides by the global count of pairs (common/trainer.py): a mean over pairs.

The reference (the losses that need one): a frozen copy of the starting weights, built and sharded as the policy
(``build_model``) and filled as the run started (model.init_from, else the seeded init), so a resumed run gets the same
reference; under finetune=lora, the policy itself with its adapter disabled (no copy). Its forward runs first, under
no_grad, on the same packed rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io

import numpy as np
import torch

from common.config import TrainConfig
from common.data.packing import IGNORE_INDEX, PackedBatch, pack_rows
from common.errors import DataError
from common.lora import adapters_disabled
from common.preference import METRICS, PairTraining, answer_logps, check_pair_data, document_index, preference_loss
from recipes.llm import reference_logps
from recipes.llm.data import eval_batches, model_inputs

PAIR_FORMAT = "preference"  # meta.json "format" of data/prepare_preference.py's shards


def check_data(cfg: TrainConfig, meta: dict) -> None:
    """One line for pair shards without preference.loss, other shards with it, or pairs longer than a row."""
    loss = cfg.preference.loss
    check_pair_data(cfg.data.root, loss, meta, PAIR_FORMAT, other="text", builder="python -m data.prepare_preference")
    pairs = meta.get("format") == PAIR_FORMAT
    if pairs and meta["longest_sample"] > cfg.data.max_seq_len:
        raise DataError(
            f"data.root={cfg.data.root} holds pairs of up to {meta['longest_sample']} tokens (both answers), more than "
            f"data.max_seq_len={cfg.data.max_seq_len}: raise it or rebuild with --max-seq-len {cfg.data.max_seq_len}"
        )


def decode_pair(sample: dict) -> dict:
    """Raw WebDataset sample -> ``{"input_ids", "labels", "first"}``: both documents' ids, labels on the answers
    (-100 on the prompts), and the chosen document's length. Module-level: picklable for the loader's workers."""
    ids, mask, lens = (np.load(io.BytesIO(sample[f"{k}.npy"]), allow_pickle=False) for k in ("ids", "mask", "lens"))
    if ids.ndim != 1 or mask.shape != ids.shape or lens.shape != (2,) or int(lens.sum()) != ids.size:
        raise ValueError(f"{sample.get('__key__')}: not a preference pair (ids {ids.shape}, mask {mask.shape}, lens)")
    input_ids = torch.from_numpy(ids.astype(np.int64))
    labels = input_ids.masked_fill(torch.from_numpy(mask == 0), IGNORE_INDEX)
    key = sample.get("__key__", "")  # the pair's name in its shard: preference.reference=precomputed looks it up
    return {"input_ids": input_ids, "labels": labels, "first": torch.tensor(int(lens[0])), "key": key}


def split_pair(pair: dict) -> tuple[dict, dict]:
    """A decoded pair's chosen and rejected documents."""
    n = int(pair["first"])
    ids, labels = pair["input_ids"], pair["labels"]
    return {"input_ids": ids[:n], "labels": labels[:n]}, {"input_ids": ids[n:], "labels": labels[n:]}


@dataclasses.dataclass
class PairBatch:
    """This dp rank's rows of pairs, packed: document 2k is pair k's chosen answer, 2k+1 its rejected one."""

    packed: PackedBatch
    doc_index: torch.Tensor  # [R, L]: each position's document, -1 on padding
    pairs: int
    keys: list[str]  # the pairs' keys, in order
    cp: None = None  # no context parallelism under preference training (recipes/llm/config.py)


def pack_pairs(rows: list[list[dict]], *, dp_rank: int, dp: int, max_seq_len: int, pad_id: int) -> PairBatch:
    """This dp rank's rows of a global micro-batch of pairs (rows r, r+dp, ...), each pair two packed documents."""
    mine = rows[dp_rank::dp]
    packed = pack_rows([[doc for pair in row for doc in split_pair(pair)] for row in mine], max_seq_len, pad_id)
    keys = [pair["key"] for row in mine for pair in row]
    return PairBatch(packed, document_index(packed.seq_lens, max_seq_len), len(keys), keys)


def fill_start_weights(model: torch.nn.Module, args, cfg: TrainConfig, is_main: bool) -> None:
    """The weights the run started from, whatever it resumed: model.init_from's, else rank 0's seeded init copied
    into every rank's shards (recipes/llm/train.py:load_weights does the same for the policy)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from recipes.llm import weights
    from recipes.llm.model import Transformer

    if cfg.model.init_from:
        weights.load_weights(model, args, cfg.model.init_from)
        return
    full = None
    if is_main:
        start = Transformer(args)
        start.init_weights(seed=cfg.trainer.seed)
        full = start.state_dict()
    set_model_state_dict(model, full or {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


class PreferenceTraining(PairTraining):
    """What LLMTrainer runs instead of next-token prediction when preference.loss is set (recipes/llm/train.py)."""

    def __init__(self, trainer, build_model):
        self.trainer, self.pref = trainer, trainer.cfg.preference
        self.reference: torch.nn.Module | None = None
        self.adapter_off = self.pref.needs_reference and trainer.lora
        self.precomputed = self.pref.needs_reference and self.pref.reference == "precomputed"
        self.table: dict[str, tuple[float, float]] | None = None  # precomputed: key -> the reference's log-probs
        if self.pref.needs_reference and not trainer.lora and not self.precomputed:
            self.reference = build_model(trainer.args, trainer.cfg, trainer.mesh, trainer.device)
            fill_start_weights(self.reference, trainer.args, trainer.cfg, trainer.dist.is_main)
            self.reference.requires_grad_(False)
            self.reference.eval()
        self.sums: dict[str, torch.Tensor] = {}

    def after_start(self) -> None:
        """preference.reference=precomputed: the reference's log-probs of every pair, read from beside the data, the
        shards it lacks computed first by the policy at its starting weights (recipes/llm/reference_logps.py)."""
        if self.precomputed:
            self.table = reference_logps.load_or_compute(self.trainer, self.reference_rows, decode_pair)

    @torch.no_grad()
    def reference_rows(self, pairs: list[dict]) -> list[tuple[str, float, float]]:
        """(key, chosen, rejected) reference log-probs of `pairs`, laid into global micro-batches as training lays
        them (every rank the same batches, each dp rank its rows), gathered from every rank."""
        tr, rows = self.trainer, []
        tr.model.eval()
        for global_rows in eval_batches(
            pairs, tr.cfg.trainer.micro_batch_size * tr.dims.dp, tr.cfg.data.max_seq_len, chat=True
        ):
            batch = self.prepare(global_rows)
            with tr.objective.forward():  # the step's autocast, as the live reference runs
                logps = self.reference_logps(batch, tr.model).tolist()
            rows += [(key, logps[2 * i], logps[2 * i + 1]) for i, key in enumerate(batch.keys)]
        tr.model.train()
        return reference_logps.gather_rows(rows)

    def reference_logps(self, batch: PairBatch, model: torch.nn.Module) -> torch.Tensor:
        """The summed answer log-probs of `batch`'s documents by `model` under no_grad, its adapter off under LoRA."""
        tr, device, packed = self.trainer, self.trainer.device, batch.packed
        inputs = model_inputs(packed, tr.cfg.toggles.attention, device)
        with torch.no_grad(), adapters_disabled(model) if self.adapter_off else contextlib.nullcontext():
            logits = model(packed.input_ids.to(device), **inputs)
            return answer_logps(logits, packed.labels.to(device), batch.doc_index.to(device), 2 * batch.pairs)[0]

    def prepare(self, rows: list[list[dict]]) -> PairBatch:
        tr = self.trainer
        return pack_pairs(
            rows, dp_rank=tr.dp_rank, dp=tr.dims.dp, max_seq_len=tr.cfg.data.max_seq_len, pad_id=tr.pad_id
        )

    def forward(self, batch: PairBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per pair, the loss and TRL's metrics: the reference's forward (no grad), then the policy's."""
        tr, device = self.trainer, self.trainer.device
        packed = batch.packed
        ids, labels = packed.input_ids.to(device), packed.labels.to(device)
        docs, n = batch.doc_index.to(device), 2 * batch.pairs
        inputs = model_inputs(packed, tr.cfg.toggles.attention, device)
        with tr.objective.forward():
            ref = None
            if self.table is not None:
                ref = reference_logps.lookup(self.table, batch.keys, device)
            elif self.pref.needs_reference:
                ref = self.reference_logps(batch, tr.model if self.adapter_off else self.reference)
            logps, counts = answer_logps(tr.model(ids, **inputs), labels, docs, n)
        return preference_loss(self.pref, logps, counts, ref)

    @torch.no_grad()
    def evaluate(self, pairs: list[dict]) -> dict:
        """The held-out loss and TRL's metrics over ``pairs``, laid into global micro-batches as training lays them;
        every rank runs every batch (FSDP is collective). The values are means over the pairs of every rank."""
        tr = self.trainer
        rows = tr.cfg.trainer.micro_batch_size * tr.dims.dp
        totals = torch.zeros(2 + len(METRICS), dtype=torch.float64, device=tr.device)
        tr.model.eval()
        for global_rows in eval_batches(pairs, rows, tr.cfg.data.max_seq_len, chat=True):
            batch = self.prepare(global_rows)
            losses, metrics = self.forward(batch)
            totals += torch.stack(
                [
                    losses.sum().double(),
                    torch.tensor(float(batch.pairs), dtype=torch.float64, device=tr.device),
                    *(metrics[k].sum().double() for k in METRICS),
                ]
            )
        tr.model.train()
        totals = tr.engine.all_reduce(totals).tolist()
        count = max(totals[1], 1.0)
        return {"val_loss": totals[0] / count, "num_pairs": int(totals[1])} | {
            k: v / count for k, v in zip(METRICS, totals[2:])
        }
