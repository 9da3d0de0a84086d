"""What a forward keeps alive for backward, measured: the bytes benchmarks and memory-model tests compare."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def kept_for_backward(run: Callable[[], Any], exclude: Iterable[torch.Tensor]) -> tuple[int, Any]:
    """Bytes of the storages created while `run()` executes that are still alive when it returns,
    leaving out `exclude` (weights, the batch; iterated after `run()`) and the output itself; and the output.

    The output holds the autograd graph, so what is alive is what backward will read: the tensors
    autograd saves, and also those a selective activation-checkpointing policy caches (which
    `torch.autograd.graph.saved_tensors_hooks` does not see: checkpointing installs its own hooks).
    Keep the output until done with the number: it keeps the graph, hence the storages, alive.
    """
    from torch.utils._pytree import tree_leaves

    with CreatedStorages() as created:
        out = run()
    skip = {t.untyped_storage().data_ptr() for t in plain_tensors([*exclude, *tree_leaves(out)])}
    return created.alive(skip), out


def peak_and_kept(
    run: Callable[[], Any], exclude: Iterable[torch.Tensor], settle: Callable[[], Any] | None = None
) -> tuple[int, int, Any]:
    """(the most bytes of the storages created while `run()` executes that were alive at once, the bytes of those
    still alive when it returns, its output), leaving out `exclude` (the inputs: a view of one is an op's output
    too). Their difference is what `run()` held only for a while: the transient buffers of an exchange, say. Sampled
    after every op, which is when a storage is created: the peak is exact for what the ops allocate (a kernel's own
    workspace, allocated inside one op, is not seen). `settle` runs between the end of `run()` and the count of what
    is kept: a collective's buffers are let go by its backend's thread, which on a loaded machine can lag the op's
    return (a barrier waits for every rank's)."""
    skip = {t.untyped_storage().data_ptr() for t in plain_tensors(exclude)}
    with CreatedStorages(track_peak=True, skip=skip) as created:
        out = run()
    if settle is not None:
        settle()
    return created.peak, created.alive(skip), out


def settle_collectives() -> None:
    """A `settle` for `peak_and_kept` under torch.distributed: wait for every rank's collectives (a barrier), then
    collect what they let go."""
    import gc

    import torch.distributed as dist

    dist.barrier()
    gc.collect()


class CreatedStorages:
    """The storages every op creates in this context (on any device but meta), held by weak reference."""

    def __init__(self, track_peak: bool = False, skip: set[int] = frozenset()):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.created: dict[int, tuple[Any, int]] = {}  # data_ptr -> (StorageWeakRef, bytes)
        self.peak = 0
        outer = self

        class Track(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                from torch.multiprocessing.reductions import StorageWeakRef
                from torch.utils._pytree import tree_leaves

                out = func(*args, **(kwargs or {}))
                for t in plain_tensors(tree_leaves(out)):
                    if t.device.type != "meta":
                        storage = t.untyped_storage()
                        outer.created[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
                if track_peak:
                    outer.peak = max(outer.peak, outer.alive(skip))
                return out

        self._mode = Track()

    def __enter__(self) -> "CreatedStorages":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def alive(self, skip: set[int] = frozenset()) -> int:
        """Bytes of the created storages still alive, but those whose data_ptr is in `skip`."""
        return sum(n for ptr, (ref, n) in self.created.items() if ptr not in skip and not ref.expired())


def plain_tensors(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    """The tensors among `values` that own storage: a wrapper subclass (a DTensor parameter, the AsyncCollectiveTensor
    a functional collective returns) has none of its own, so its inner tensors stand for it."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    for t in values:
        if is_traceable_wrapper_subclass(t):
            yield from plain_tensors(getattr(t, name) for name in t.__tensor_flatten__()[0])
        elif isinstance(t, torch.Tensor):
            yield t
