"""What a rank takes of the global stream (:class:`RankShare`) and how a window of global batches is laid out
(:class:`PackPlan`); the package docstring says how."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class RankShare:
    """Which samples of each global batch (``micro x accum x dp`` usable samples, in stream order) a
    data-parallel rank decodes: position ``j`` is rank ``j % dp``'s, in micro-batch ``j // (micro x dp)``."""

    rank: int
    dp: int
    micro: int
    accum: int

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.dp

    def owns(self, position: int) -> bool:
        return position % self.dp == self.rank

    def micro_batch(self, position: int) -> int:
        return position // (self.micro * self.dp)


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Global batches laid out by the samples' sizes (the module docstring; `common.data.packing.plan_window`)."""

    measure: Callable[[dict], tuple[int, int]]  # raw sample -> (language-model tokens, tower patches); picklable
    steps: int  # global batches planned together (data.pack_buffer)
    max_seq_len: int  # the language rows' length
    packing: bool = True  # the collate packs rows (data.packing) rather than padding one sample per row
