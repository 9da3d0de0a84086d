"""Turn a folder of captioned images into text-to-image WebDataset shards (train / held-out val).

    python -m data.prepare_captions --input ~/data/captioned --out data/captioned --image-size 512
                                    [--train-shards 8] [--val-shards 2] [--val-fraction 0.05] [--seed 0] [--force]
    python -m data.prepare_captions --digits --out data/cache/captioned_digits --image-size 16   # the t2i_tiny demo

A caption per image, in either of the layouts diffusers' ImageFolder and its training scripts read:
``name.txt`` beside ``name.png`` (any image extension), or one ``metadata.jsonl`` in --input with a
``{"file_name": "name.png", "text": "a caption"}`` line per image (then .txt files are ignored). Images are
found recursively; each is converted to RGB, resized and center-cropped to a square exactly as
prepare_images does (``center_crop``), and stored as ``{__key__, png: RGB PNG, txt: the caption}``.

An image that does not decode, an image without a caption and an image whose caption is empty (whitespace only)
are skipped and counted (meta.json ``skipped``: file names by reason, and the summary line). A caption file that
is not UTF-8 text, a metadata.jsonl line that is not a {"file_name", "text"} object, or no captioned image at all
stop with one line (exit 2). ``--digits`` captions scikit-learn's digits in several phrasings ("a handwritten
seven", "the digit 7", ...: common/tools/fixtures.py) and converts them the same way. Like the other builders,
DIR appears at once with meta.json written last.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from common.data import dataset as common_dataset
from data import shards
from data.prepare_images import IMAGE_EXTENSIONS, encode_image

SOURCE = "captioned_images"  # recipes.t2i.data.CAPTIONED: what the text-to-image recipe reads
METADATA = "metadata.jsonl"
SKIP_REASONS = ("undecodable", "no_caption", "empty_caption")


def list_captioned(root: Path) -> tuple[list[Path], list[str | None]]:
    """(image files, their captions or None where an image has none), sorted by path; ValueError for a caption
    that is not text, a bad metadata.jsonl line, or no image at all."""
    if not root.is_dir():
        raise ValueError(f"--input {root}: no such folder")
    images = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
    if not images:
        raise ValueError(f"--input {root} holds no image files ({' '.join(IMAGE_EXTENSIONS)})")
    metadata = root / METADATA
    if metadata.exists():
        captions: dict[Path, str] = {}
        for n, line in enumerate(read_text(metadata).splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                captions[(root / row["file_name"]).resolve()] = row["text"]
                if not isinstance(row["text"], str):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f"{metadata}:{n}: not a JSON object with a file_name and a text string (diffusers' ImageFolder "
                    'metadata: {"file_name": "name.png", "text": "a caption"})'
                ) from None
        return images, [captions.get(p.resolve()) for p in images]
    return images, [read_text(p.with_suffix(".txt")) if p.with_suffix(".txt").exists() else None for p in images]


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: a caption file that is not UTF-8 text") from None


def split_rows(n: int, *, val_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """{split: rows}: the rows shuffled with the seed, the first round(n * val_fraction) to val (at least one,
    never all), in file order within each split."""
    order = list(range(n))
    random.Random(f"kiln.prepare_captions/{seed}").shuffle(order)
    n_val = min(max(round(n * val_fraction), 1), n - 1)
    return {
        "val": np.asarray(sorted(order[:n_val]), dtype=np.int64),
        "train": np.asarray(sorted(order[n_val:]), dtype=np.int64),
    }


def _settings(meta: dict) -> dict:
    return {"input": meta.get("input"), "image_size": meta.get("image_size"), **shards.split_settings(meta)}


def build_caption_shards(
    out: str | Path,
    *,
    input: str | Path,
    image_size: int,
    train_shards: int = 8,
    val_shards: int = 2,
    val_fraction: float = 0.05,
    seed: int = 0,
    force: bool = False,
) -> tuple[dict, bool]:
    """Build the dataset in ``out`` unless a complete one is there. Returns (meta, built_now)."""
    out, root = Path(out).absolute(), Path(input).expanduser().absolute()
    images, captions = list_captioned(root)
    skipped: dict[str, list[str]] = {reason: [] for reason in SKIP_REASONS}
    usable = []
    for path, caption in zip(images, captions):
        name = str(path.relative_to(root))
        if caption is None:
            skipped["no_caption"].append(name)
        elif not caption.strip():
            skipped["empty_caption"].append(name)
        else:
            usable.append((path, caption.strip()))
    if len(usable) < 2:
        raise ValueError(
            f"--input {root}: {len(usable)} captioned image(s); a caption per image is name.txt beside name.png, "
            f"or a {METADATA} of file_name/text lines"
        )
    paths = np.array([p for p, _ in usable], dtype=object)
    texts = np.array([c for _, c in usable], dtype=object)

    def write_shards(tmp: Path, split: str, rows: np.ndarray, paths: np.ndarray, texts: np.ndarray, num_shards: int):
        import webdataset as wds

        written = []
        for shard_id, chunk in enumerate(np.array_split(rows, num_shards)):
            name, count = f"{split}-{shard_id:06d}.tar", 0
            with wds.TarWriter(str(tmp / name), mtime=0) as sink:
                for row in chunk:
                    try:
                        png = encode_image(paths[row], image_size)
                    except Exception:  # PIL raises many kinds (UnidentifiedImageError, OSError, ValueError, ...)
                        skipped["undecodable"].append(str(paths[row].relative_to(root)))
                        continue
                    sink.write({"__key__": f"{split}_{row:07d}", "png": png, "txt": texts[row]})
                    count += 1
            written.append({"name": name, "samples": count, "bytes": (tmp / name).stat().st_size})
        if split == "train" and not sum(w["samples"] for w in written):
            raise ValueError(f"--input {root}: no decodable training image")
        return written

    def start_meta(tmp: Path) -> dict[str, Any]:
        return {
            "source": SOURCE,
            "input": str(root),
            "image_files": len(images),
            "image_size": image_size,
            "channels": 3,
            "splits": {},
            "seed": seed,
            "val_fraction": val_fraction,
            "skipped": skipped,  # filled while the shards are written
        }

    return shards.build_atomically(
        out,
        train_shards=train_shards,
        val_shards=val_shards,
        val_fraction=val_fraction,
        force=force,
        dataset="captioned image",
        read_meta=common_dataset.read_meta,
        load=lambda: (paths, texts, split_rows(len(usable), val_fraction=val_fraction, seed=seed)),
        start_meta=start_meta,
        write_shards=write_shards,
        fewer_shards_ok=True,
    )


def skip_summary(meta: dict) -> str:
    """ "skipped 3 file(s): 1 undecodable (broken.png), 1 without a caption (...), ..." from meta.json."""
    words = {"undecodable": "undecodable", "no_caption": "without a caption", "empty_caption": "with an empty caption"}
    parts = [
        f"{len(files)} {words[reason]} ({', '.join(files[:3])}{' ...' if len(files) > 3 else ''})"
        for reason, files in meta["skipped"].items()
        if files
    ]
    return f"skipped {sum(map(len, meta['skipped'].values()))} file(s)" + (f": {'; '.join(parts)}" if parts else "")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    def extra(parser: argparse.ArgumentParser, positive_int) -> None:
        source = parser.add_mutually_exclusive_group(required=True)
        source.add_argument("--input", type=Path, help="a folder of images with name.txt captions or metadata.jsonl")
        source.add_argument("--digits", action="store_true", help="scikit-learn's digits, captioned (the demo)")
        parser.add_argument("--image-size", required=True, type=positive_int, help="side of the square images written")

    parser = shards.arg_parser(
        "python -m data.prepare_captions",
        __doc__.splitlines()[0],
        "output directory (created; must be empty or a previous build)",
        extra=extra,
    )
    parser.set_defaults(val_fraction=0.05)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    out = args.out.absolute()
    wanted = {
        "train_shards": args.train_shards,
        "val_shards": args.val_shards,
        "val_fraction": args.val_fraction,
        "seed": args.seed,
    }
    with tempfile.TemporaryDirectory(prefix="kiln-captions-") as scratch:
        if args.digits:
            if common_dataset.read_meta(out) is not None and not args.force:
                print(f"{out}/{common_dataset.META_NAME} exists; nothing to do (pass --force to rebuild)")
                return 0
            from common.tools.fixtures import make_caption_folder

            root = make_caption_folder(Path(scratch) / "digits", per_digit=180, size=8, bad=False)
        else:
            root = args.input.expanduser().absolute()
        build = lambda out, **kw: build_caption_shards(out, input=root, image_size=args.image_size, **kw)  # noqa: E731
        also = {"input": str(root), "image_size": args.image_size}
        meta, rc = shards.cli_build(
            build, out, wanted, force=args.force, settings=_settings, holds="caption shards", show_wanted=True,
            also_wanted=also,
        )  # fmt: skip
    if meta is None:
        return rc
    print(f"{shards.summary(out, meta)}; {args.image_size}x{args.image_size} RGB with captions; {skip_summary(meta)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
