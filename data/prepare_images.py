"""Turn an ImageFolder (one subfolder of images per class) into class-labelled WebDataset image shards \
(train / held-out val).

    python -m data.prepare_images --input ~/data/my_images --out data/my_images --image-size 256
                                  [--train-shards 8] [--val-shards 2] [--val-fraction 0.15] [--seed 0] [--force]

Classes are the subfolders of --input in sorted order (torchvision's ImageFolder convention):
class i is the i-th name in ``DIR/classes.json`` (also meta.json's ``classes``). Each image is
converted to RGB, resized so its shorter side is --image-size and center-cropped to a square, as
the DiT and ADM reference code does (``center_crop_arr``: halve with a box filter while the image
is at least twice the target, then bicubic), and stored as ``{__key__, png: RGB PNG, cls: b"3"}``.
Every class is split train/val with the same seeded fraction (at least one training image each).

Files that are not images (by extension) are ignored; image files that do not decode are skipped
and counted (meta.json ``skipped_undecodable``, and the summary line). No class folders, a class
folder without images, or a class with no decodable training image stop with one line (exit 2).
Like the other builders, DIR appears at once with meta.json written last.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

from common.data import dataset as common_dataset
from data import cli, shards

SOURCE = "image_folder"  # recipes.dit.data.IMAGE_FOLDER: what the DiT checks the image size of
CLASSES_NAME = "classes.json"
# torchvision.datasets.folder.IMG_EXTENSIONS
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def list_image_folder(root: Path) -> tuple[list[str], list[list[Path]]]:
    """(class names, image files per class) of an ImageFolder; ValueError if there is nothing to train on."""
    if not root.is_dir():
        raise ValueError(f"--input {root}: no such folder")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise ValueError(f"--input {root} has no class subfolders (expected {root}/<class name>/<image files>)")
    files = [
        sorted(p for p in (root / name).rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
        for name in classes
    ]
    empty = [name for name, found in zip(classes, files) if not found]
    if empty:
        raise ValueError(
            f"--input {root}: class folder(s) without images: {', '.join(empty)} "
            f"(image files: {' '.join(IMAGE_EXTENSIONS)})"
        )
    return classes, files


def center_crop(image, size: int):
    """The ADM / DiT preprocessing (guided-diffusion's center_crop_arr): box-halve while the shorter
    side is >= 2x `size`, bicubic-resize the shorter side to `size`, crop the center square."""
    from PIL import Image

    while min(image.size) >= 2 * size:
        image = image.resize(tuple(x // 2 for x in image.size), resample=Image.BOX)
    scale = size / min(image.size)
    image = image.resize(tuple(round(x * scale) for x in image.size), resample=Image.BICUBIC)
    left, top = (image.size[0] - size) // 2, (image.size[1] - size) // 2
    return image.crop((left, top, left + size, top + size))


def encode_image(path: Path, size: int) -> bytes:
    """The file as a `size` x `size` RGB PNG; raises whatever PIL raises for a file that does not decode."""
    from PIL import Image

    with Image.open(path) as im:
        image = center_crop(im.convert("RGB"), size)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def split_files(files: list[list[Path]], *, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """(paths, labels, {split: rows}): each class's files shuffled with the seed, the first
    round(n * val_fraction) to val but never all of them; each split's rows then shuffled with the seed across
    classes. Not in class order: a folder's classes one after the other would give shards of one or two classes each,
    which the training loader's streaming shuffle cannot mix (every batch then nearly one class; the captioned digits
    showed it: data/prepare_captions.py split_rows)."""
    paths, labels, rows = [], [], {"train": [], "val": []}
    for label, class_files in enumerate(files):
        order = list(range(len(class_files)))
        random.Random(f"kiln.prepare_images/{seed}/{label}").shuffle(order)
        n_val = min(round(len(order) * val_fraction), len(order) - 1)
        for i, j in enumerate(order):
            rows["val" if i < n_val else "train"].append(len(paths))
            paths.append(class_files[j])
            labels.append(label)
    return (
        np.array(paths, dtype=object),
        np.asarray(labels, dtype=np.int64),
        {k: np.asarray(_shuffled(v, f"kiln.prepare_images/{seed}/{k}"), dtype=np.int64) for k, v in rows.items()},
    )


def _shuffled(rows: list[int], seed: str) -> list[int]:
    rows = sorted(rows)
    random.Random(seed).shuffle(rows)
    return rows


def _settings(meta: dict) -> dict:
    return {
        "input": meta.get("input"),
        "image_files": meta.get("image_files"),
        "image_size": meta.get("image_size"),
        **shards.split_settings(meta),
    }


def build_image_shards(
    out: str | Path,
    *,
    input: str | Path,
    image_size: int,
    train_shards: int = 8,
    val_shards: int = 2,
    val_fraction: float = 0.15,
    seed: int = 0,
    force: bool = False,
) -> tuple[dict, bool]:
    """Build the dataset in ``out`` unless a complete one is there. Returns (meta, built_now)."""
    import webdataset as wds

    out, root = Path(out).absolute(), Path(input).expanduser().absolute()
    classes, files = list_image_folder(root)
    skipped: list[str] = []

    def write_shards(
        tmp: Path, split: str, rows: np.ndarray, paths: np.ndarray, labels: np.ndarray, num_shards: int
    ) -> list[dict]:
        written, per_class = [], np.zeros(len(classes), dtype=np.int64)
        for shard_id, chunk in enumerate(np.array_split(rows, num_shards)):
            name, count = f"{split}-{shard_id:06d}.tar", 0
            with wds.TarWriter(str(tmp / name), mtime=0) as sink:
                for row in chunk:
                    try:
                        png = encode_image(paths[row], image_size)
                    except Exception:  # PIL raises many kinds (UnidentifiedImageError, OSError, ValueError, ...)
                        skipped.append(str(paths[row].relative_to(root)))
                        continue
                    sink.write({"__key__": f"{split}_{row:07d}", "png": png, "cls": int(labels[row])})
                    per_class[labels[row]] += 1
                    count += 1
            written.append({"name": name, "samples": count, "bytes": (tmp / name).stat().st_size})
        if split == "train" and not per_class.all():
            bad = [classes[c] for c in np.flatnonzero(per_class == 0)]
            raise ValueError(f"--input {root}: no decodable training image in class folder(s): {', '.join(bad)}")
        return written

    def start_meta(tmp: Path) -> dict[str, Any]:
        (tmp / CLASSES_NAME).write_text(json.dumps(classes, indent=2) + "\n")
        return {
            "source": SOURCE,
            "input": str(root),
            "image_files": sum(map(len, files)),
            "image_size": image_size,
            "channels": 3,
            "num_classes": len(classes),
            "classes": classes,
            "splits": {},
            "seed": seed,
            "val_fraction": val_fraction,
            "skipped_undecodable": skipped,
        }  # filled while the shards are written

    return shards.build_atomically(
        out,
        train_shards=train_shards,
        val_shards=val_shards,
        val_fraction=val_fraction,
        force=force,
        dataset="image",
        read_meta=common_dataset.read_meta,
        load=lambda: split_files(files, val_fraction=val_fraction, seed=seed),
        start_meta=start_meta,
        write_shards=write_shards,
    )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    def extra(parser: argparse.ArgumentParser, positive_int) -> None:
        parser.add_argument("--input", required=True, type=Path, help="ImageFolder: one subfolder of images per class")
        parser.add_argument("--image-size", required=True, type=positive_int, help="side of the square images written")

    parser = cli.arg_parser(
        "python -m data.prepare_images",
        __doc__.splitlines()[0],
        "output directory (created; must be empty or a previous build)",
        extra=extra,
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        root = args.input.expanduser().absolute()
        classes, files = list_image_folder(root)
    except ValueError as exc:
        return cli.error(exc)
    build = lambda out, **kw: build_image_shards(out, input=root, image_size=args.image_size, **kw)  # noqa: E731

    def describe(out: Path, meta: dict) -> str:
        skipped = meta["skipped_undecodable"]
        return (
            f"{cli.summary(out, meta)}; {meta['num_classes']} classes ({CLASSES_NAME}), {args.image_size}x"
            f"{args.image_size} RGB; skipped {len(skipped)} undecodable file(s)"
            + (f": {', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}" if skipped else "")
        )

    return cli.run(
        build,
        args,
        wanted=cli.split_wanted(args),
        describe=describe,
        settings=_settings,
        holds="image shards",
        also_wanted={"input": str(root), "image_files": sum(map(len, files)), "image_size": args.image_size},
    )


if __name__ == "__main__":
    sys.exit(main())
