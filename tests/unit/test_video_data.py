"""Video-caption data (data/prepare_videos.py, common/data/video.py) and the moving digits
(common/data/moving_digits.py): what a build counts, skips and splits; the stored frames bit for bit against the clip
decoded apart from the builder; sampling at a frame rate against the frames chosen by hand; the buckets; the metadata
layouts; one-line errors; the moving digits' captions, parser and direction tracker against the generator's labels."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from common.data.digit_captions import DIGIT_WORDS
from common.data.moving_digits import (
    CAPTION_TEMPLATES,
    DIRECTIONS,
    HELD_OUT_TEMPLATES,
    caption_motion,
    held_out_prompts,
    motion_caption,
    moving_digit_clips,
    track_direction,
)
from common.data.video import (
    ClipTooShort,
    decode_frames,
    decode_video_sample,
    encode_frames,
    pick_nearest,
    read_clip,
    sample_times,
)
from data import prepare_videos
from data.tiny_bases import make_clip_folder

N = 24  # make_clip_folder's moving-digit clips: every 4th from the 2nd 3:2 landscape, every 4th from the 3rd at 32 fps
FLAGS = ["--num-frames", "9", "--height", "32", "--width", "32", "--train-shards", "2", "--val-shards", "1"]


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    return make_clip_folder(tmp_path_factory.mktemp("video") / "clips", n=N)


def pyav_frames(source) -> np.ndarray:
    """Every frame of a video file or bytes, decoded here with PyAV (apart from common/data/video.py)."""
    with av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def samples(out: Path) -> list[dict]:
    """Every sample of a build's shards, read with tarfile: {key: {extension: bytes}}."""
    found: dict[str, dict] = {}
    for tar in sorted(out.glob("*.tar")):
        with tarfile.open(tar) as t:
            for member in t.getmembers():
                key, ext = member.name.split(".", 1)
                found.setdefault(key, {"__key__": key})[ext] = t.extractfile(member).read()
    return list(found.values())


@pytest.fixture(scope="module")
def built(clips, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("built") / "clips"
    assert prepare_videos.main(["--input", str(clips), "--out", str(out), *FLAGS, "--val-fraction", "0.25"]) == 0
    return out


def test_build_counts_skips_and_splits(built):
    meta = json.loads((built / "meta.json").read_text())
    assert (
        meta["source"] == "video_captions" and meta["clip_files"] == N + 4
    )  # + frame folder, broken, uncaptioned, short
    assert meta["skipped"] == {
        "undecodable": ["broken.mp4"],
        "no_caption": ["uncaptioned.mp4"],
        "empty_caption": [],
        "too_short": ["short.mp4"],
    }
    rows = N + 3  # captioned: the clips, the frame folder, broken.mp4 and short.mp4 (counted while writing)
    splits = meta["splits"]
    assert splits["train"]["samples"] + splits["val"]["samples"] == rows - 2 == N + 1
    assert round(rows * 0.25) - 2 <= splits["val"]["samples"] <= round(rows * 0.25)  # 7 rows, less those skipped
    assert splits["train"]["shard_samples"] in ([10, 9], [9, 10]) and len(splits["val"]["shards"]) == 1
    assert (meta["num_frames"], meta["fps"], meta["height"], meta["width"]) == (9, 16.0, 32, 32)
    info = [json.loads(s["json"]) for s in samples(built)]
    assert len(info) == N + 1 and {i["num_frames"] for i in info} == {9}
    assert {i["source"] for i in info} == {f"{'more/' if i >= N // 2 else ''}clip_{i:03d}.mp4" for i in range(N)} | {
        "frames_0"
    }


def test_stored_frames_are_the_sampled_frames_bit_for_bit(built, clips):
    for sample in samples(built):
        source = json.loads(sample["json"])["source"]
        stored = pyav_frames(sample["mkv"])
        assert stored.shape == (9, 32, 32, 3)
        assert np.array_equal(stored, read_clip(clips / source, 9, 16, (32, 32))), source
        assert np.array_equal(decode_frames(sample["mkv"]), stored)
        video = decode_video_sample(sample)["video"]
        assert video.shape == (3, 9, 32, 32) and float(video.min()) >= -1 and float(video.max()) <= 1
        assert decode_video_sample(sample)["caption"] == (clips / source).with_suffix(".txt").read_text()
    # The sampling at 16 fps, against the frames chosen by hand: a 16 fps clip whole, a 32 fps one every other frame
    # (its 17 frames), the frame folder (32 fps by its fps.txt) every other PNG, a landscape clip center-cropped.
    assert np.array_equal(read_clip(clips / "clip_000.mp4", 9, 16, (32, 32)), pyav_frames(clips / "clip_000.mp4"))
    assert np.array_equal(read_clip(clips / "clip_002.mp4", 9, 16, (32, 32)), pyav_frames(clips / "clip_002.mp4")[::2])
    pngs = np.stack([np.asarray(Image.open(p)) for p in sorted((clips / "frames_0").glob("*.png"))])
    assert len(pngs) == 17 and np.array_equal(read_clip(clips / "frames_0", 9, 16, (32, 32)), pngs[::2])
    wide = pyav_frames(clips / "clip_001.mp4")
    assert wide.shape[1:3] == (32, 48) and np.array_equal(
        read_clip(clips / "clip_001.mp4", 9, 16, (32, 32)), wide[:, :, 8:40]
    )


def test_each_frame_is_the_source_frame_nearest_its_time():
    wanted = sample_times(9, 16)
    for rate in (12.5, 21.6, 29.97, 60.0):  # no two source frames equally near a wanted time
        times = [k / rate for k in range(int(wanted[-1] * rate) + 2)]
        nearest = [int(np.argmin([abs(t - w) for t in times])) for w in wanted]  # brute force
        assert pick_nearest(((t, k) for k, t in enumerate(times)), wanted, 1 / rate) == nearest, rate
    assert pick_nearest(((k / 16, k) for k in range(9)), wanted, 1 / 16) == list(range(9))
    with pytest.raises(ClipTooShort):  # 8 frames at 16 fps end at 0.4375 s; the 9th is wanted at 0.5 s
        pick_nearest(((k / 16, k) for k in range(8)), wanted, 1 / 16)


def test_ffv1_round_trip_is_bit_exact_and_deterministic():
    frames = np.random.default_rng(0).integers(0, 256, (5, 17, 23, 3), dtype=np.uint8)  # odd sides, noise
    data = encode_frames(frames)
    assert np.array_equal(pyav_frames(data), frames) and np.array_equal(decode_frames(data), frames)
    assert encode_frames(frames) == data
    with pytest.raises(ValueError, match="uint8"):
        encode_frames(frames.astype(np.float32))


def test_buckets(clips, tmp_path):
    out = tmp_path / "buckets"
    assert (
        prepare_videos.main(["--input", str(clips), "--out", str(out), *FLAGS, "--val-fraction", "0.25", "--buckets"])
        == 0
    )
    meta = json.loads((out / "meta.json").read_text())
    # about 32x32 pixels, sides multiples of 16, 9:16 .. 16:9: only three distinct shapes at this size
    assert meta["buckets"]["shapes"] == [[32, 48], [32, 32], [48, 32]]
    for split in ("train", "val"):
        assert sum(meta["buckets"]["samples"][split].values()) == meta["splits"][split]["samples"]
    for sample in samples(out):
        source = json.loads(sample["json"])["source"]
        wide = source.endswith(".mp4") and int(source[-7:-4]) % 4 == 1  # make_clip_folder's 48x32 clips
        assert sample["bucket"].decode() == ("48x32" if wide else "32x32"), source
        assert pyav_frames(sample["mkv"]).shape == ((9, 32, 48, 3) if wide else (9, 32, 32, 3))


@pytest.mark.parametrize("layout", ["jsonl", "csv"])
def test_metadata_layouts(tmp_path, layout):
    root = make_clip_folder(tmp_path / "clips", n=4, metadata=layout, bad=False)
    (root / "clip_000.txt").write_text("a caption the metadata overrides")
    out = tmp_path / "out"
    assert prepare_videos.main(["--input", str(root), "--out", str(out), *FLAGS, "--val-fraction", "0.3"]) == 0
    if layout == "jsonl":
        rows = [json.loads(line) for line in (root / "metadata.jsonl").read_text().splitlines()]
    else:
        lines = (root / "metadata.csv").read_text().splitlines()[1:]
        rows = [dict(zip(("file_name", "text"), line.split(",", 1))) for line in lines]
    expected = {r["file_name"]: r["text"] for r in rows}
    got = {json.loads(s["json"])["source"]: s["txt"].decode() for s in samples(out)}
    assert got == expected and len(got) == 5


def one_line_error(argv, capsys) -> str:
    assert prepare_videos.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_bad_input_stops_with_one_line_and_writes_nothing(clips, tmp_path, capsys):
    out = tmp_path / "out"
    jsonl = make_clip_folder(tmp_path / "jsonl", n=2, metadata="jsonl", bad=False)
    with open(jsonl / "metadata.jsonl", "a") as f:
        f.write('{"file_name": "clip_000.mp4"}\n')
    assert "metadata.jsonl:4:" in one_line_error(["--input", str(jsonl), "--out", str(out), *FLAGS], capsys)
    csv = make_clip_folder(tmp_path / "csv", n=2, metadata="csv", bad=False)
    with open(csv / "metadata.csv", "a") as f:
        f.write("clip_000.mp4,a caption,an extra field\n")
    assert "metadata.csv:5:" in one_line_error(["--input", str(csv), "--out", str(out), *FLAGS], capsys)
    assert "not 4k+1" in one_line_error(
        ["--input", str(clips), "--out", str(out), *FLAGS[2:], "--num-frames", "8"], capsys
    )
    (tmp_path / "empty").mkdir()
    assert "no clip" in one_line_error(["--input", str(tmp_path / "empty"), "--out", str(out), *FLAGS], capsys)
    limit = ["--max-bad-samples", "2", "--val-fraction", "0.25"]
    assert "more than --max-bad-samples=2" in one_line_error(
        ["--input", str(clips), "--out", str(out), *FLAGS, *limit], capsys
    )
    assert not out.exists()


def test_track_direction_reads_the_generated_motion():
    for n, shape, seed in ((200, (9, 32, 32), 0), (40, (17, 48, 80), 1), (40, (5, 40, 24), 2)):
        frames, captions, digits, directions = moving_digit_clips(n, *shape, seed=seed)
        assert frames.shape == (n, *shape, 3) and sorted(set(directions)) == sorted(DIRECTIONS)
        assert [track_direction(clip) for clip in frames] == directions
        assert [track_direction(clip[::-1]) for clip in frames] == [  # played backwards: the opposite way
            {"left": "right", "right": "left", "up": "down", "down": "up"}[d] for d in directions
        ]
        assert [caption_motion(c) for c in captions] == list(zip(digits, directions))
    assert track_direction(np.repeat(frames[:1, :1], 5, axis=1)[0]) is None  # a still frame does not move
    again = moving_digit_clips(40, 5, 40, 24, seed=2)  # the last case again: seeded
    assert np.array_equal(again[0], frames) and again[1] == captions


def test_held_out_phrasings_are_no_training_caption_and_every_phrasing_parses():
    def every(templates):
        return {
            motion_caption(d, way, i, templates): (d, way)
            for d in range(len(DIGIT_WORDS))
            for way in DIRECTIONS
            for i in range(len(templates))
        }

    training, held_out = every(CAPTION_TEMPLATES), every(HELD_OUT_TEMPLATES)
    assert len(training) == 40 * len(CAPTION_TEMPLATES) and len(held_out) == 40 * len(HELD_OUT_TEMPLATES)
    assert not set(training) & set(held_out)
    assert all(caption_motion(c) == pair for c, pair in {**training, **held_out}.items())
    assert caption_motion("a cat moving left") is None and caption_motion("the digit 7 moving sideways") is None
    prompts, digits, directions = held_out_prompts(2)
    assert len(prompts) == 80 and set(prompts) <= set(held_out)
    assert [caption_motion(p) for p in prompts] == list(zip(digits, directions))


def test_moving_digits_build_is_seeded(tmp_path, capsys):
    def build(name, seed):
        out = tmp_path / name
        argv = ["--moving-digits", "--clips", "40", "--out", str(out), *FLAGS, "--seed", str(seed)]
        assert prepare_videos.main(argv) == 0
        return out

    first, again, other = build("a", 0), build("b", 0), build("c", 1)
    rebuild = ["--moving-digits", "--clips", "40", "--out", str(first), *FLAGS]
    assert prepare_videos.main(rebuild) == 0 and "nothing to do" in capsys.readouterr().out
    assert prepare_videos.main([*rebuild, "--seed", "1"]) == 1 and "seed=0 (wanted 1)" in capsys.readouterr().err
    tars = sorted(p.name for p in first.glob("*.tar"))
    assert tars == sorted(p.name for p in again.glob("*.tar")) and len(tars) == 3
    assert all((first / t).read_bytes() == (again / t).read_bytes() for t in tars)
    assert any((first / t).read_bytes() != (other / t).read_bytes() for t in tars)
    meta = json.loads((first / "meta.json").read_text())
    assert (
        meta["input"] == "moving_digits" and meta["splits"]["train"]["samples"] + meta["splits"]["val"]["samples"] == 40
    )
    for sample in samples(first):  # what a clip shows is what its caption says
        _, direction = caption_motion(sample["txt"].decode())
        assert track_direction(pyav_frames(sample["mkv"])) == direction
