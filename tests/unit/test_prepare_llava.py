"""data.prepare_llava: LLaVA JSON + images -> shards; broken samples skipped and counted by reason, text-only
and multi-turn kept, the image bytes as they were, unusable input one `kiln: error:` line (exit 2)."""

from __future__ import annotations

import json

import pytest

from common.data.dataset import load_dataset_meta
from common.data.webdataset import iter_samples
from data import prepare_llava as pl
from tests.fixtures import vlm as fx

SMALL = ["--train-shards", "2", "--val-shards", "1", "--workers", "2"]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return fx.write_llava_data(tmp_path_factory.mktemp("llava"), n_pretrain=24, n_instruct=40)


@pytest.fixture(scope="module")
def built(llava, tmp_path_factory):
    out = tmp_path_factory.mktemp("built") / "instruct"
    assert (
        pl.main(
            ["--json", str(llava / "llava_instruct.json"), "--images", str(llava / "images"), "--out", str(out), *SMALL]
        )
        == 0
    )
    return out


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = pl.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_broken_samples_are_skipped_and_counted(built):
    meta = json.loads((built / "meta.json").read_text())
    assert meta["format"] == pl.FORMAT
    assert meta["skipped"] == fx.BROKEN and meta["total"] == 40 + sum(fx.BROKEN.values()) and meta["usable"] == 40
    assert meta["text_only"] == 8  # every fifth instruct sample
    assert set(meta["skipped_examples"]) == set(fx.BROKEN)
    assert meta["splits"]["train"]["samples"] + meta["splits"]["val"]["samples"] == 40


def test_shards_hold_the_conversations_and_the_image_bytes(built, llava):
    meta = load_dataset_meta(built)
    source = {r["id"]: r for r in json.loads((llava / "llava_instruct.json").read_text())}
    samples = list(iter_samples(meta["train_urls"] + meta["val_urls"]))
    assert len(samples) == 40 and len({s["__key__"] for s in samples}) == 40
    roles = {"human": "user", "gpt": "assistant"}
    for s in samples:
        record = json.loads(s["json"])
        want = source[record["id"]]
        assert record["messages"] == [{"role": roles[t["from"]], "content": t["value"]} for t in want["conversations"]]
        if "image" in want:
            assert record["num_images"] == 1 and s["image0"] == (llava / "images" / want["image"]).read_bytes()
        else:
            assert record["num_images"] == 0 and not any(k.startswith("image") for k in s)


def test_rebuild_is_a_noop_and_other_input_is_refused(built, llava, capsys):
    args = ["--json", llava / "llava_instruct.json", "--images", llava / "images", "--out", built, *SMALL]
    rc, out, _ = run(capsys, *args)
    assert rc == 0 and "nothing to do" in out
    rc, _, err = run(
        capsys, "--json", llava / "llava_pretrain.json", "--images", llava / "images", "--out", built, *SMALL
    )
    assert rc == 1 and err.startswith("kiln: error:") and "--force" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "content,message",
    [
        ("not json {", "not readable as JSON"),
        ('{"id": "x"}', "a list of LLaVA samples is expected"),
        ("[]", "none of its 0 samples is usable (the list is empty)"),
    ],
)
def test_unusable_json_is_one_line(tmp_path, llava, capsys, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    rc, _, err = run(capsys, "--json", bad, "--images", llava / "images", "--out", tmp_path / "out", *SMALL)
    assert rc == 2 and err.startswith("kiln: error:") and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_all_bad_is_one_line_with_the_counts(tmp_path, llava, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(fx.broken_records("x")))
    rc, _, err = run(capsys, "--json", bad, "--images", llava / "images", "--out", tmp_path / "out", *SMALL)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert (
        "none of its 6 samples is usable (missing image 2, undecodable image 1, <image> count mismatch 2, malformed 1)"
        in err
    )
    rc, _, err = run(capsys, "--json", bad, "--images", tmp_path / "nope", "--out", tmp_path / "out", *SMALL)
    assert rc == 2 and "--images" in err and "no such folder" in err


def test_record_rules():
    turn = lambda f, v: {"from": f, "value": v}  # noqa: E731
    messages, images, video = pl.to_messages(
        {
            "image": ["a.png", "b.png"],
            "conversations": [
                turn("system", "Be brief."),
                turn("human", "<image>\nFirst.\n<image>"),
                turn("gpt", "Two digits."),
            ],
        }
    )
    assert images == ["a.png", "b.png"] and [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert video is None
    ask = [turn("human", "<image> then <video>"), turn("gpt", "Two.")]
    _, images, video = pl.to_messages(
        {"images": ["a.png"], "video": ["f0.png", "f1.png"], "video_fps": 4, "conversations": ask}
    )
    assert images == ["a.png"] and video == {"frames": ["f0.png", "f1.png"], "fps": 4}
    no_video = [turn("human", "<video>"), turn("gpt", "Hi")]
    for record, reason in [
        ({"conversations": [turn("gpt", "Hi"), turn("human", "Hi")]}, "malformed"),
        ({"conversations": [turn("human", "Hi"), turn("human", "Hi"), turn("gpt", "Hi")]}, "malformed"),
        ({"conversations": [turn("human", "Hi"), turn("gpt", "  ")]}, "malformed"),
        ({"conversations": [turn("robot", "Hi")]}, "malformed"),
        ({"image": "a.png", "conversations": [turn("human", "Hi"), turn("gpt", "<image>")]}, "<image> count mismatch"),
        ({"conversations": [turn("human", "<image>"), turn("gpt", "Hi")]}, "<image> count mismatch"),
        ({"conversations": no_video}, "<video> count mismatch"),
        (
            {"video": "a.mp4", "conversations": [turn("human", "<video><video>"), turn("gpt", "Hi")]},
            "<video> count mismatch",
        ),
        ({"video": "a.mp4", "conversations": [turn("human", "Hi"), turn("gpt", "<video>")]}, "<video> count mismatch"),
        ({"video": "a.mp4", "video_fps": 2, "conversations": no_video}, "malformed"),  # a file has its own rate
        ({"video": ["f.png"], "video_fps": 0, "conversations": no_video}, "malformed"),
        ({"video": [], "conversations": no_video}, "malformed"),
        ({"image": "a.png", "images": ["a.png"], "conversations": ask}, "malformed"),
    ]:
        with pytest.raises(pl.Rejected) as exc:
            pl.to_messages(record)
        assert exc.value.reason == reason, record


def test_videos_are_shards_and_bad_ones_counted_skips(tmp_path):
    """`video:` as a file (MP4) or as frame files with their rate, beside `images: [...]`: the shards hold the bytes
    as they are and the record says which; a missing or undecodable video (a corrupt file, frames of different
    sizes) and a `<video>` that is not there are counted skips, the first of each named in the summary."""
    raw = fx.write_llava_data(tmp_path / "raw", n_pretrain=2, n_instruct=4)
    good = fx.add_video_records(raw, "llava_instruct.json", 4)
    meta, built = pl.build_llava(
        tmp_path / "out", json_path=raw / "llava_instruct.json", images=raw / "images", train_shards=1, val_shards=1
    )
    assert built and meta["videos"] == 4 and meta["usable"] == 8
    assert meta["skipped"] == fx.BROKEN | fx.BROKEN_VIDEOS
    assert meta["skipped_examples"]["undecodable video"].startswith("video-corrupt: ")
    meta = load_dataset_meta(tmp_path / "out")
    samples = {json.loads(s["json"])["id"]: s for s in iter_samples(meta["train_urls"] + meta["val_urls"])}
    clip, shots = samples["video-0"], samples["video-1"]
    assert json.loads(clip["json"])["video"] == {"container": "mp4"}
    assert clip["video"] == (raw / "images" / good[0]["video"]).read_bytes()
    record = json.loads(shots["json"])
    assert record["video"] == {"frames": 6, "fps": 4} and record["num_images"] == 1  # and `images: [...]`
    assert [shots[f"frame{i}"] for i in range(6)] == [(raw / "images" / p).read_bytes() for p in good[1]["video"]]
    assert shots["image0"] == (raw / "images" / good[1]["images"][0]).read_bytes()
    assert "4 with a video" in pl.summary(tmp_path / "out", meta)


def test_a_small_set_takes_fewer_train_shards_by_default(tmp_path, llava, capsys):
    """40 usable samples: 2 held out, a shard per training sample (the default 64 would not fill); a rebuild is a
    no-op, and an explicit --train-shards that cannot be filled is still refused in one line."""
    source = ["--json", llava / "llava_instruct.json", "--images", llava / "images", "--workers", "2"]
    rc, out, err = run(capsys, *source, "--out", tmp_path / "out")
    assert rc == 0, err
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["splits"]["train"]["samples"] == 38 and len(meta["splits"]["train"]["shards"]) == 38
    assert "train 38 samples in 38 shards" in out
    rc, out, _ = run(capsys, *source, "--out", tmp_path / "out")
    assert rc == 0 and "nothing to do" in out
    rc, _, err = run(capsys, *source, "--out", tmp_path / "other", "--train-shards", "64")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "40 usable samples cannot fill 64 train + 2 val shards; lower --train-shards" in err
