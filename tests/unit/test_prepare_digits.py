"""Unit tests for data.prepare_digits: shard contents vs sklearn, split, atomic build, no-op rerun."""

from __future__ import annotations

import functools
import io
import json
import os

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from common.diffusion.images import to_model_space
from data import prepare_digits as pd
from recipes.dit.data import decode_sample, load_split_arrays

N_DIGITS = 1797


@pytest.fixture(scope="module")
def source():
    return pd.load_source_digits()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits") / "shards"
    assert pd.main(["--out", str(out), "--train-shards", "4", "--val-shards", "2", "--seed", "7"]) == 0
    return out


def _rows(root, meta, split) -> list[int]:
    """sklearn row of every sample in a split, in shard order (the number in the key)."""
    urls = [str(root / n) for n in meta["splits"][split]["shards"]]
    return [int(s["__key__"].split("_")[1]) for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False)]


def test_source_scaling():
    from sklearn.datasets import load_digits

    images, labels = pd.load_source_digits()
    raw = load_digits()
    assert images.shape == (N_DIGITS, 8, 8) and images.dtype == np.uint8
    assert images.max() == 255 and images.min() == 0
    np.testing.assert_array_equal(images, np.rint(raw.images * 255 / 16).astype(np.uint8))
    np.testing.assert_array_equal(labels, raw.target)


def test_files_and_meta(built):
    meta = json.loads((built / "meta.json").read_text())
    assert meta["source"] == "sklearn.datasets.load_digits"
    assert meta["image_size"] == 8 and meta["num_classes"] == 10 and meta["seed"] == 7
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    assert train["shards"] == [f"train-{i:06d}.tar" for i in range(4)]
    assert val["shards"] == [f"val-{i:06d}.tar" for i in range(2)]
    assert train["samples"] + val["samples"] == N_DIGITS
    assert val["samples"] == pytest.approx(0.15 * N_DIGITS, abs=1)
    # Spread evenly: shard sizes differ by at most one.
    for info in (train, val):
        assert sum(info["shard_samples"]) == info["samples"]
        assert max(info["shard_samples"]) - min(info["shard_samples"]) <= 1
    assert sorted(p.name for p in built.iterdir()) == sorted(["meta.json", *train["shards"], *val["shards"]])
    # No temp dirs left next to the output.
    assert [p.name for p in built.parent.iterdir()] == ["shards"]


def test_split_is_disjoint_complete_and_stratified(built, source):
    meta = json.loads((built / "meta.json").read_text())
    train, val = _rows(built, meta, "train"), _rows(built, meta, "val")
    assert len(train) == len(set(train)) == meta["splits"]["train"]["samples"]
    assert len(val) == len(set(val)) == meta["splits"]["val"]["samples"]
    assert not set(train) & set(val)
    assert set(train) | set(val) == set(range(N_DIGITS))
    _, labels = source
    # Every class is held out in roughly the same share (stratified).
    share = np.bincount(labels[val], minlength=10) / np.bincount(labels, minlength=10)
    assert np.all(np.abs(share - 0.15) < 0.02)


def test_webdataset_reader_decodes_to_sklearn_digits(built, source):
    images, labels = source
    meta = json.loads((built / "meta.json").read_text())
    urls = [str(built / n) for s in ("train", "val") for n in meta["splits"][s]["shards"]]
    count = 0
    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode("l8"):
        row = int(sample["__key__"].split("_")[1])
        img = sample["png"]  # webdataset's own PNG decoder: grayscale uint8 array
        assert img.shape == (8, 8) and img.dtype == np.uint8
        np.testing.assert_array_equal(img, images[row])
        assert int(sample["cls"]) == labels[row]
        count += 1
    assert count == N_DIGITS


def test_png_is_grayscale_uint8(built):
    url = str(built / "train-000000.tar")
    sample = next(iter(wds.WebDataset([url], shardshuffle=False, empty_check=False)))
    with Image.open(io.BytesIO(sample["png"])) as im:
        assert im.mode == "L" and im.size == (8, 8) and im.format == "PNG"


def test_load_split_arrays_and_decode(built, source, monkeypatch):
    """What the DiT's evaluation reads (recipes/dit/data.py): whole splits, in shard order, on
    every rank of a torchrun job (RANK/WORLD_SIZE set: a bare wds.WebDataset refused to read there)."""
    images, labels = source
    meta = json.loads((built / "meta.json").read_text())
    expected_rows = {split: _rows(built, meta, split) for split in ("train", "val")}  # read before "joining" the job
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for split, rows in expected_rows.items():
        x, y = load_split_arrays(built, split)
        assert x.dtype == np.uint8 and x.shape == (len(rows), 8, 8) and y.dtype == np.int64
        np.testing.assert_array_equal(x, images[rows])
        np.testing.assert_array_equal(y, labels[rows])
    with pytest.raises(ValueError, match="split"):
        load_split_arrays(built, "test")


def test_rerun_is_noop(built, capsys):
    before = {p.name: (p.stat().st_mtime_ns, p.stat().st_ino) for p in built.iterdir()}
    assert pd.main(["--out", str(built), "--train-shards", "4", "--val-shards", "2", "--seed", "7"]) == 0
    assert "exists" in capsys.readouterr().out
    assert {p.name: (p.stat().st_mtime_ns, p.stat().st_ino) for p in built.iterdir()} == before
    # Other settings against an existing dataset: refused, untouched.
    assert pd.main(["--out", str(built), "--seed", "8"]) == 1
    assert "--force" in capsys.readouterr().err
    assert {p.name: (p.stat().st_mtime_ns, p.stat().st_ino) for p in built.iterdir()} == before


def test_force_rebuild_is_byte_identical(tmp_path):
    out = tmp_path / "d"
    assert pd.main(["--out", str(out), "--train-shards", "2", "--val-shards", "1"]) == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert pd.main(["--out", str(out), "--train-shards", "2", "--val-shards", "1", "--force"]) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_ensure_builds_when_missing_then_reuses(tmp_path):
    root = tmp_path / "nested" / "digits"
    meta = pd.ensure_digits_shards(root, train_shards=2, val_shards=1, seed=0)
    assert len(meta["train_urls"]) == 2 and len(meta["val_urls"]) == 1
    for url in meta["train_urls"] + meta["val_urls"]:
        assert os.path.isabs(url) and os.path.isfile(url)
    assert meta["splits"]["train"]["samples"] + meta["splits"]["val"]["samples"] == N_DIGITS
    stamp = (root / "meta.json").stat().st_mtime_ns
    again = pd.ensure_digits_shards(root, train_shards=2, val_shards=1, seed=0)
    assert again == meta and (root / "meta.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="seed=0 \\(wanted 1\\)"):
        pd.ensure_digits_shards(root, train_shards=2, val_shards=1, seed=1)


def test_incomplete_dataset_is_rebuilt(tmp_path):
    root = tmp_path / "d"
    pd.ensure_digits_shards(root, train_shards=2, val_shards=1)
    # A truncated shard makes the dataset incomplete (meta records the byte sizes).
    shard = root / "train-000001.tar"
    shard.write_bytes(shard.read_bytes()[:1000])
    assert pd.read_meta(root) is None
    with pytest.raises(ValueError, match="not empty"):
        pd.ensure_digits_shards(root, train_shards=2, val_shards=1)  # never deletes what it cannot vouch for
    assert pd.main(["--out", str(root), "--train-shards", "2", "--val-shards", "1", "--force"]) == 0
    assert pd.read_meta(root) is not None


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    calls = []

    def boom(*args, **kwargs):
        calls.append(args[1])
        if args[1] == "val":
            raise KeyboardInterrupt  # e.g. Ctrl-C after the train shards were written
        return real(*args, **kwargs)

    real = pd._write_shards
    monkeypatch.setattr(pd, "_write_shards", boom)
    with pytest.raises(KeyboardInterrupt):
        pd.ensure_digits_shards(tmp_path / "d", train_shards=2, val_shards=1)
    assert calls == ["train", "val"]
    assert list(tmp_path.iterdir()) == []  # no half-written dataset, no temp dir


def test_refuses_foreign_nonempty_dir(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert pd.main(["--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--out", "x", "--val-fraction", "1.5"],
        ["--out", "x", "--train-shards", "0"],
        ["--out", "x", "--seed", "abc"],
    ],
)
def test_bad_args_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        pd.main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_digits_through_the_resumable_loader(built, source):
    """The DiT's training decode (recipes/dit/data.py) through the loader: sklearn's digits in model space."""
    from common.data.webdataset import build_webdataset_loader

    images, labels = source
    meta = pd.ensure_digits_shards(built, train_shards=4, val_shards=2, seed=7)
    loader = build_webdataset_loader(
        meta["train_urls"],
        decode=functools.partial(decode_sample, image_size=8),
        batch_size=16,
        rank=1,
        world_size=2,
        num_workers=2,
        seed=0,
        collate=list,
    )
    try:
        batch = next(iter(loader))
    finally:
        loader.close()
    assert len(batch) == 16
    for sample in batch:
        assert sample["image"].shape == (1, 8, 8) and sample["image"].dtype == torch.float32
        assert isinstance(sample["label"], int) and 0 <= sample["label"] <= 9
    # Rank 1 of 2 reads the odd shards: every decoded sample is one of their digits, label included.
    rows = [
        int(s["__key__"].split("_")[1])
        for s in wds.WebDataset(meta["train_urls"][1::2], shardshuffle=False, empty_check=False)
    ]
    expected = to_model_space(torch.from_numpy(images[rows]), 8)
    for sample in batch:
        same = (expected - sample["image"]).abs().amax(dim=(1, 2, 3)) == 0
        assert sample["label"] in {int(labels[rows[i]]) for i in same.nonzero().flatten()}
