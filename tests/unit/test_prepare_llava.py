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
    messages, images = pl.to_messages(
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
    for record, reason in [
        ({"conversations": [turn("gpt", "Hi"), turn("human", "Hi")]}, "malformed"),
        ({"conversations": [turn("human", "Hi"), turn("human", "Hi"), turn("gpt", "Hi")]}, "malformed"),
        ({"conversations": [turn("human", "Hi"), turn("gpt", "  ")]}, "malformed"),
        ({"conversations": [turn("robot", "Hi")]}, "malformed"),
        ({"image": "a.png", "conversations": [turn("human", "Hi"), turn("gpt", "<image>")]}, "<image> count mismatch"),
        ({"conversations": [turn("human", "<image>"), turn("gpt", "Hi")]}, "<image> count mismatch"),
    ]:
        with pytest.raises(pl.Rejected) as exc:
            pl.to_messages(record)
        assert exc.value.reason == reason, record
