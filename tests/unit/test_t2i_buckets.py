"""Aspect-ratio buckets (data/prepare_captions.py --buckets, data.buckets) and data.max_bad_samples: the bucket a
shape goes to, global batches of one bucket on any layout with an exact resume (the grouped global stream of
common/data/webdataset/stream.py), a short bucketed run, and the one-line refusals."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import webdataset as wds

from common.data.webdataset import build_webdataset_loader, global_train_loader
from common.errors import ConfigError

GROUPS = 2


def decode_id(sample: dict) -> dict:
    return {"id": int(sample["cls"]), "group": sample["grp"].decode()}


def group_of(sample: dict) -> bytes:
    return sample["grp"]


def collate(samples: list[dict]) -> dict:
    return {"id": [s["id"] for s in samples], "group": [s["group"] for s in samples]}


def write_grouped_shards(root, sizes=(9, 14, 6, 11)) -> list[str]:
    """Shard i holds ids i*100 + j; a sample's group is "a" or "b" by an arbitrary rule (about a third "b")."""
    urls = []
    for i, n in enumerate(sizes):
        url = str(root / f"g-{i:04d}.tar")
        with wds.TarWriter(url, mtime=0) as sink:
            for j in range(n):
                sink.write({"__key__": f"s{i}_{j}", "cls": i * 100 + j, "grp": "b" if (i * 7 + j) % 3 == 0 else "a"})
        urls.append(url)
    return urls


def grouped_loader(urls, *, rank, dp, micro, accum):
    cfg = SimpleNamespace(
        trainer=SimpleNamespace(micro_batch_size=micro, grad_accum=accum, seed=0),
        data=SimpleNamespace(num_workers=0, shuffle_buffer=16, max_corrupt_shards=0),
    )
    return global_train_loader(cfg, urls, decode=decode_id, rank=rank, dp=dp, collate=collate, group=group_of)


def reference_steps(urls, global_batch: int, n: int) -> list[list[int]]:
    """The independent reference: the plain loader's sample order (batch 1, the same seeds and shuffle), queued per
    group by hand; a group whose queue holds a global batch is the next step; epochs follow one another."""
    plain = iter(
        build_webdataset_loader(
            urls, decode=decode_id, collate=collate, batch_size=1, rank=0, world_size=1, seed=0, shuffle_buffer=16
        )
    )
    out, queues, epoch = [], {}, 0
    while len(out) < n:
        sample = next(plain)
        if plain_epoch(plain) != epoch:  # leftovers of an epoch are dropped
            queues, epoch = {}, plain_epoch(plain)
        queue = queues.setdefault(sample["group"][0], [])
        queue.append(sample["id"][0])
        if len(queue) == global_batch:
            out.append(queues.pop(sample["group"][0]))
    return out


def plain_epoch(it) -> int:
    return it.gi_frame.f_locals["self"].epoch


def run_steps(loader, n: int, accum: int) -> list[list[dict]]:
    it = iter(loader)
    return [[next(it) for _ in range(accum)] for _ in range(n)]


def test_grouped_global_batches_are_one_group_the_same_on_every_layout_and_resume(tmp_path):
    urls = write_grouped_shards(tmp_path)  # 40 samples: 3 steps of 4 per epoch at least, 2 groups
    n = 12  # crosses epoch boundaries
    reference = reference_steps(urls, 4, n)
    layouts = {"dp1": (1, 2, 2), "dp2": (2, 1, 2), "dp2_micro2": (2, 2, 1)}  # dp, micro, accum: 4 samples a step
    for name, (dp, micro, accum) in layouts.items():
        ranks = [run_steps(grouped_loader(urls, rank=r, dp=dp, micro=micro, accum=accum), n, accum) for r in range(dp)]
        for step in range(n):
            ids, groups = [], set()
            for i in range(accum):
                parts = [ranks[r][step][i] for r in range(dp)]
                for part in parts:
                    assert len(set(part["group"])) == 1, (name, step, i)  # every micro-batch: one bucket
                    groups |= set(part["group"])
                ids += [x for tup in zip(*(p["id"] for p in parts), strict=True) for x in tup]
            assert len(groups) == 1, (name, step)
            assert ids == reference[step], (name, step)
    # Resume mid-stream (3 steps at dp=2, queues part full) at dp=1: the same next steps.
    first = grouped_loader(urls, rank=1, dp=2, micro=1, accum=2)
    run_steps(first, 5, 2)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = grouped_loader(urls, rank=0, dp=1, micro=4, accum=1)
    resumed.load_state_dict(state)
    assert [s[0]["id"] for s in run_steps(resumed, n - 5, 1)] == reference[5:]
    # An ungrouped loader refuses a grouped position.
    cfg = SimpleNamespace(
        trainer=SimpleNamespace(micro_batch_size=4, grad_accum=1, seed=0),
        data=SimpleNamespace(num_workers=0, shuffle_buffer=16, max_corrupt_shards=0),
    )
    plain = global_train_loader(cfg, urls, decode=decode_id, rank=0, dp=1, collate=collate)
    with pytest.raises(Exception, match="grouped was True when saved"):
        plain.load_state_dict(state)


# ---- prepare_captions --buckets and the t2i run's data.buckets / data.max_bad_samples --------------------------
# Images of these (width, height), captioned; at --image-size 16 --bucket-multiple 4 (the tiny pipeline's VAE 2 x
# patch 2) the default ratios give these shapes, worked out by hand: 1:2 -> 16*sqrt(1/2) = 11.3 -> 12 wide, 16*sqrt(2)
# = 22.6 -> 24 high; 2:3 and 3:4 -> 12x20 (13.1 -> 12, 19.6 -> 20; 13.9 -> 12, 18.5 -> 20); 1:1 -> 16x16; and the
# landscape mirrors.
SIZES = [(40, 20), (20, 40), (30, 30), (50, 24), (24, 50), (33, 31), (36, 30), (30, 36), (26, 40)]
SHAPES = [(12, 24), (12, 20), (16, 16), (20, 12), (24, 12)]


def make_shaped_folder(root, copies: int = 4, broken: bool = False):
    import numpy as np
    from PIL import Image

    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for c in range(copies):
        for i, (w, h) in enumerate(SIZES):
            name = f"{c}_{i}_{w}x{h}"
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / f"{name}.png")
            (root / f"{name}.txt").write_text(f"a picture {i}")
    if broken:
        (root / "broken.png").write_bytes(b"not a png")
        (root / "broken.txt").write_text("a picture")
    return root


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory):
    from data.prepare_captions import build_caption_shards

    root = tmp_path_factory.mktemp("buckets")
    folder = make_shaped_folder(root / "in")
    out = root / "shards"
    build_caption_shards(
        out, input=folder, image_size=16, train_shards=2, val_shards=1, val_fraction=0.1, buckets=("1:2", "2:3",
        "3:4", "1:1", "4:3", "3:2", "2:1"), bucket_multiple=4,
    )  # fmt: skip
    return out


def test_each_image_goes_to_the_bucket_nearest_its_aspect_ratio(bucketed):
    from common.data.dataset import load_dataset_meta
    from common.data.webdataset import iter_samples
    from common.diffusion.images import decode_png

    meta = load_dataset_meta(bucketed)
    assert [tuple(s) for s in meta["buckets"]["shapes"]] == SHAPES
    seen = {}
    for split in ("train", "val"):
        for sample in iter_samples(meta[f"{split}_urls"]):
            w, h = _size_of(meta, sample)
            # The reference: the shape whose width/height is nearest w/h as a ratio of ratios (max(a/b, b/a)).
            want = min(SHAPES, key=lambda s: max((w / h) / (s[0] / s[1]), (s[0] / s[1]) / (w / h)))
            image = decode_png(sample["png"], channels=3)
            assert sample["bucket"].decode() == f"{want[0]}x{want[1]}" and image.shape == (want[1], want[0], 3)
            seen[(w, h)] = want
    assert seen[(40, 20)] == (24, 12) and seen[(26, 40)] == (12, 20) and seen[(36, 30)] == (16, 16)
    counts = meta["buckets"]["samples"]
    assert sum(counts["train"].values()) == meta["splits"]["train"]["samples"]


def _size_of(meta, sample) -> tuple[int, int]:
    """The source image's (width, height), from its file name (the rows are in sorted file order)."""
    return _SOURCE[meta["input"]][int(sample["__key__"].split("_")[1])]


class _Sources(dict):
    def __missing__(self, root):
        from pathlib import Path

        files = sorted(p for p in Path(root).rglob("*.png"))
        self[root] = [tuple(int(x) for x in p.stem.split("_")[2].split("x")) for p in files]
        return self[root]


_SOURCE = _Sources()


def test_bucket_and_bad_sample_refusals_are_one_line(bucketed, t2i_world, tmp_path, capsys):
    from common.data.dataset import load_dataset_meta
    from common.errors import DataError
    from data.prepare_captions import build_caption_shards
    from data.prepare_captions import main as prepare
    from recipes.t2i.data import check_captions
    from scripts.kiln.launch import compose, main

    base = ["recipe=t2i_tiny", f"model.init_from={t2i_world['pipeline']}", "data.build=[]"]
    meta = load_dataset_meta(bucketed)
    square = load_dataset_meta(t2i_world["shards"])
    cfg = compose([*base, "data.buckets=true", "trainer.micro_batch_size=4"])
    assert check_captions(cfg, meta, dp=2) is meta  # 8 a step: the 12x24 bucket holds more
    with pytest.raises(DataError, match=r"^data.buckets: no bucket of data.root=.* holds a global batch of 64 "):
        check_captions(compose([*base, "data.buckets=true", "trainer.micro_batch_size=32"]), meta, dp=2)
    with pytest.raises(DataError, match=r"^data.buckets=true but data.root=.* holds square images: rebuild"):
        check_captions(cfg, square, dp=1)
    with pytest.raises(DataError, match=r"^data.root=.* holds aspect-ratio buckets \(12x24, "):
        check_captions(compose(base), meta, dp=1)
    with pytest.raises(DataError, match="holds aspect-ratio buckets; a latent cache"):
        check_captions(cfg, meta)  # data.cache_latents' check
    with pytest.raises(ConfigError, match="^data.buckets=true with data.latents: a latent cache holds square"):
        compose([*base, "data.buckets=true", "data.latents=/x"])
    # A bucket shape the tiny pipeline's VAE x patch (4) cannot take: multiples of 2 give 14-pixel sides.
    folder = make_shaped_folder(tmp_path / "in", copies=1, broken=True)
    odd, _ = build_caption_shards(
        tmp_path / "odd", input=folder, image_size=16, train_shards=1, val_shards=1, buckets=("3:4", "1:1"),
        bucket_multiple=2,
    )  # fmt: skip
    odd["train_urls"] = []
    with pytest.raises(ConfigError, match=r"^data.buckets: data.root=.*'s bucket 14x18 must be a multiple of 4 "):
        check_captions(compose([*base, "data.buckets=true", "trainer.micro_batch_size=1"]), odd, dp=1)
    # data.max_bad_samples: that build skipped one image.
    with pytest.raises(DataError, match=r"^data.root=.*: skipped 1 file\(s\): 1 undecodable \(broken.png\) when it"):
        check_captions(compose([*base, "data.max_bad_samples=0"]), odd | {"buckets": None}, dp=1)
    assert check_captions(compose([*base, "data.max_bad_samples=1"]), odd | {"buckets": None}, dp=1)
    with pytest.raises(ConfigError, match="data.max_bad_samples=-1 must be >= 0"):
        compose([*base, "data.max_bad_samples=-1"])
    # The builder: --max-bad-samples stops it with one line, nothing written; --bucket-multiple must divide the size.
    capsys.readouterr()
    args = ["--input", str(folder), "--image-size", "16", "--train-shards", "1", "--val-shards", "1"]
    assert prepare([*args, "--out", str(tmp_path / "strict"), "--max-bad-samples", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: skipped 1 file(s): 1 undecodable (broken.png), more than --max-bad-samples=0: fix or remove them, "
        "or raise it"
    )
    assert not (tmp_path / "strict").exists()
    assert prepare([*args, "--out", str(tmp_path / "m"), "--buckets", "--bucket-multiple", "5"]) == 2
    assert (
        capsys.readouterr().err.strip().startswith("error: --image-size 16 must be a multiple of --bucket-multiple 5")
    )
    # Through the launcher: one kiln: error: line, exit 2, nothing written.
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        main([*base, "data.buckets=true", "data.latents=/x", f"run.dir={run_dir}"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and not run_dir.exists()
    assert err.startswith("kiln: error: data.buckets=true with data.latents")


def test_a_short_run_on_bucketed_shards(bucketed, t2i_world, trained):
    from tests.conftest import losses
    from tests.fixtures.t2i import t2i_run_args

    keep = [a for a in t2i_run_args(t2i_world) if not a.startswith(("trainer.max_steps=", "trainer.micro_batch_size=",
            "data.root=", "diffusion.sample_steps="))]  # fmt: skip
    args = [*keep, f"data.root={bucketed}", "data.buckets=true", "trainer.max_steps=2", "trainer.micro_batch_size=4",
            "diffusion.sample_steps=2", "trainer.eval=false"]  # fmt: skip
    run = trained(args, nproc=1)
    loss = losses(run)
    assert sorted(loss) == [1, 2] and all(math.isfinite(v) for v in loss.values()), loss
    assert (run / "samples" / "final.png").exists() and (run / "export" / "transformer").is_dir()  # sampled square
