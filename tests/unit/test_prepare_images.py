"""data.prepare_images: an ImageFolder becomes class-labelled RGB shards the DiT reads; bad folders stop with one
line."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from common.data.dataset import load_dataset_meta
from common.data.webdataset import iter_samples
from data import prepare_images
from data.tiny_bases import make_image_folder
from recipes.dit.data import decode_sample
from tests.support.launcher import run_python


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("images") / "my_images", classes=3, per_class=10, size=24)


@pytest.fixture(scope="module")
def built(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards") / "ds"
    assert (
        prepare_images.main(
            [
                "--input",
                str(folder),
                "--out",
                str(out),
                "--image-size",
                "32",
                "--train-shards",
                "2",
                "--val-shards",
                "1",
                "--val-fraction",
                "0.2",
            ]
        )
        == 0
    )
    return out


def test_meta_classes_and_skipped_file(built, folder):
    meta = load_dataset_meta(built)
    assert meta["classes"] == ["digit_0", "digit_1", "digit_2"] == json.loads((built / "classes.json").read_text())
    assert meta["num_classes"] == 3 and meta["image_size"] == 32 and meta["channels"] == 3
    assert meta["skipped_undecodable"] == ["digit_0/broken.png"]
    # 10 images per class (digit_0: + the broken file), round(n * 0.2) of each class's files to val.
    splits = meta["splits"]
    assert splits["train"]["samples"] + splits["val"]["samples"] == 30 and splits["val"]["samples"] in (5, 6)


def test_samples_are_the_source_images_resized(built, folder):
    """Each stored image is its source file converted to RGB and bicubic-resized (square sources:
    the center crop keeps everything), computed here independently with PIL."""
    classes = json.loads((built / "classes.json").read_text())
    sources = {}
    for label, name in enumerate(classes):
        for path in sorted((folder / name).glob("*.png")):
            if path.name != "broken.png":
                with Image.open(path) as im:
                    sources.setdefault(label, []).append(np.asarray(im.convert("RGB").resize((32, 32), Image.BICUBIC)))
    meta = load_dataset_meta(built)
    seen = 0
    for sample in iter_samples(meta["train_urls"] + meta["val_urls"]):
        label = int(sample["cls"])
        stored = np.asarray(Image.open(io.BytesIO(sample["png"])))
        assert stored.shape == (32, 32, 3)
        assert any(np.array_equal(stored, src) for src in sources[label]), sample["__key__"]
        x = decode_sample(sample, image_size=32, channels=3)["image"]
        assert x.shape == (3, 32, 32) and -1 <= x.min() and x.max() <= 1
        np.testing.assert_allclose(x.permute(1, 2, 0).numpy(), stored / 127.5 - 1, atol=1e-6)
        seen += 1
    assert seen == 30


def test_center_crop_of_a_wide_image():
    wide = Image.fromarray(np.tile(np.arange(200, dtype=np.uint8)[None, :, None], (50, 1, 3)))
    out = prepare_images.center_crop(wide, 25)  # 200x50 -> box-halved once to 100x25, crop the middle 25 columns
    assert out.size == (25, 25)
    assert np.asarray(out)[0, 0, 0] == pytest.approx(75, abs=2) and np.asarray(out)[0, -1, 0] == pytest.approx(
        123, abs=2
    )


def test_rerun_is_a_noop(built, folder, capsys):
    assert (
        prepare_images.main(
            [
                "--input",
                str(folder),
                "--out",
                str(built),
                "--image-size",
                "32",
                "--train-shards",
                "2",
                "--val-shards",
                "1",
                "--val-fraction",
                "0.2",
            ]
        )
        == 0
    )
    assert "nothing to do" in capsys.readouterr().out


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_python([sys.executable, "-m", "data.prepare_images", *args], timeout=120)


@pytest.mark.parametrize(
    "layout, needle",
    [
        ({}, "has no class subfolders"),  # an empty folder
        ({"cats": ["a.png"], "dogs": []}, "class folder(s) without images: dogs"),
        ({"cats": ["a.png"], "dogs": ["notes.txt"]}, "class folder(s) without images: dogs"),
        (
            {"cats": ["a.png", "b.png"], "dogs": ["bad.png", "bad2.png"]},
            "no decodable training image in class folder(s): dogs",
        ),
    ],
)
def test_bad_folders_stop_with_one_line(tmp_path, layout, needle):
    root = tmp_path / "in"
    root.mkdir()
    for name, files in layout.items():
        (root / name).mkdir()
        for f in files:
            if f in ("a.png", "b.png"):
                Image.new("RGB", (8, 8), (200, 10, 10)).save(root / name / f)
            else:
                (root / name / f).write_bytes(b"not an image")
    proc = _run(
        "--input",
        str(root),
        "--out",
        str(tmp_path / "out"),
        "--image-size",
        "8",
        "--train-shards",
        "1",
        "--val-shards",
        "1",
        "--val-fraction",
        "0.5",
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:") and needle in lines[0]
    assert not (tmp_path / "out").exists()


def test_training_refuses_shards_of_another_size(built):
    from common.errors import DataError
    from recipes.dit.data import check_image_size
    from scripts.kiln.launch import compose

    meta = load_dataset_meta(built)
    assert check_image_size(compose(["recipe=dit_tiny", "data=images", "data.image_size=32"]), meta) is meta
    with pytest.raises(
        DataError,
        match="holds 32x32 images but data.image_size=64: set data.image_size=32 "
        "or rebuild the shards with prepare_images --image-size 64",
    ):
        check_image_size(compose(["recipe=dit_tiny", "data=images", "data.image_size=64"]), meta)


def test_every_training_shard_mixes_the_classes(built):
    """Rows are written in a seeded shuffled order, not class by class: with 3 classes in 2 training shards, class
    order would give one shard of digit_0 and digit_1 only and the other of digit_1 and digit_2 (the training
    loader's streaming shuffle cannot mix across shards, so a batch would hold one or two classes)."""
    meta = load_dataset_meta(built)
    for url in meta["train_urls"]:
        labels = [int(s["cls"]) for s in iter_samples([url])]
        assert sorted(set(labels)) == [0, 1, 2], (url, labels)
        assert labels != sorted(labels), (url, labels)
