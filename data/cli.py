"""The dataset builders' command line: one skeleton for every ``python -m data.<builder>``.

A builder parses its flags with :func:`arg_parser` (``--out``, its own flags, the split flags, ``--force``) and
hands :func:`run` its build, the settings its flags ask for (:func:`split_wanted`) and its summary. ``run``
builds ``--out`` unless a complete dataset is there: with the same settings it says so (exit 0), with others it
says which differ (exit 1); bad input is one ``error:`` line on stderr (exit 2, :func:`error`), never a traceback.
A build prints one summary line (:func:`summary`, then the builder's own numbers).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from data.shards import META_NAME, mismatch


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
    return value


def arg_parser(
    prog: str,
    description: str,
    out_help: str,
    extra: Callable[[argparse.ArgumentParser, Callable[[str], int]], None] | None = None,
    seed_help: str = "split seed",
) -> argparse.ArgumentParser:
    """``--out``, then what ``extra(parser, positive_int)`` adds, then the split arguments and ``--force``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--out", required=True, type=Path, help=out_help)
    if extra is not None:
        extra(parser, _positive_int)
    parser.add_argument("--train-shards", type=_positive_int, default=8)
    parser.add_argument("--val-shards", type=_positive_int, default=2)
    parser.add_argument(
        "--val-fraction", type=_fraction, default=0.15, help="share of samples held out for val (stratified)"
    )
    parser.add_argument("--seed", type=int, default=0, help=seed_help)
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if a complete dataset is there (replaces DIR)"
    )
    return parser


def bucket_args(
    parser: argparse.ArgumentParser, ratios: tuple[str, ...], multiple: int, pixels: str, what: str
) -> None:
    """The aspect-bucket and skip-limit flags of the builders of images and clips: ``--buckets`` (width:height
    ratios of about `pixels` pixels), ``--bucket-multiple`` and ``--max-bad-samples`` (`what`: "images", "clips")."""
    parser.add_argument(
        "--buckets",
        nargs="?",
        const=",".join(ratios),
        default=None,
        help=f"aspect-ratio buckets of about {pixels} pixels: width:height ratios, comma-separated "
        f"(default {','.join(ratios)})",
    )
    parser.add_argument(
        "--bucket-multiple",
        type=_positive_int,
        default=multiple,
        help="both sides of every bucket are multiples of this: the VAE's downsampling x the patch size",
    )
    parser.add_argument(
        "--max-bad-samples",
        type=int,
        default=None,
        help=f"stop (nothing written) when more {what} than this are skipped (default: no limit)",
    )


def split_wanted(args: argparse.Namespace, **own) -> dict:
    """The settings the flags ask for: a builder's ``own`` first, then the split flags (compared, in this
    order, with those of a dataset already in ``--out``)."""
    split = ("train_shards", "val_shards", "val_fraction", "seed")
    return {**own, **{key: getattr(args, key) for key in split}}


def error(exc: Exception, prefix: str = "error") -> int:
    """Bad input as one line on stderr; the exit code 2."""
    print(f"{prefix}: {exc}", file=sys.stderr)
    return 2


def nothing_to_do(out: Path) -> int:
    """A complete dataset with the settings asked for is there already: say so; the exit code 0."""
    print(f"{out}/{META_NAME} exists; nothing to do (pass --force to rebuild)")
    return 0


def build_or_check(
    build: Callable[..., tuple[dict, bool]],
    out: Path,
    wanted: dict,
    *,
    force: bool,
    settings: Callable[[dict], dict],
    holds: str,
    show_wanted: bool,
    also_wanted: dict | None = None,
    error_prefix: str = "error",
) -> tuple[dict | None, int]:
    """A CLI's ``build(out, **wanted, force=force)``: (meta, 0) when it built, else (None, exit code).

    Exit codes: 2 after printing a ValueError; for a complete dataset already there, 0 if
    ``settings(meta)`` equals ``wanted`` plus ``also_wanted``, else 1 (after saying what differs). Both lines
    start with ``error_prefix``.
    """
    try:
        meta, built = build(out, **wanted, force=force)
    except ValueError as exc:
        return None, error(exc, error_prefix)
    if built:
        return meta, 0
    wanted = {**wanted, **(also_wanted or {})}
    have = settings(meta)
    if have != wanted:
        differ = mismatch(have, wanted, show_wanted=show_wanted)
        print(
            f"{error_prefix}: {out} already holds {holds} built with {differ}; pass --force to rebuild",
            file=sys.stderr,
        )
        return None, 1
    return None, nothing_to_do(out)


def run(
    build: Callable[..., tuple[dict, bool]],
    args: argparse.Namespace,
    *,
    wanted: dict,
    describe: Callable[[Path, dict], str],
    settings: Callable[[dict], dict],
    holds: str,
    show_wanted: bool = True,
    also_wanted: dict | None = None,
    error_prefix: str = "error",
) -> int:
    """A builder's main once its flags are parsed: build ``args.out`` (:func:`build_or_check`), then print
    ``describe(out, meta)``. Returns the exit code."""
    out = args.out.absolute()
    meta, rc = build_or_check(
        build, out, wanted, force=args.force, settings=settings, holds=holds, show_wanted=show_wanted,
        also_wanted=also_wanted, error_prefix=error_prefix,
    )  # fmt: skip
    if meta is None:
        return rc
    print(describe(out, meta))
    return 0


def summary(out: Path, meta: dict) -> str:
    """``wrote DIR: train N samples in K shards, val ... (seed S)``."""
    splits = meta["splits"]
    return (
        f"wrote {out}: train {splits['train']['samples']} samples in {len(splits['train']['shards'])} shards, "
        f"val {splits['val']['samples']} samples in {len(splits['val']['shards'])} shards (seed {meta['seed']})"
    )
