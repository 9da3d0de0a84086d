"""A built dataset as training reads it: its meta.json, shard urls and side folders, and running its builder.

A dataset directory holds ``{split}-NNNNNN.tar`` shards for each split in :data:`SPLITS` and a
``meta.json`` that records every shard's name and byte size (and, for a side folder such as a
tokenizer, ``meta[asset]`` = its folder name and ``meta[asset + "_files"]`` = its files' sizes).
Builders (the CLIs under ``data/``, named by the config's ``data.build``) write meta.json last
and rename the directory into place, so a directory whose meta.json validates here is
complete. This module is light (no torch): the builders import it for the same checks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from common.errors import DataError

SPLITS = ("train", "val")
META_NAME = "meta.json"
# `python -m <builder>` runs here, so the `data` package is importable whatever the caller's cwd.
REPO_ROOT = Path(__file__).resolve().parents[2]


def sizes_match(folder: Path, sizes: Iterable[tuple[str, int]]) -> bool:
    """Whether each named file in ``folder`` has its recorded byte size (OSError if one is missing)."""
    return all((folder / name).stat().st_size == size for name, size in sizes)


def asset_complete(asset: str) -> Callable[[Path, dict], bool]:
    """A ``read_meta`` completeness check: the side folder ``meta[asset]`` holds every file
    recorded in ``meta[asset + "_files"]`` at its recorded size."""

    def complete(root: Path, meta: dict) -> bool:
        files = meta[f"{asset}_files"]
        return bool(files) and sizes_match(root / meta[asset], files.items())

    return complete


def read_meta(root: str | Path, also_complete: Callable[[Path, dict], bool] | None = None) -> dict[str, Any] | None:
    """Parsed meta.json in ``root`` if every shard it lists is there with its recorded size, else None.

    ``also_complete(root, meta)``, if given, checks whatever else the dataset holds; a malformed
    meta.json (KeyError, TypeError, AttributeError, ...) there also reads as incomplete.
    """
    root = Path(root)
    try:
        meta = json.loads((root / META_NAME).read_text())
        for split in SPLITS:
            info = meta["splits"][split]
            if not sizes_match(root, zip(info["shards"], info["shard_bytes"], strict=True)):
                return None
        if also_complete is not None and not also_complete(root, meta):
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return meta


def with_urls(root: Path, meta: dict, asset: str | None = None) -> dict:
    """A copy of ``meta`` with ``{split}_urls``: the absolute paths of each split's shards, and
    ``{asset}_dir`` for a dataset that ships a side folder (its tokenizer or processor)."""
    meta = dict(meta)
    for split in SPLITS:
        meta[f"{split}_urls"] = [str((root / name).resolve()) for name in meta["splits"][split]["shards"]]
    if asset is not None:
        meta[f"{asset}_dir"] = str((root / meta[asset]).resolve())
    return meta


def complete_meta(root: str | Path, asset: str | None = None) -> dict[str, Any] | None:
    """``read_meta`` of a dataset whose shards and side folder ``asset`` (if given) are all there."""
    return read_meta(root, asset_complete(asset) if asset else None)


def load_dataset_meta(root: str | Path, asset: str | None = None) -> dict:
    """meta.json of the complete dataset in ``root`` with its shard urls (and ``{asset}_dir``);
    DataError naming ``root`` when there is none."""
    root = Path(root).absolute()
    meta = complete_meta(root, asset)
    if meta is None:
        what = (
            "no dataset"
            if not (root / META_NAME).exists()
            else "an incomplete dataset (a shard or file is missing or has the wrong size)"
        )
        raise DataError(f"data.root={root}: {what} there")
    return with_urls(root, meta, asset)


def load_asset(root: str | Path, asset: str, auto_class: Any, expected: type) -> Any:
    """A tokenizer or processor a builder saved in the side folder ``asset``, loaded offline.

    ``root`` is the dataset directory or the side folder itself; ``auto_class`` is e.g.
    transformers' AutoTokenizer (passed in: this module does not import transformers) and the
    result must be an ``expected`` (TypeError otherwise).
    """
    root = Path(root)
    path = root / asset if (root / asset).is_dir() else root
    loaded = auto_class.from_pretrained(str(path), local_files_only=True)
    if not isinstance(loaded, expected):
        raise TypeError(f"{path} holds a {type(loaded).__name__}, expected a {expected.__name__}")
    return loaded


def tokenizer_sha256(tokenizer: Any) -> str:
    """Identity of a fast tokenizer: how it turns text into ids (vocabulary, merges, special tokens,
    normalizer, pre-tokenizer, post-processor), independent of the folder and of the files' formatting.

    Equal for a checkpoint's tokenizer and the copy a data builder saved of it, so a run can check that
    its data was tokenized by the checkpoint's tokenizer. Padding/truncation settings are call-time
    state, not identity, and are left out; so is the chat template (meta.json records it apart).
    """
    import hashlib

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    for key in ("padding", "truncation"):
        state.pop(key, None)
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def run_builder(build: Sequence[str], root: str | Path) -> str:
    """Run a dataset's builder, ``python -m <build...> --out <root>``, from the repo root; its stdout.

    The builders are idempotent: a complete dataset built with the same settings is left as it
    is (a fraction of a second), one built with other settings is refused. A builder that exits
    non-zero becomes a DataError carrying its last stderr line (its own one-line reason).
    """
    argv = [sys.executable, "-m", *build, "--out", str(root)]
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        reason = lines[-1] if lines else "no message"
        raise DataError(
            f"data.build ({' '.join(build)}) failed for data.root={root} (exit code {proc.returncode}): {reason}"
        )
    return proc.stdout
