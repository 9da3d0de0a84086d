"""preference.reference=precomputed: the reference's log-probs of every pair (its chosen and rejected answers, summed
over the answer tokens), computed once before the first step and read back in every step instead of a reference
forward (TRL's precompute_ref_log_probs). The reference is the starting weights: at step 0 the policy itself (under
finetune=lora with its adapter disabled), so no second model is built.

They are kept beside the data, in ``<data.root>/reference_logps/<fingerprint>/``: one ``<shard>.npz`` per train or val
shard (pair key -> [chosen, rejected]), each written whole (to a temporary name, then renamed) as soon as it is
computed, so an interrupted precompute resumes at the first shard it lacks. The fingerprint is of what the log-probs
depend on: the reference's weights (model.init_from's fingerprint, or the seeded init's seed and shape), the shards
(their tokenizer's digest and files), the precision and the attention kernel. Other weights or another tokenizer name
another folder; a resumed run whose folder is incomplete (it cannot recompute: its policy is no longer the start)
stops with one line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from common.data.webdataset import iter_samples
from common.errors import DataError

FOLDER = "reference_logps"


def fingerprint(trainer) -> str:
    """What the reference's log-probs depend on, hashed."""
    from common.weights import fingerprint as weights_fingerprint

    cfg = trainer.cfg
    weights = (
        weights_fingerprint(cfg.model.init_from, f"model.init_from={cfg.model.init_from}")
        if cfg.model.init_from
        else {"seed": cfg.trainer.seed, "args": dataclasses.asdict(trainer.args)}
    )
    meta = trainer.meta
    parts = {
        "weights": weights,
        "tokenizer": meta.get("tokenizer_sha256"),
        "shards": meta.get("splits"),
        "precision": cfg.toggles.precision,
        "attention": cfg.toggles.attention,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def shard_file(folder: Path, url: str) -> Path:
    return folder / f"{Path(url).name.removesuffix('.tar')}.npz"


def load_or_compute(trainer, logps, decode) -> dict[str, tuple[float, float]]:
    """key -> (chosen, rejected) reference log-probs of every train and val pair: read from the folder, the shards it
    lacks computed first with `logps(pairs) -> [(key, chosen, rejected)]` (a collective forward: every rank runs it on
    the same pairs, each shard's samples through `decode`) and written by rank 0."""
    from common.distributed import barrier

    cfg = trainer.cfg
    folder = Path(cfg.data.root).expanduser().absolute() / FOLDER / fingerprint(trainer)
    urls = [*trainer.meta["train_urls"], *trainer.meta.get("val_urls", [])]
    missing = [u for u in urls if not shard_file(folder, u).exists()]
    if missing and trainer.state.step > 0:
        raise DataError(
            f"preference.reference=precomputed: {folder} lacks the reference log-probs of {len(missing)} shard(s), and "
            f"a run resumed at step {trainer.state.step} can no longer compute them (its weights are not the start): "
            "resume with the preference.reference this run started with, or start the run again"
        )
    if missing and trainer.dist.is_main:
        print(
            f"kiln: preference: computing the reference's log-probs of {len(missing)} shard(s) into {folder}",
            flush=True,
        )
    for url in missing:
        rows = logps([decode(s) for s in iter_samples([url])])
        if trainer.dist.is_main:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = shard_file(folder, url).with_suffix(f".{os.getpid()}.tmp.npz")
            np.savez(tmp, keys=np.array([k for k, _, _ in rows]), logps=np.array([[c, r] for _, c, r in rows]))
            tmp.rename(shard_file(folder, url))
        barrier()
    table = {}
    for url in urls:
        with np.load(shard_file(folder, url)) as f:
            table.update(zip(f["keys"].tolist(), map(tuple, f["logps"].tolist())))
    return table


def gather_rows(rows: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """Every rank's (key, chosen, rejected) rows, each pair once (tensor-parallel ranks compute the same pairs)."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return rows
    everyone: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(everyone, rows)
    return sorted({key: (key, c, r) for part in everyone for key, c, r in part}.values())


def lookup(table: dict[str, tuple[float, float]], keys: list[str], device) -> torch.Tensor:
    """The reference log-probs of `keys`' pairs in document order (chosen, rejected, chosen, ...)."""
    return torch.tensor([v for key in keys for v in table[key]], dtype=torch.float32, device=device)
