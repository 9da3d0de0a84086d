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
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    created: dict[int, tuple[StorageWeakRef, int]] = {}

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in plain_tensors(tree_leaves(out)):
                if t.device.type != "meta":
                    storage = t.untyped_storage()
                    created[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
            return out

    with Track():
        out = run()
    skip = {t.untyped_storage().data_ptr() for t in plain_tensors([*exclude, *tree_leaves(out)])}
    return sum(n for ptr, (ref, n) in created.items() if ptr not in skip and not ref.expired()), out


def plain_tensors(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    """The tensors among `values` that own storage: a wrapper subclass (a DTensor parameter, the AsyncCollectiveTensor
    a functional collective returns) has none of its own, so its inner tensors stand for it."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    for t in values:
        if is_traceable_wrapper_subclass(t):
            yield from plain_tensors(getattr(t, name) for name in t.__tensor_flatten__()[0])
        elif isinstance(t, torch.Tensor):
            yield t
