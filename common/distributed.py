"""Process-group setup and teardown (NCCL on CUDA, gloo on CPU) and small rank helpers."""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
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
    # Kiln's watchdog names a hung rank at timeout_s; the process group's own timeout (NCCL's
    # watchdog tears the process down without a word) comes WATCHDOG_MARGIN_S later.
    timeout = datetime.timedelta(seconds=timeout_s + (WATCHDOG_MARGIN_S if watchdog_enabled(backend) else 0))
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


# ---- naming the rank behind a collective timeout -------------------------------------------
# Every rank writes the step it starts into the process group's store; a rank whose collective
# times out says so in the store too. Ranks that never report a timeout while their peers did
# are the ones stuck outside the collective: those are the ones to name.


def _store():
    return dist.distributed_c10d._get_default_store()


_progress: tuple[int, float] | None = None  # (last started step, time.monotonic() then): the watchdog's view


def heartbeat(step: int) -> None:
    global _progress
    if dist.is_initialized() and dist.get_world_size() > 1:
        _store().set(f"kiln/step/{dist.get_rank()}", str(step))
        _progress = (step, time.monotonic())


def is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, dist.DistBackendError)) and ("timed out" in text or "timeout" in text)


def describe_timeout(timeout_s: int, grace_s: float = 5.0, by: str = "") -> str:
    """One line for a collective timeout on this rank, naming the ranks that look stuck."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    head = f"rank {rank}: a collective timed out after {timeout_s} s (parallel.timeout_s{by})"
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


# ---- Kiln's watchdog: the same line under NCCL ----------------------------------------------
# Under NCCL no timeout exception reaches the launcher: NCCL's watchdog thread aborts the process
# (TORCH_NCCL_ASYNC_ERROR_HANDLING). So each rank runs a thread of its own that fires when this
# rank's step (heartbeat) has not advanced for parallel.timeout_s while the rank waits on its
# peers, and says what describe_timeout says, before the process group's timeout (WATCHDOG_MARGIN_S
# later) is reached. A rank that is busy (host code, or GPU work that still progresses) is left
# alone however long it takes: a long evaluation or export is not a hang, and a rank that waits for
# it names it once timeout_s is over. On by default under NCCL; KILN_WATCHDOG=1 turns it on under
# gloo (the tests), KILN_WATCHDOG=0 off.

WATCHDOG_MARGIN_S = 30  # > poll (1 s) + device probe (2 s) + describe_timeout's grace (5 s), with room
_TORCH_DISTRIBUTED = os.path.join("torch", "distributed", "")


def watchdog_switch() -> str:
    """KILN_WATCHDOG: "1", "0" or "" (unset); anything else is a ConfigError."""
    switch = os.environ.get("KILN_WATCHDOG", "")
    if switch not in ("", "0", "1"):
        from common.errors import ConfigError

        raise ConfigError(f"KILN_WATCHDOG={switch!r}: use 1 (on) or 0 (off); unset: on under NCCL only")
    return switch


def watchdog_enabled(backend: str) -> bool:
    switch = watchdog_switch()
    return switch == "1" or (switch == "" and backend == "nccl")


def _waiting_on_peers(main: threading.Thread, device: torch.device, probe_s: float = 2.0) -> bool:
    """Whether this rank waits for its peers rather than works: its main thread is inside a
    torch.distributed call (gloo collectives, barriers and waits block there), or, on CUDA, work
    queued on the device does not finish within probe_s (a rank blocked on an NCCL collective
    waits in a synchronisation of its own code, behind the collective's kernel)."""
    frame = sys._current_frames().get(main.ident)
    if frame is not None and _TORCH_DISTRIBUTED in frame.f_code.co_filename:
        return True
    if device.type != "cuda":
        return False
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    deadline = time.monotonic() + probe_s
    while not done.query():
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)
    return False


class Watchdog:
    """A daemon thread per rank (scripts/kiln/launch.py starts it after init_distributed, stops it before
    teardown); it reads the step heartbeat() records."""

    def __init__(self, timeout_s: int, device: torch.device, poll_s: float = 1.0):
        self.timeout_s, self.device, self.poll_s = timeout_s, device, poll_s
        self.main = threading.current_thread()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        while not self._stop.wait(self.poll_s):
            progress = _progress
            if progress is None or time.monotonic() - progress[1] < self.timeout_s:
                continue
            if not _waiting_on_peers(self.main, self.device) or self._stop.is_set():
                continue
            print(f"kiln: error: {describe_timeout(self.timeout_s, by=', kiln watchdog')}", file=sys.stderr, flush=True)
            os._exit(1)  # as the launcher does: destroying a group with a peer stuck mid-collective can block


def start_watchdog(timeout_s: int, info: DistInfo) -> Watchdog | None:
    """The watchdog for this rank, or None (one process, or switched off)."""
    backend = "nccl" if info.device.type == "cuda" else "gloo"
    if info.world_size == 1 or not watchdog_enabled(backend):
        return None
    return Watchdog(timeout_s, info.device).start()
