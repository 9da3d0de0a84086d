"""Setting up a loader worker process: signals, dying with the trainer, small tensors sent inline."""

from __future__ import annotations

import ctypes
import os
import signal

import torch


def _init_worker(worker_id: int, trainer: int | None = None) -> None:
    """SLURM signals every process of a job: workers leave SIGTERM/SIGUSR1 to the trainer, which
    checkpoints and exits (common/trainer.py); the workers go when their parent does."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if trainer is not None:
        _die_with_the_trainer(trainer)
    _send_small_tensors_inline()


def _die_with_the_trainer(trainer: int) -> None:
    """A worker whose trainer was killed (SIGKILL, the OOM killer) must not outlive it: its queue's feeder thread
    can block for ever on a full pipe that the worker itself keeps open, and the worker then holds the job's
    stdout. Linux sends it SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG); elsewhere DataLoader's own
    watchdog remains."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != trainer:  # the trainer died before the call
        os._exit(0)


# A loader worker hands each tensor to the trainer through shared memory by default: a segment and a file
# descriptor passed over a socket per tensor, about 0.5 ms each on 2 cores. A packed VLM micro-batch is five
# small tensors (ids, labels, positions, boundaries, images), and those handovers were most of its data wait.
# A worker's tensors up to INLINE_BYTES travel inside the pickled message instead: one copy through the pipe.
INLINE_BYTES = 1 << 20


def _send_small_tensors_inline() -> None:
    """In a loader worker: pickle small CPU tensors by value (the queue's ForkingPickler, this process only)."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing.reductions import reduce_tensor

    def reduce(t: torch.Tensor):
        if t.device.type == "cpu" and not t.requires_grad and t.numel() * t.element_size() <= INLINE_BYTES:
            return _tensor_from_bytes, (
                t.detach().contiguous().view(-1).view(torch.uint8).numpy(),
                t.dtype,
                tuple(t.shape),
            )
        return reduce_tensor(t)

    ForkingPickler.register(torch.Tensor, reduce)


def _tensor_from_bytes(data, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(data).view(dtype).view(shape)
