"""Process-group setup and teardown (NCCL on CUDA, gloo on CPU) and small rank helpers."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port free on this host right now (for a process group of one, a test's torchrun, a server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: int = 600) -> DistInfo:
    """Join the job's process group; a plain `python` run becomes a group of one.

    DeepSpeed and DTensor want a process group even for one rank, so a single process
    gets a private gloo/NCCL group on a free loopback port.
    """
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    # Sub-groups (DeepSpeed's, DeviceMesh's) come from new_group() without a timeout, which takes
    # these module defaults (30 min for gloo), not the default group's: make them parallel.timeout_s.
    dist.distributed_c10d.default_pg_timeout = timeout
    dist.distributed_c10d.default_pg_nccl_timeout = timeout
    if not dist.is_initialized():
        # torchrun keeps one store across restarts (--max-restarts): without a per-attempt prefix,
        # restarted ranks read the dead ranks' gloo addresses and fail to connect.
        store, _, _ = next(rendezvous("env://", rank, world, timeout=timeout))
        store = dist.PrefixStore(f"kiln/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=device)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s value of `obj` on every rank (no-op for one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_mean(value: float, device: torch.device) -> float:
    """Mean of a Python float over all ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return float(value)
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item() / dist.get_world_size())


# ---- naming the rank behind a collective timeout -------------------------------------------
# Every rank writes the step it starts into the process group's store; a rank whose collective
# times out says so in the store too. Ranks that never report a timeout while their peers did
# are the ones stuck outside the collective: those are the ones to name.


def _store():
    return dist.distributed_c10d._get_default_store()


def heartbeat(step: int) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        _store().set(f"kiln/step/{dist.get_rank()}", str(step))


def is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, dist.DistBackendError)) and ("timed out" in text or "timeout" in text)


def describe_timeout(timeout_s: int, grace_s: float = 5.0) -> str:
    """One line for a collective timeout on this rank, naming the ranks that look stuck."""
    import time

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    head = f"rank {rank}: a collective timed out after {timeout_s} s (parallel.timeout_s)"
    try:
        store = _store()
        store.set_timeout(datetime.timedelta(seconds=grace_s))
        store.set(f"kiln/timeout/{rank}", "1")
        time.sleep(grace_s)  # peers waiting in the same collective time out together
        timed_out = {r for r in range(world) if store.check([f"kiln/timeout/{r}"])}
        steps = {r: store.get(f"kiln/step/{r}").decode() for r in range(world) if store.check([f"kiln/step/{r}"])}
    except Exception:  # the store is served from rank 0's host, which may be gone
        return f"{head}; another rank died or hangs"
    stuck = [f"rank {r} (last started step {steps.get(r, '?')})" for r in range(world) if r not in timed_out]
    where = f" at step {steps[rank]}" if rank in steps else ""
    return f"{head}{where}; not in the collective: {', '.join(stuck) or 'unknown'}"
