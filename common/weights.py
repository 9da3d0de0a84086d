"""Safetensors weight files: headers read and checked against the file, and a fingerprint of the weights themselves.

`check_folder` is what every family (and the DiT server) runs on a folder of weights before anything is written: a
file cut short by a failed download or copy, or one that is no safetensors file, stops the run with one line naming
it, instead of safetensors' `SafetensorError: ... incomplete metadata` traceback once config.yaml exists.

`fingerprint` identifies a folder's weights (a LoRA run's base, common/lora.py) by hashing the headers and sampled
bytes of every tensor: a same-shaped model with other weights (a base and its -Instruct twin, a base fine-tuned in
place) gets another fingerprint, while a 1B model costs tens of milliseconds instead of hashing gigabytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from common.errors import ConfigError

HEADER_LIMIT = 100 * 2**20  # safetensors' own cap on the JSON header
# Bytes per element of safetensors' dtypes (sub-byte ones, e.g. F4, are checked by the file's extent only).
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}

# The fingerprint's sample of a tensor: the whole tensor up to SAMPLE_CHUNKS * SAMPLE_BYTES, else SAMPLE_CHUNKS runs of
# SAMPLE_BYTES spread evenly from its first byte to its last: 131k bf16 elements of each large tensor. A fine-tune that
# moves even 0.01% of a tensor's elements, spread over it, escapes with odds about (1 - 1e-4)^131072 = e^-13. An edit
# confined to a few rows between the samples (a handful of embedding rows) can escape; hashing the whole files would
# see it, at ~50x the cost (a 1.2B-parameter bf16 folder: 0.14 s sampled, 6.5 s whole, from the page cache).
SAMPLE_BYTES = 4096
SAMPLE_CHUNKS = 64
FINGERPRINT = "sampled-v1"  # the prefix of `fingerprint`'s value; a bare sha256 is `header_fingerprint`'s (older)


def read_header(path: str | Path, label: str) -> tuple[bytes, dict[str, dict], int]:
    """(the JSON header's bytes, name -> {dtype, shape, data_offsets} of every tensor, where the tensor data starts) of
    one safetensors file, after checking that the file holds what its header describes. ConfigError naming the file
    (prefixed by `label`, e.g. `model.init_from=...`) where it is cut short or is no safetensors file."""
    path = Path(path)
    size = path.stat().st_size
    what = f"{label}: {path}"
    with open(path, "rb") as f:
        if size < 8:
            raise ConfigError(
                f"{what} is cut short ({size} bytes: not even a safetensors header); copy or download it again"
            )
        n = int.from_bytes(f.read(8), "little")
        if n > HEADER_LIMIT:
            raise ConfigError(f"{what} is not a safetensors file (its first 8 bytes give a header of {n:,} bytes)")
        if 8 + n > size:
            raise ConfigError(
                f"{what} is cut short: its header alone is {n:,} bytes, the file holds {size:,}; copy or "
                "download it again"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        extents = [_extent(v) for v in tensors.values()]
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ConfigError(f"{what} is not a safetensors file (its header does not parse: {exc})") from None
    have, want = size - 8 - n, max((end for _, end in extents), default=0)
    if have < want:
        raise ConfigError(
            f"{what} is cut short: its header describes {want:,} bytes of tensor data, the file holds "
            f"{have:,}; copy or download it again"
        )
    if have > want:
        raise ConfigError(f"{what} is damaged: it holds {have:,} bytes of tensor data, its header describes {want:,}")
    for name, entry in tensors.items():
        begin, end = entry["data_offsets"]
        itemsize = DTYPE_BYTES.get(entry["dtype"])
        if itemsize is not None and end - begin != math.prod(entry["shape"]) * itemsize:
            raise ConfigError(
                f"{what} is damaged: its header gives {name} {end - begin:,} bytes for a "
                f"{entry['dtype']} tensor of shape {list(entry['shape'])}"
            )
    return raw, tensors, 8 + n


def _extent(entry: dict) -> tuple[int, int]:
    begin, end = (int(x) for x in entry["data_offsets"])
    if not 0 <= begin <= end or not isinstance(entry["dtype"], str) or any(int(d) < 0 for d in entry["shape"]):
        raise ValueError(f"bad entry {entry}")
    return begin, end


def check_folder(folder: str | Path, label: str) -> dict[Path, dict[str, dict]]:
    """Every `*.safetensors` file at the top of `folder` checked (`read_header`): file -> its tensors' entries.
    Reads the headers only (kilobytes), so every rank may run it while the config is validated."""
    return {path: read_header(path, label)[1] for path in sorted(Path(folder).glob("*.safetensors"))}


def _sample_ranges(nbytes: int) -> list[tuple[int, int]]:
    """(offset, length) runs of a tensor's `nbytes` that the fingerprint hashes."""
    if nbytes <= SAMPLE_BYTES * SAMPLE_CHUNKS:
        return [(0, nbytes)]
    step = (nbytes - SAMPLE_BYTES) / (SAMPLE_CHUNKS - 1)
    return [(round(i * step), SAMPLE_BYTES) for i in range(SAMPLE_CHUNKS)]


def fingerprint(folder: str | Path, label: str = "the base") -> str:
    """`sampled-v1:<sha256>` over the folder's safetensors files (its subfolders' too): each file's name, header
    (tensor names, dtypes, shapes) and sampled bytes of every tensor (`_sample_ranges`): small tensors whole, large
    ones in SAMPLE_CHUNKS runs spread over them. Two folders with the same tensors get the same value wherever they
    are; any real fine-tune of a tensor changes it."""
    folder = Path(folder)
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*.safetensors")):
        raw, tensors, start = read_header(path, label)
        h.update(f"{path.relative_to(folder)}:".encode())
        h.update(raw)
        fd = os.open(path, os.O_RDONLY)
        try:
            for begin, end in sorted(_extent(t) for t in tensors.values()):
                for offset, length in _sample_ranges(end - begin):
                    h.update(os.pread(fd, length, start + begin + offset))
        finally:
            os.close(fd)
    return f"{FINGERPRINT}:{h.hexdigest()}"


def header_fingerprint(folder: str | Path) -> str:
    """The fingerprint checkpoints recorded before `fingerprint` (a bare sha256 of each file's name, size and header:
    no weights): kept to read their meta.json."""
    h = hashlib.sha256()
    for path in sorted(Path(folder).rglob("*.safetensors")):
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            h.update(f"{path.relative_to(folder)}:{path.stat().st_size}:".encode())
            h.update(f.read(n))
    return h.hexdigest()
