"""Turn a folder of captioned images into text-to-image WebDataset shards (train / held-out val).

    python -m data.prepare_captions --input ~/data/captioned --out data/captioned --image-size 512
                                    [--train-shards 8] [--val-shards 2] [--val-fraction 0.05] [--seed 0] [--force]
    python -m data.prepare_captions --digits --out data/cache/captioned_digits --image-size 16   # the t2i_tiny demo
    python -m data.prepare_captions --input ... --image-size 512 --buckets [1:2,2:3,3:4,1:1,4:3,3:2,2:1]
                                    [--bucket-multiple 16] [--max-bad-samples N]

A caption per image, in either of the layouts diffusers' ImageFolder and its training scripts read:
``name.txt`` beside ``name.png`` (any image extension), or one ``metadata.jsonl`` in --input with a
``{"file_name": "name.png", "text": "a caption"}`` line per image (then .txt files are ignored). Images are
found recursively; each is converted to RGB, resized and center-cropped to a square exactly as
prepare_images does (``center_crop``), and stored as ``{__key__, png: RGB PNG, txt: the caption}``.

An image that does not decode, an image without a caption and an image whose caption is empty (whitespace only)
are skipped and counted (meta.json ``skipped``: file names by reason, and the summary line). A caption file that
is not UTF-8 text, a metadata.jsonl line that is not a {"file_name", "text"} object, or no captioned image at all
stop with one line (exit 2), and so do more skipped images than ``--max-bad-samples`` (no limit by default;
nothing is written then). ``--digits`` captions scikit-learn's digits in several phrasings ("a handwritten
seven", "the digit 7", ...: data/tiny_bases.py) and converts them the same way. Like the other builders,
DIR appears at once with meta.json written last.

Aspect-ratio buckets (``--buckets``, as SDXL and SimpleTuner train; the run's data.buckets=true reads them): a bucket
shape per aspect ratio (width:height), of about --image-size squared pixels with both sides multiples of
``--bucket-multiple`` (the VAE's downsampling x the transformer's patch size: 16 for SD3's 8 x 2; the run checks it
against model.init_from). Each image is resized to cover the bucket whose aspect ratio is nearest its own (in log
ratio, the first of equals) and center-cropped to it -- never squashed or padded -- and its sample gets a ``bucket``
field, ``WxH``. meta.json ``buckets``: the ratios, the multiple, the shapes and each split's samples per shape.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from common.data import dataset as common_dataset
from common.data.captions import SKIP_REASONS, SOURCE, skip_summary
from common.data.resize import cover_crop  # the video builder and loaders crop frames the same way
from data import cli, shards
from data.prepare_images import IMAGE_EXTENSIONS, encode_image

METADATA = "metadata.jsonl"
ASPECT_RATIOS = ("1:2", "2:3", "3:4", "1:1", "4:3", "3:2", "2:1")  # --buckets' default: portrait 1:2 to landscape 2:1
BUCKET_MULTIPLE = 16  # SD3's VAE downsamples by 8 and its transformer patches 2x2


def parse_ratio(text: str) -> tuple[int, int]:
    try:
        w, h = (int(x) for x in text.split(":"))
        if w > 0 and h > 0:
            return w, h
    except ValueError:
        pass
    raise ValueError(f"--buckets: {text!r} is not an aspect ratio width:height of positive integers (e.g. 3:2)")


def bucket_shapes(image_size: int, ratios, multiple: int) -> list[tuple[int, int]]:
    """(width, height) per aspect ratio, of about image_size^2 pixels, both sides multiples of `multiple` (at least
    one multiple); distinct, from the tallest to the widest. ValueError for an image size `multiple` does not divide."""
    if multiple < 1 or image_size % multiple:
        raise ValueError(
            f"--image-size {image_size} must be a multiple of --bucket-multiple {multiple} (the VAE's downsampling x "
            "the transformer's patch size)"
        )
    shapes = set()
    for text in ratios:
        w, h = parse_ratio(text)
        side = lambda x: max(multiple, round(image_size * math.sqrt(x) / multiple) * multiple)  # noqa: E731
        shapes.add((side(w / h), side(h / w)))
    return sorted(shapes, key=lambda s: s[0] / s[1])


def nearest_bucket(width: int, height: int, shapes: list[tuple[int, int]]) -> tuple[int, int]:
    """The shape whose aspect ratio is nearest width/height in log ratio (the first of equals)."""
    return min(shapes, key=lambda s: abs(math.log(width / height) - math.log(s[0] / s[1])))


def encode_bucketed(path: Path, shapes: list[tuple[int, int]]) -> tuple[bytes, tuple[int, int]]:
    """The file as an RGB PNG of its nearest bucket's shape, and that shape; raises what PIL raises for a bad file."""
    import io

    from PIL import Image

    with Image.open(path) as im:
        shape = nearest_bucket(*im.size, shapes)
        image = cover_crop(im.convert("RGB"), *shape)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue(), shape


def check_skipped(skipped: dict[str, list[str]], max_bad_samples: int | None, what: str) -> None:
    """ValueError when more images were skipped than `max_bad_samples` (None: no limit)."""
    n = sum(map(len, skipped.values()))
    if max_bad_samples is not None and n > max_bad_samples:
        meta = {"skipped": skipped}
        raise ValueError(f"{skip_summary(meta)}, more than {what}={max_bad_samples}: fix or remove them, or raise it")


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
    never all), each split in that shuffled order. Not in file order: a folder sorted by subject (the digits' is
    sorted by digit) would give shards of one or two subjects each, which the training loader's streaming shuffle
    buffer cannot mix across, so every batch would hold one subject and a text-to-image model would learn the
    batch's subject rather than its prompts (t2i_tiny on the demo's base, 1,000 steps of 64 at lr 1e-3: held-out
    prompt adherence 0.528 on file-ordered shards, 0.658 on shuffled ones; measured once each)."""
    order = list(range(n))
    random.Random(f"kiln.prepare_captions/{seed}").shuffle(order)
    n_val = min(max(round(n * val_fraction), 1), n - 1)
    return {
        "val": np.asarray(order[:n_val], dtype=np.int64),
        "train": np.asarray(order[n_val:], dtype=np.int64),
    }


def _settings(meta: dict) -> dict:
    buckets = meta.get("buckets") or {}
    return {
        "input": meta.get("input"),
        "image_size": meta.get("image_size"),
        **shards.split_settings(meta),
        "buckets": buckets.get("aspect_ratios"),
        "bucket_multiple": buckets.get("multiple"),
    }


def _captioned(root: Path, images: list[Path], captions: list, max_bad_samples: int | None):
    """The images with a caption, as (path, stripped caption), and the skipped ones' names per reason (the dict
    the shards' writing adds to). ValueError for fewer than two."""
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
    check_skipped(skipped, max_bad_samples, "--max-bad-samples")
    if len(usable) < 2:
        raise ValueError(
            f"--input {root}: {len(usable)} captioned image(s); a caption per image is name.txt beside name.png, "
            f"or a {METADATA} of file_name/text lines"
        )
    return usable, skipped


def _start_meta(
    root: Path,
    image_files: int,
    image_size: int,
    seed: int,
    val_fraction: float,
    skipped: dict,
    shapes,
    buckets,
    bucket_multiple: int,
    per_bucket: dict,
) -> dict[str, Any]:
    """meta.json before the shards are written (``skipped`` and the buckets' ``samples`` filled while they are)."""
    bucketed = {}
    if shapes:
        bucketed["buckets"] = {
            "aspect_ratios": list(buckets),
            "multiple": bucket_multiple,
            "shapes": [list(s) for s in shapes],
            "samples": per_bucket,  # {split: {"WxH": samples}}, filled while the shards are written
        }
    return {
        "source": SOURCE,
        "input": str(root),
        "image_files": image_files,
        "image_size": image_size,
        "channels": 3,
        "splits": {},
        "seed": seed,
        "val_fraction": val_fraction,
        "skipped": skipped,  # filled while the shards are written
        **bucketed,
    }


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
    buckets: list[str] | tuple[str, ...] | None = None,
    bucket_multiple: int = BUCKET_MULTIPLE,
    max_bad_samples: int | None = None,
) -> tuple[dict, bool]:
    """Build the dataset in ``out`` unless a complete one is there. Returns (meta, built_now). ``buckets``: aspect
    ratios (``"3:2"``) to bucket by (the module docstring); ``max_bad_samples``: the most images skipped."""
    shapes = bucket_shapes(image_size, buckets, bucket_multiple) if buckets else None
    per_bucket: dict[str, dict[str, int]] = {}
    out, root = Path(out).absolute(), Path(input).expanduser().absolute()
    images, captions = list_captioned(root)
    usable, skipped = _captioned(root, images, captions, max_bad_samples)
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
                        if shapes:
                            png, shape = encode_bucketed(paths[row], shapes)
                        else:
                            png = encode_image(paths[row], image_size)
                    except Exception:  # PIL raises many kinds (UnidentifiedImageError, OSError, ValueError, ...)
                        skipped["undecodable"].append(str(paths[row].relative_to(root)))
                        continue
                    sample = {"__key__": f"{split}_{row:07d}", "png": png, "txt": texts[row]}
                    if shapes:
                        sample["bucket"] = f"{shape[0]}x{shape[1]}"
                        counts = per_bucket.setdefault(split, {f"{w}x{h}": 0 for w, h in shapes})
                        counts[sample["bucket"]] += 1
                    sink.write(sample)
                    count += 1
            written.append({"name": name, "samples": count, "bytes": (tmp / name).stat().st_size})
        if split == "train" and not sum(w["samples"] for w in written):
            raise ValueError(f"--input {root}: no decodable training image")
        check_skipped(skipped, max_bad_samples, "--max-bad-samples")
        return written

    def start_meta(tmp: Path) -> dict[str, Any]:
        return _start_meta(
            root, len(images), image_size, seed, val_fraction, skipped, shapes, buckets, bucket_multiple, per_bucket
        )

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


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    def extra(parser: argparse.ArgumentParser, positive_int) -> None:
        source = parser.add_mutually_exclusive_group(required=True)
        source.add_argument("--input", type=Path, help="a folder of images with name.txt captions or metadata.jsonl")
        source.add_argument("--digits", action="store_true", help="scikit-learn's digits, captioned (the demo)")
        parser.add_argument("--image-size", required=True, type=positive_int, help="side of the square images written")
        cli.bucket_args(parser, ASPECT_RATIOS, BUCKET_MULTIPLE, "--image-size^2", "images")

    parser = cli.arg_parser(
        "python -m data.prepare_captions",
        __doc__.splitlines()[0],
        "output directory (created; must be empty or a previous build)",
        extra=extra,
    )
    parser.set_defaults(val_fraction=0.05)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kiln-captions-") as scratch:
        if args.digits:
            if common_dataset.read_meta(args.out.absolute()) is not None and not args.force:
                return cli.nothing_to_do(args.out.absolute())
            from data.tiny_bases import make_caption_folder

            root = make_caption_folder(Path(scratch) / "digits", per_digit=180, size=8, bad=False)
        else:
            root = args.input.expanduser().absolute()
        ratios = args.buckets.split(",") if args.buckets else None
        extra = dict(buckets=ratios, bucket_multiple=args.bucket_multiple, max_bad_samples=args.max_bad_samples)
        build = lambda out, **kw: build_caption_shards(out, input=root, image_size=args.image_size, **extra, **kw)  # noqa: E731
        also = {
            "input": str(root),
            "image_size": args.image_size,
            "buckets": ratios,
            "bucket_multiple": args.bucket_multiple if ratios else None,
        }

        def describe(out: Path, meta: dict) -> str:
            shape = f"{args.image_size}x{args.image_size}"
            if meta.get("buckets"):
                train = meta["buckets"]["samples"].get("train", {})
                shape = "buckets " + ", ".join(f"{k} ({n})" for k, n in train.items())
            line = f"{cli.summary(out, meta)}; {shape} RGB with captions; {skip_summary(meta)}"
            if meta["splits"]["val"]["samples"]:
                return line
            # its held-out images did not decode (an empty train split stops)
            return (
                f"{line}\nnote: {out}'s val split is empty (no held-out image decoded): a text-to-image run samples "
                "its first training captions instead and skips the held-out eval; fix the undecodable images or "
                "change --seed"
            )

        return cli.run(
            build, args, wanted=cli.split_wanted(args), describe=describe, settings=_settings,
            holds="caption shards", also_wanted=also,
        )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
