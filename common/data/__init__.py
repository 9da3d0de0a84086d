"""Data plumbing shared by the recipes: preparing a run's dataset, WebDataset loading, packing.

Training never imports the dataset builders (``data/``): a dataset's config names its builder
(``data.build``, run as a subprocess) and training reads what it built through
``common.data.dataset``. Light on purpose: the builders import ``common.data.dataset``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.config import DataConfig
    from common.distributed import DistInfo


def prepare_dataset(data: DataConfig, dist: DistInfo, *, asset: str | None = None) -> dict:
    """The dataset at ``data.root`` on every rank: its meta.json plus absolute ``train_urls`` /
    ``val_urls`` (and ``{asset}_dir`` for a dataset with a side folder, e.g. a tokenizer).

    Rank 0 runs the dataset's builder (``data.build``) on every start, not only when the dataset
    is missing: a builder takes 0.1-0.4 s to find a complete dataset with the same settings and
    is the only one that can tell a dataset built with other settings or by an older version of
    itself (it then fails, and so does the run, with its reason). After a barrier, the first rank
    of any other node that sees no dataset (``data.root`` on a node-local disk) builds its own.
    With ``data.build`` empty a missing dataset is a DataError naming ``data.root`` (and the command
    that builds it, ``data.build_hint``).
    """
    from common.data.dataset import META_NAME, complete_meta, load_dataset_meta, run_builder
    from common.distributed import barrier, broadcast_object
    from common.errors import DataError

    root = Path(data.root).absolute()

    def build() -> None:
        fresh = not (root / META_NAME).exists()
        if fresh:
            print(f"kiln: building the dataset at data.root={root} (data.build: {' '.join(data.build)})", flush=True)
        out = run_builder(data.build, root)
        if fresh and out.strip():
            print(out.strip().splitlines()[-1], flush=True)

    failure = None
    if data.build and dist.is_main:
        try:
            build()
        except DataError as exc:
            failure = str(exc)
    # Rank 0's outcome goes to every rank, so all stop with its reason instead of waiting in a barrier.
    failure = broadcast_object(failure)
    if failure is not None:
        raise DataError(failure)
    if data.build and not dist.is_main and dist.local_rank == 0 and complete_meta(root, asset) is None:
        build()
    barrier()
    try:
        return load_dataset_meta(root, asset)
    except DataError as exc:
        if data.build:
            raise
        hint = f"; build it with: {data.build_hint.replace('{root}', str(root))}" if data.build_hint else ""
        raise DataError(f"{exc} (data.build is empty, so nothing builds it{hint})") from None
