"""Fault injection for the fault-tolerance tests: NaN losses, crashes, hangs, a slow or killed checkpoint write.

Faults come from the environment so that no user config carries them:

    KILN_FAULTS="nan_loss@5,nan_loss@6,crash@7:1,hang@4:1,slow_checkpoint@8,kill_in_checkpoint@10,stale_sync@2"

`kind@STEP[:RANK]`: STEP is the optimizer step being computed (1-based, as logged); RANK
defaults to every rank. `crash` fires only in the first attempt of a torchrun job
(TORCHELASTIC_RESTART_COUNT=0), so a restarted worker gets past it. `stale_sync`: GRPO's push into the rollout
engine leaves out the largest tensor of a transformer layer (the engine keeps its old copy), which the probe check
must catch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

KINDS = ("nan_loss", "crash", "hang", "slow_checkpoint", "kill_in_checkpoint", "stale_sync")
SLOW_CHECKPOINT_S = 5.0  # how much longer a `slow_checkpoint` write takes (a synchronous save)
HELD_CHECKPOINT_S = 120.0  # the longest an async save's `slow_checkpoint` write is held for the training loop
_waited_for = threading.Event()  # the training loop waits for the async save in flight


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None


def parse(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, where = item.partition("@")
        step, _, rank = where.partition(":")
        if kind not in KINDS or not step.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"KILN_FAULTS: bad item {item!r} (expected kind@STEP[:RANK], kind in {KINDS})")
        faults.append(Fault(kind, int(step), int(rank) if rank else None))
    return faults


_FAULTS = parse(os.environ.get("KILN_FAULTS", ""))


def _active(kind: str, step: int) -> bool:
    rank = int(os.environ.get("RANK", "0"))
    return any(f.kind == kind and f.step == step and f.rank in (None, rank) for f in _FAULTS)


def before_step(step: int) -> None:
    """Crash or hang this rank at the start of `step` if asked to."""
    if _active("crash", step) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        print(f"kiln: fault injection: rank {os.environ.get('RANK', '0')} crashes at step {step}", flush=True)
        os._exit(13)
    if _active("hang", step):
        print(f"kiln: fault injection: rank {os.environ.get('RANK', '0')} hangs at step {step}", flush=True)
        while True:
            time.sleep(3600)


class _PoisonLosses(TorchFunctionMode):
    """Multiplies the result of every loss function by NaN: a NaN loss whose backward gives NaN
    gradients, whichever recipe, model library or pipeline stage computes the loss."""

    LOSSES = (F.cross_entropy, F.mse_loss)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * float("nan") if func in self.LOSSES else out


def pushed_weights(step: int, state: dict) -> dict:
    """The weights a sync pushes into the rollout engine at `step`: on an injected `stale_sync` step all but the
    largest tensor of a transformer layer (the engine keeps its old copy of it; a layer's weights act on every token,
    whereas an embedding row the probe's tokens do not read would go unseen)."""
    if not _active("stale_sync", step):
        return state
    largest = max((k for k in state if ".layers." in k), key=lambda k: state[k].numel())
    print(f"kiln: fault injection: the sync at step {step} leaves out {largest}", flush=True)
    return {k: v for k, v in state.items() if k != largest}


def poisoned_losses(step: int):
    """Around a train step (common/trainer.py): on an injected `nan_loss` step every loss is NaN."""
    return _PoisonLosses() if _active("nan_loss", step) else contextlib.nullcontext()


def during_checkpoint(step: int, in_background: bool = False) -> None:
    """After a checkpoint's files are written but before it is committed (`in_background`: in the thread of an async
    save): `slow_checkpoint` makes a synchronous write take SLOW_CHECKPOINT_S longer, and holds an async one until the
    training loop waits for it (checkpoint_waited_for; at most HELD_CHECKPOINT_S), so that a later save meets it still
    writing however fast the machine trains; `kill_in_checkpoint` SIGKILLs this process."""
    if _active("slow_checkpoint", step):
        if in_background:
            _waited_for.wait(HELD_CHECKPOINT_S)
            _waited_for.clear()
        else:
            time.sleep(SLOW_CHECKPOINT_S)
    if _active("kill_in_checkpoint", step):
        os.kill(os.getpid(), signal.SIGKILL)


def checkpoint_waited_for() -> None:
    """The training loop waits for the async save in flight (common/checkpoint.py): a held write goes on."""
    _waited_for.set()
