"""Qwen2.5-VL and Qwen3-VL at native resolution, packed: tiny random release folders (data/tiny_bases.py's
make_qwen2_5_vl / make_qwen3_vl, transformers' own classes), images of several sizes and aspect ratios, videos
(Qwen3-VL's with a timestamp text per temporal patch), and a packed row of samples with 0, 1 and 2 images, a video,
an image and a video, against transformers' own forward on each sample alone."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from common.data.packing import IGNORE_INDEX
from common.errors import ConfigError
from data.tiny_bases import make_qwen2_5_vl, make_qwen3_vl
from recipes.vlm.archs import QWEN2_VIDEO, QWEN3_VIDEO, QWEN_ARCHS
from recipes.vlm.parallelize import freeze_for_stage
from recipes.vlm.qwen import (
    IMAGE_PAD,
    VIDEO_PAD,
    ImageTokensExceed,
    blank_qwen_sample,
    collate_qwen,
    encode_llava_qwen,
    encode_qwen,
    image_pad_repeats,
    load_processing,
    modality_types,
    pack_qwen,
    rope_index_for,
)
from recipes.vlm.video import frame_size, frames_video, read_video_config, sample_frame_indices, video_config
from tests.fixtures.vlm import frames, image, video_conversation

# Qwen2VLVideoProcessor's own values (a folder whose config says nothing; its rate: qwen-vl-utils' 2 fps)
QWEN2 = video_config({}, QWEN2_VIDEO)

# (height, width): one above max_pixels (shrunk), one near min_pixels, a wide one spanning several
# 112-px attention windows of the tower (its windowed blocks), a tall one.
SIZES = [(300, 200), (56, 84), (140, 224), (112, 56)]


def load_release(folder):
    """A release folder as transformers loads it: its model (fp32, eval), tokenizer and image processor; and its
    video processor's values (`video`: recipes/vlm/video.py, as the training run reads them)."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return types.SimpleNamespace(
        folder=folder,
        model=model,
        tokenizer=tokenizer,
        image_processor=AutoImageProcessor.from_pretrained(folder),
        video=read_video_config(folder, QWEN_ARCHS[model.config.model_type].video),
        image_pad=tokenizer.convert_tokens_to_ids(IMAGE_PAD),
        video_pad=tokenizer.convert_tokens_to_ids(VIDEO_PAD),
    )


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return load_release(make_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl")))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Qwen3-VL: 16-px patches (32-px image tokens), DeepStack (the tower's blocks 0 and 1 feed the first two of
    three language layers at the image tokens), interleaved mRoPE on a Qwen3 language model."""
    return load_release(make_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl")))


ARCHS = {"qwen2_5_vl": "qwen", "qwen3_vl": "qwen3"}  # model_type -> its fixture


def conversation(n_images: int) -> list[dict]:
    if n_images == 0:
        return [{"role": "user", "content": "What is two plus three?"}, {"role": "assistant", "content": "Five."}]
    ask = "<image>\nDescribe the image." if n_images == 1 else "<image>\nCompare the two pictures.\n<image>"
    return [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": "A handwritten digit."},
        {"role": "user", "content": "What digit is this?"},
        {"role": "assistant", "content": "Five."},
    ]


def test_image_tokens_follow_the_processor_rule(qwen):
    """Each image's tokens are the Qwen2.5-VL processor's own replacement for its pad (Qwen2_5_VLProcessor's
    replace_image_token, which the processor applies itself; the processor object cannot be built without
    torchvision), and that is the image processor's patch count for the raw size over merge^2: native resolution,
    so the count varies with size and aspect ratio."""
    from transformers import Qwen2_5_VLProcessor

    images = [image(h, w, i) for i, (h, w) in enumerate(SIZES)]
    messages = [
        {"role": "user", "content": "Compare <image> and <image>.\n<image><image>"},
        {"role": "assistant", "content": "Five."},
    ]
    enc = encode_qwen(messages, images, qwen.tokenizer, qwen.image_processor)
    ip = qwen.image_processor
    rule = types.SimpleNamespace(image_processor=ip, image_token=IMAGE_PAD)
    expected = [
        Qwen2_5_VLProcessor.replace_image_token(rule, {"image_grid_thw": enc["image_grid_thw"]}, i).count(IMAGE_PAD)
        for i in range(len(images))
    ]
    assert expected == [ip.get_number_of_image_patches(h, w) // ip.merge_size**2 for h, w in SIZES]
    assert len(set(expected)) == len(SIZES)  # a different count for every image
    assert (28 * 28 * expected[0] <= ip.size["longest_edge"]) and expected[0] < (300 * 200) // (28 * 28)  # shrunk
    # In the sequence: each image is one run of pads of its count, between <|vision_start|> and <|vision_end|>.
    ids = enc["input_ids"]
    is_pad = (ids == qwen.image_pad).int()
    starts = torch.nonzero(torch.diff(is_pad, prepend=torch.zeros(1, dtype=torch.int32)) == 1).flatten()
    ends = torch.nonzero(torch.diff(is_pad, append=torch.zeros(1, dtype=torch.int32)) == -1).flatten() + 1
    vision_start, vision_end = qwen.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    assert (ends - starts).tolist() == expected
    assert ids[starts - 1].eq(vision_start).all() and ids[ends].eq(vision_end).all()
    assert enc["pixel_values"].shape == (sum(expected) * ip.merge_size**2, 3 * 2 * 14 * 14)
    # Labels: the assistant's answer and its <|im_end|>, nothing of the prompt or the images.
    answer = qwen.tokenizer("Five.<|im_end|>", add_special_tokens=False)["input_ids"]
    assert enc["labels"][enc["labels"] != IGNORE_INDEX].tolist() == answer


def test_placeholder_mismatch_and_image_budget_are_one_line(qwen):
    images = [image(56, 84, 0), image(140, 224, 1)]
    with pytest.raises(ValueError, match=r"^the conversation has 1 image placeholder\(s\) but 2 image\(s\)"):
        encode_qwen(conversation(1), images, qwen.tokenizer, qwen.image_processor)
    with pytest.raises(ImageTokensExceed, match=r"^its 2 image\(s\) take 46 tokens, more than data.max_seq_len 40$"):
        encode_qwen(conversation(2), images, qwen.tokenizer, qwen.image_processor, max_seq_len=40)
    # Over the length but the images fit: cut before the image the cut would split, never inside it.
    full = encode_qwen(conversation(2), images, qwen.tokenizer, qwen.image_processor)
    second = int(torch.nonzero(full["input_ids"] == qwen.image_pad).flatten()[6])  # first token of the 40-token image
    assert second + 30 >= 46  # the images alone fit; the cut falls inside the second
    enc = encode_qwen(conversation(2), images, qwen.tokenizer, qwen.image_processor, max_seq_len=second + 30)
    assert enc["truncated"] and torch.equal(enc["input_ids"], full["input_ids"][:second])
    assert enc["image_grid_thw"].tolist() == full["image_grid_thw"][:1].tolist()
    assert torch.equal(enc["pixel_values"], full["pixel_values"][:24])


def alone_outputs(qwen):
    """Samples and transformers' own forward on each alone (its own mRoPE positions from the grids and
    second_per_grid_ts): its logits and its loss summed over its labels (num_items_in_batch=1, as the trainer asks).
    Three with 0, 1 and 2 images of different sizes, and two with videos: a video of 25 frames at 10 fps, sampled
    at 2 fps (Qwen2.5-VL: to 4 frames; Qwen3-VL: to 5, each temporal patch after its timestamp text), and an image
    and a video of 5 frames, an odd count the patching pads."""
    tok, ip = qwen.tokenizer, qwen.image_processor
    rule, video = qwen.video.rule, qwen.video
    samples = [
        encode_qwen(conversation(n), ims, tok, ip)
        for n, ims in ((0, []), (1, [image(300, 200, 0)]), (2, [image(56, 84, 1), image(140, 224, 2)]))
    ]
    sampled = frames_video(list(frames(25, 56, 84, 3)), video, source_fps=10.0)
    as_given = frames_video(list(frames(5, 84, 56, 4)), video)
    samples += [
        encode_qwen(video_conversation(), [], tok, ip, videos=[sampled], video_config=video),
        encode_qwen(video_conversation(1), [image(112, 56, 5)], tok, ip, videos=[as_given], video_config=video),
    ]
    if rule.timestamps:  # 5 frames -> 3 temporal patches (the last padded) at 64 x 96 px; 84 x 56 -> 96 x 64
        assert [s["video_grid_thw"].tolist() for s in samples[3:]] == [[[3, 4, 6]], [[3, 6, 4]]]
    else:
        assert [s["video_grid_thw"].tolist() for s in samples[3:]] == [[[2, 4, 6]], [[3, 6, 4]]]
        # 2 / (4 of 25 x 10 fps), 2 / 2
        assert [s["second_per_grid_ts"].tolist() for s in samples[3:]] == [[1.25], [1.0]]
    outputs = []
    with torch.no_grad():
        for s in samples:
            ids = s["input_ids"][None]
            vision = {}
            if len(s["image_grid_thw"]):
                vision |= {"pixel_values": s["pixel_values"], "image_grid_thw": s["image_grid_thw"]}
            if len(s["video_grid_thw"]):
                vision |= {k: s[k] for k in ("pixel_values_videos", "video_grid_thw")}
                if not rule.timestamps:  # Qwen2.5-VL's time positions (Qwen3-VL's model takes no such input)
                    vision["second_per_grid_ts"] = s["second_per_grid_ts"]
            outputs.append(
                qwen.model(
                    input_ids=ids,
                    mm_token_type_ids=modality_types(ids, qwen.image_pad, qwen.video_pad),
                    labels=s["labels"][None],
                    num_items_in_batch=1,
                    **vision,
                )
            )
    return samples, outputs


@pytest.fixture(scope="module")
def alone():
    """alone_outputs per architecture, computed once for its rows' cases."""
    cache = {}

    def outputs(arch: str, qwen):
        if arch not in cache:
            cache[arch] = alone_outputs(qwen)
        return cache[arch]

    return outputs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rows", [1, 2])
def test_packed_rows_match_each_sample_alone(request, alone, arch, rows):
    """The samples packed into one row (or two, images and videos in both): the tower takes all the images as one
    patch sequence and all the videos as another (the model's pixel_values_videos), the language model the rows with
    the block-diagonal mask and each sample's own mRoPE positions (a video's spaced by its second_per_grid_ts;
    Qwen3-VL: interleaved, each temporal patch after its timestamp text, its DeepStack features added at the rows'
    image and video tokens in the same order). Every sample's
    logits equal transformers' own forward on it alone (fp32, SDPA: max |diff| is printed; <= 2.4e-7 for both
    architectures when measured), and the packed loss (summed) the sum of the samples' own losses."""
    qwen = request.getfixturevalue(ARCHS[arch])
    assert qwen.model.config.model_type == arch
    samples, outputs = alone(arch, qwen)
    # the samples' lengths, and the row length that packs them into two rows with images and videos in both:
    # Qwen2.5-VL [109, 82] and [105, 56, 32] tokens; Qwen3-VL (its video texts, 32-px units) [98, 98], [82, 78, 21]
    lengths, two_rows = {"qwen2_5_vl": ([32, 56, 82, 105, 109], 200), "qwen3_vl": ([21, 78, 82, 98, 98], 196)}[arch]
    assert sorted(len(s["input_ids"]) for s in samples) == lengths
    batch = pack_qwen(
        samples,
        rope_index_for(qwen.model.config),  # as the loader workers run it: transformers' get_rope_index, no weights
        max_seq_len=512 if rows == 1 else two_rows,
        pad_id=qwen.tokenizer.pad_token_id,
        image_pad_id=qwen.image_pad,
        video_pad_id=qwen.video_pad,
    )
    assert batch.packed.num_rows == rows
    assert batch.image_grid_thw.shape == (4, 3) and batch.video_grid_thw.shape == (2, 3)
    if rows == 2:  # images and videos in both rows
        for r, lens in enumerate(batch.packed.seq_lens):
            row = batch.packed.input_ids[r]
            assert (row == qwen.image_pad).any() and (row == qwen.video_pad).any(), lens
    with torch.no_grad():
        out = qwen.model(**batch.model_inputs("sdpa"), use_cache=False, num_items_in_batch=1)
        # The flash inputs (one flattened row, positions as [4, 1, R*L] with the text positions first) without
        # their cu_seq_lens: transformers' own packed-sequence mask, built from that text row (no cache), must
        # give the same logits, so the layout is the one transformers reads as packed.
        flat = {k: v for k, v in batch.model_inputs("flash").items() if not k.startswith(("cu_seq", "max_length"))}
        assert flat["position_ids"].shape == (4, 1, batch.packed.input_ids.numel())
        flash_layout = qwen.model(**flat, use_cache=False).logits.reshape(out.logits.shape)
    placed = [(r, start, n) for r, lens in enumerate(batch.packed.seq_lens) for start, n in _starts(lens)]
    diffs = [
        (out.logits[r, start : start + n] - outputs[i].logits[0]).abs().max().item()
        for i, (r, start, n) in zip(batch.packed.order, placed, strict=True)
    ]
    print(f"{arch}, {rows} row(s): max |packed - alone| per sample {diffs}")
    assert max(diffs) < 1e-5
    assert batch.packed.num_labels == sum(int((s["labels"][1:] != IGNORE_INDEX).sum()) for s in samples)
    torch.testing.assert_close(out.loss, sum(o.loss for o in outputs), rtol=1e-6, atol=1e-5)
    assert (flash_layout - out.logits).abs().max().item() < 1e-5
    # mRoPE is live: image tokens' height and width positions differ from the text's running count.
    assert not torch.equal(batch.position_ids[1], batch.position_ids[2])


def test_video_tokens_placeholders_and_cuts(qwen):
    """A video's one `<video>` becomes its (t*h*w) / merge^2 pads between <|vision_start|> and <|vision_end|>, after
    the image's in the order of the text; its patches are [t*h*w, 3*2*14*14]; a placeholder without its video (or a
    video without one) is one line; a cut never splits a video, and image and video tokens alone over the length
    are a counted skip."""
    tok, ip = qwen.tokenizer, qwen.image_processor
    clip = frames_video(list(frames(6, 84, 56, 0)), qwen.video)
    enc = encode_qwen(video_conversation(1), [image(56, 84, 1)], tok, ip, videos=[clip], video_config=qwen.video)
    ids = enc["input_ids"]
    assert enc["video_grid_thw"].tolist() == [[3, 6, 4]] and enc["pixel_values_videos"].shape == (72, 3 * 2 * 14 * 14)
    video_at = torch.nonzero(ids == qwen.video_pad).flatten()
    assert len(video_at) == 3 * 6 * 4 // 4 and (torch.diff(video_at) == 1).all()  # one run of 18 pads
    vision_start, vision_end = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    assert ids[video_at[0] - 1] == vision_start and ids[video_at[-1] + 1] == vision_end
    assert torch.nonzero(ids == qwen.image_pad).flatten().max() < video_at[0]  # the image first, as in the text
    assert (
        enc["labels"][enc["labels"] != IGNORE_INDEX].tolist()
        == tok("A digit is written.<|im_end|>", add_special_tokens=False)["input_ids"]
    )
    with pytest.raises(
        ValueError, match=r"^the conversation has 1 video placeholder\(s\) but 0 video\(s\); each video"
    ):
        encode_qwen(video_conversation(), [], tok, ip)
    with pytest.raises(ValueError, match=r"^the conversation has 0 video placeholder\(s\) but 1 video\(s\)"):
        encode_qwen(conversation(0), [], tok, ip, videos=[clip], video_config=qwen.video)
    # A cut inside the video: the sequence ends before it, the image stays whole, the video is dropped.
    cut = encode_qwen(
        video_conversation(1),
        [image(56, 84, 1)],
        tok,
        ip,
        videos=[clip],
        max_seq_len=int(video_at[5]),
        video_config=qwen.video,
    )
    assert cut["truncated"] and torch.equal(cut["input_ids"], ids[: int(video_at[0])])
    assert cut["image_grid_thw"].tolist() == [[1, 4, 6]] and cut["video_grid_thw"].shape == (0, 3)
    assert cut["pixel_values_videos"].numel() == 0 and cut["second_per_grid_ts"].numel() == 0
    with pytest.raises(ImageTokensExceed, match=r"^its 1 image\(s\) and 1 video\(s\) take 24 tokens, more than"):
        encode_qwen(
            video_conversation(1), [image(56, 84, 1)], tok, ip, videos=[clip], max_seq_len=20, video_config=qwen.video
        )


def test_qwen3_video_timestamps_and_cuts(qwen3):
    """Qwen3-VL: a video's <|vision_start|>..<|vision_end|> holds, per temporal patch, `<t seconds>` (the mean time of
    its two frames, one decimal) and that patch's own <|vision_start|>, (h*w) / merge^2 pads, <|vision_end|>
    (Qwen3VLProcessor.replace_video_token's text, written out here by hand; tests/integration compares the
    processor's ids); the text is unlabelled; a cut inside the video drops all of it, its other patches too."""
    tok, ip, vc = qwen3.tokenizer, qwen3.image_processor, qwen3.video
    clip = frames_video(list(frames(6, 64, 96, 0)), vc)  # at 0, 0.5 .. 2.5 s; kept at 64 x 96
    enc = encode_qwen(video_conversation(1), [image(64, 96, 1)], tok, ip, videos=[clip], video_config=vc)
    ids = enc["input_ids"]
    assert enc["video_grid_thw"].tolist() == [[3, 4, 6]] and enc["pixel_values_videos"].shape == (72, 3 * 2 * 16 * 16)
    patch = "<|vision_start|>" + "<|video_pad|>" * 6 + "<|vision_end|>"  # 4 x 6 patches, 2x2 merged
    video = "<|vision_start|>" + "".join(f"<{t} seconds>{patch}" for t in ("0.2", "1.2", "2.2")) + "<|vision_end|>"
    assert video in tok.decode(ids)
    video_at = torch.nonzero(ids == qwen3.video_pad).flatten()
    assert (enc["labels"][: int(video_at[-1]) + 2] == IGNORE_INDEX).all()  # the user's turn, timestamps included
    cut = encode_qwen(
        video_conversation(1),
        [image(64, 96, 1)],
        tok,
        ip,
        videos=[clip],
        max_seq_len=int(video_at[8]),
        video_config=vc,
    )
    assert cut["truncated"] and torch.equal(cut["input_ids"], ids[: int(video_at[0])])
    assert cut["image_grid_thw"].tolist() == [[1, 4, 6]] and cut["video_grid_thw"].shape == (0, 3)
    assert cut["pixel_values_videos"].numel() == 0


@pytest.mark.parametrize("container", ["mp4", "mkv"])
def test_container_videos_decode_to_the_sampled_frames(container):
    """A video file decodes (PyAV) to the frames Qwen2VLVideoProcessor's sampling keeps at data.video_fps: 25 frames
    at 10 fps (2.5 s) are 5 frames at 2 fps, floored to the temporal patch: 4, frames 0, 6, 12, 18 (6.25 apart),
    sampled at 1.6 fps. An MP4 records its frame count; a Matroska does not (the packets are counted). Lossless
    files: the frames come back bit for bit. A budget of 2 frames keeps 2; bytes that are no video: one line."""
    from recipes.vlm.video import decode_video
    from tests.support.video import encode_video

    source = frames(25, 56, 84, 7)
    data = encode_video(source, 10, container)
    video = decode_video(data, QWEN2)
    assert sample_frame_indices(25, 10.0, QWEN2).tolist() == [0, 6, 12, 18]
    assert np.array_equal(video.frames, source[[0, 6, 12, 18]]) and video.fps == pytest.approx(1.6)
    assert decode_video(data, QWEN2._replace(max_frames=2)).frames.shape[0] == 2
    with pytest.raises(ValueError):  # av's InvalidDataError: the loader counts the sample as corrupt
        decode_video(b"not a video at all", QWEN2)


def test_frame_files_are_a_video_at_the_sampling_rate():
    """Frame files without a rate are a video already sampled at data.video_fps: all kept (an odd count is padded
    when patched), fewer when over data.max_frames; with the rate they were taken at, sampled like a container's;
    frames of different sizes are one line."""
    six = list(frames(6, 56, 56, 0))
    assert frames_video(six[:5], QWEN2).frames.shape[0] == 5 and frames_video(six[:5], QWEN2).fps == 2.0
    assert frames_video(six, QWEN2._replace(max_frames=4)).frames.shape[0] == 4
    taken = frames_video(six, QWEN2, source_fps=4.0)  # 1.5 s at 2 fps: 3 frames, at least 4 -> 4 of 6
    assert np.array_equal(taken.frames, np.stack(six)[[0, 1, 3, 4]]) and taken.fps == pytest.approx(4 * 4 / 6)
    with pytest.raises(ValueError, match=r"^its frames differ in size: \[\(56, 56\), \(84, 56\)\]$"):
        frames_video([*six[:2], frames(1, 84, 56, 1)[0]], QWEN2)


def test_video_values_are_the_folders_video_processor(qwen, qwen3, tmp_path):
    """Videos take the values of the video processor transformers loads from the folder, not the image processor's:
    Qwen3-VL's video_preprocessor_config.json (its own budget over the clip, as released), Qwen2.5-VL's
    preprocessor_config.json where it ships no video config; processor_config.json's nested one before both, and
    Qwen2VLVideoProcessor's min_pixels / max_pixels keys over its size. data.video_fps / data.max_frames replace the
    rate and frame cap (None: the folder's) and the export writes what ran. Reference: Qwen3VLVideoProcessor itself
    (it imports without torchvision; Qwen2VLVideoProcessor does not: tests/integration/test_vlm_qwen_processor.py),
    its class attributes, frame sampling and patch count (with the per-frame cap too)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    assert {k: getattr(Qwen3VLVideoProcessor, k) for k in QWEN3_VIDEO.defaults} == QWEN3_VIDEO.defaults
    reference = Qwen3VLVideoProcessor.from_pretrained(qwen3.folder)
    video, image = qwen3.video, qwen3.image_processor.size
    assert (video.min_pixels, video.max_pixels) == (reference.size.shortest_edge, reference.size.longest_edge)
    assert (video.min_pixels, video.max_pixels) != (image["shortest_edge"], image["longest_edge"])
    assert (video.fps, video.min_frames, video.max_frames) == (reference.fps, reference.min_frames, 768)
    assert (qwen.video.min_pixels, qwen.video.max_pixels, qwen.video.fps) == (28 * 28 * 4, 28 * 28 * 64, 2.0)
    # the run's rate and frame cap, written into the export and read back from it by transformers
    run = load_processing(qwen3.folder, qwen3.model.config.image_token_id, video_fps=1.0, max_frames=4)
    run.save_pretrained(tmp_path / "export")
    exported = Qwen3VLVideoProcessor.from_pretrained(tmp_path / "export")
    assert (exported.fps, exported.max_frames, exported.cap_pixels_per_frame) == (1.0, 4, False)
    assert read_video_config(tmp_path / "export", QWEN3_VIDEO) == run.video
    for total, rate in ((25, 10.0), (300, 30.0), (7, 5.0)):
        meta = VideoMetadata(total_num_frames=total, fps=rate)
        want = exported.sample_frames(meta).tolist()
        assert sample_frame_indices(total, rate, run.video).tolist() == want, (total, rate)
    # the per-frame cap, where a folder turns it on
    capped = {"cap_pixels_per_frame": True, "max_video_tokens": 4}
    reference = Qwen3VLVideoProcessor.from_pretrained(qwen3.folder, **capped)
    for n, h, w in ((10, 100, 150), (4, 300, 200), (2, 64, 64)):
        gh, gw = (side // 16 for side in frame_size(n, h, w, video._replace(**capped)))
        assert -(-n // 2) * gh * gw == reference.get_num_of_video_patches(n, h, w), (n, h, w)
    # transformers' order of files, and the keys each class reads
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "preprocessor_config.json").write_text(
        json.dumps({"size": {"shortest_edge": 4096, "longest_edge": 8192}, "min_pixels": 3136, "max_pixels": 6272})
    )
    assert read_video_config(folder, QWEN2_VIDEO)[1:3] == (3136, 6272)
    assert read_video_config(folder, QWEN3_VIDEO)[1:3] == (4096, 8192)
    (folder / "video_preprocessor_config.json").write_text(json.dumps({"fps": 4}))
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}))
    assert read_video_config(folder, QWEN3_VIDEO).fps == Qwen3VLVideoProcessor.from_pretrained(folder).fps == 4
    (folder / "processor_config.json").write_text(json.dumps({"video_processor": {"fps": 3, "num_frames": 8}}))
    assert Qwen3VLVideoProcessor.from_pretrained(folder).fps == 3
    with pytest.raises(ConfigError) as err:
        read_video_config(folder, QWEN3_VIDEO)
    assert str(err.value) == (
        f"{folder}: its video processor samples a fixed num_frames=8; Kiln samples videos by rate (data.video_fps)"
    )


def _starts(lens: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each sample in a row."""
    return [(sum(lens[:k]), n) for k, n in enumerate(lens)]


def test_pad_repeats_expand_each_placeholder():
    ids = torch.tensor([5, 9, 6, 9, 7])
    assert image_pad_repeats(ids, 9, [3, 2]).tolist() == [1, 3, 1, 2, 1]
    assert ids.repeat_interleave(image_pad_repeats(ids, 9, [3, 2])).tolist() == [5, 9, 9, 9, 6, 9, 9, 7]


def image_of(array: np.ndarray):
    from PIL import Image

    return Image.fromarray(array)


def png(im) -> bytes:
    import io

    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def llava_sample(key: str, messages: list[dict], images: list) -> dict:
    """A raw sample as data.prepare_llava writes it (its JSON record, then image0, image1, ... bytes)."""
    record = {"id": key, "messages": messages, "num_images": len(images)}
    return {"json": json.dumps(record), **{f"image{i}": png(im) for i, im in enumerate(images)}}


def test_llava_samples_collate_with_counted_skips_and_a_blank(qwen):
    """prepare_llava samples with 0 and 2 images and one whose images alone exceed max_seq_len: the over-long one
    is dropped and counted, the rest pack; a micro-batch without images gets the blank image, unlabelled."""
    cfg = qwen.model.config
    kw = dict(max_seq_len=100, video_config=qwen.video)
    two = encode_llava_qwen(
        llava_sample("two", conversation(2), [image(56, 84, 1), image(112, 56, 2)]),
        qwen.tokenizer,
        qwen.image_processor,
        **kw,
    )
    text = encode_llava_qwen(llava_sample("text", conversation(0), []), qwen.tokenizer, qwen.image_processor, **kw)
    big = encode_llava_qwen(
        llava_sample("big", conversation(2), [image(300, 200, 0), image(200, 300, 3)]),
        qwen.tokenizer,
        qwen.image_processor,
        **kw,
    )
    assert big == {"skipped": "its 2 image(s) take 108 tokens, more than data.max_seq_len 100", "key": "big"}
    assert two["key"] == "two" and two["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 4]] and not two["truncated"]
    blank = blank_qwen_sample(qwen.image_processor, qwen.image_pad)
    collate = dict(
        rope_index=rope_index_for(cfg),
        packing=True,
        max_seq_len=100,
        pad_id=qwen.tokenizer.pad_token_id,
        image_pad_id=qwen.image_pad,
        video_pad_id=qwen.video_pad,
        blank=blank,
    )
    out = collate_qwen([two, big, text], **collate)
    assert (out["samples"], out["skipped"], out["text_only"]) == (2, 1, 1)
    assert out["batch"].image_grid_thw.tolist() == [[1, 4, 6], [1, 8, 4]]  # no blank: the batch has images
    assert out["real_tokens"] == len(two["input_ids"]) + len(text["input_ids"])
    alone = collate_qwen([text], **collate)
    assert alone["batch"].image_grid_thw.tolist() == blank["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert alone["batch"].packed.num_labels == int((text["labels"][1:] != IGNORE_INDEX).sum())


def test_raw_video_samples_decode_and_every_batch_gets_a_video(qwen):
    """prepare_llava samples with a video file and with frame files decode with their videos sampled at the
    configured rate; with data that has videos a micro-batch without one gets the smallest video (one temporal
    patch of black min_pixels frames, unlabelled), beside the blank image when it has no image either."""
    from tests.support.video import encode_video

    tok, ip = qwen.tokenizer, qwen.image_processor
    container = {
        "json": json.dumps(
            {"id": "clip", "messages": video_conversation(), "num_images": 0, "video": {"container": "mp4"}}
        ),
        "video": encode_video(frames(25, 56, 84, 7), 10),
    }
    shots = frames(3, 56, 56, 8)
    listed = {
        "json": json.dumps(
            {"id": "shots", "messages": video_conversation(), "num_images": 0, "video": {"frames": 3, "fps": None}}
        ),
        **{f"frame{i}": png(image_of(f)) for i, f in enumerate(shots)},
    }
    clip = encode_llava_qwen(container, tok, ip, video_config=qwen.video)
    assert clip["video_grid_thw"].tolist() == [[2, 4, 6]] and clip["second_per_grid_ts"].tolist() == [1.25]
    short = encode_llava_qwen(
        container, tok, ip, video_config=qwen.video._replace(max_frames=2)
    )  # 2 frames over 2.5 s: 0.8 fps
    assert short["video_grid_thw"].tolist() == [[1, 4, 6]] and short["second_per_grid_ts"].tolist() == [2.5]
    few = encode_llava_qwen(listed, tok, ip, video_config=qwen.video)
    assert few["video_grid_thw"].tolist() == [[2, 4, 4]] and few["second_per_grid_ts"].tolist() == [1.0]  # 3 -> 4
    blank = blank_qwen_sample(ip, qwen.image_pad)
    blank_video = blank_qwen_sample(ip, qwen.image_pad, qwen.video_pad, qwen.video)
    assert blank_video["video_grid_thw"].tolist() == [[1, 4, 4]] and (blank_video["labels"] == IGNORE_INDEX).all()
    text = encode_qwen(conversation(0), [], tok, ip)
    collate = dict(
        rope_index=rope_index_for(qwen.model.config),
        packing=True,
        max_seq_len=256,
        pad_id=tok.pad_token_id,
        image_pad_id=qwen.image_pad,
        video_pad_id=qwen.video_pad,
        blank=blank,
        blank_video=blank_video,
    )
    alone = collate_qwen([text], **collate)["batch"]
    assert alone.image_grid_thw.tolist() == [[1, 4, 4]] and alone.video_grid_thw.tolist() == [[1, 4, 4]]
    assert alone.packed.num_labels == int((text["labels"][1:] != IGNORE_INDEX).sum())
    out = collate_qwen([clip, text], **collate)
    assert out["batch"].video_grid_thw.tolist() == [[2, 4, 6]] and out["text_only"] == 1  # no blank video added


@pytest.mark.parametrize("arch", ARCHS)
def test_held_out_video_conversations_evaluate_and_generate(request, arch, tmp_path):
    """The held-out evaluation on a shard with a video conversation and an image one: the loss covers both answers,
    and the answer generated for the video's prompt is transformers' greedy generate with the prompt's video
    (its patches, grid and Qwen2.5-VL's second_per_grid_ts; Qwen3-VL's timestamps are in the prompt's text) as the
    processor would hand it over."""
    import webdataset as wds

    from recipes.vlm.evaluate import conversation_eval
    from recipes.vlm.inputs import QwenInputs
    from recipes.vlm.qwen import QwenProcessing
    from tests.support.video import encode_video

    qwen = request.getfixturevalue(ARCHS[arch])
    tok, ip, rule = qwen.tokenizer, qwen.image_processor, qwen.video.rule
    clip = frames(25, 56, 84, 7)
    raw = [
        {
            "__key__": "v",
            "json": json.dumps(
                {"id": "v", "messages": video_conversation(), "num_images": 0, "video": {"container": "mp4"}}
            ),
            "video": encode_video(clip, 10),
        },
        {**llava_sample("i", conversation(1), [image(56, 84, 1)]), "__key__": "i"},
    ]
    with wds.TarWriter(str(tmp_path / "val.tar")) as sink:
        for sample in raw:
            sink.write(sample)
    meta = {"format": "llava-conversations", "videos": 1}
    inputs = QwenInputs(QwenProcessing(tok, ip, qwen.video), qwen.model, types.SimpleNamespace(label="qwen"), meta)
    out = conversation_eval(
        qwen.model, inputs, [str(tmp_path / "val.tar")], limit=2, max_seq_len=512, max_new_tokens=4, device="cpu"
    )
    encoded = [encode_llava_qwen(s, tok, ip, video_config=qwen.video) for s in raw]
    assert out["num_samples"] == 2 and out["val_tokens"] == sum(
        int((e["labels"][1:] != IGNORE_INDEX).sum()) for e in encoded
    )
    video = encoded[0]
    first = int((video["labels"] != IGNORE_INDEX).nonzero()[0])
    prompt = video["input_ids"][:first][None]
    times = {} if rule.timestamps else {"second_per_grid_ts": video["second_per_grid_ts"]}
    with torch.no_grad():
        want = qwen.model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            pixel_values_videos=video["pixel_values_videos"],
            video_grid_thw=video["video_grid_thw"],
            **times,
            mm_token_type_ids=modality_types(prompt, qwen.image_pad, qwen.video_pad),
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    assert out["examples"][0]["key"] == "v"
    assert out["examples"][0]["answer"] == tok.decode(want[0, prompt.shape[1] :], skip_special_tokens=True).strip()


MERGERS = ("model.visual.merger.", "model.visual.deepstack_merger_list.")  # Qwen3-VL's DeepStack mergers: projectors


@pytest.mark.parametrize(
    "arch, stage, train_vision, train_projector",
    [
        ("qwen2_5_vl", "align", False, True),
        ("qwen2_5_vl", "finetune", False, True),
        ("qwen2_5_vl", "finetune", True, True),
        ("qwen2_5_vl", "finetune", False, False),
        ("qwen3_vl", "align", False, True),
        ("qwen3_vl", "finetune", False, False),
    ],
)
def test_stages_freeze_qwen_parts(request, arch, stage, train_vision, train_projector):
    """LLaVA's stages on a Qwen-VL's parts: align trains the merger alone (Qwen3-VL: with its DeepStack mergers),
    finetune the merger(s) and the language model (the language model alone with vlm.train_projector=false: all of
    Qwen3-VL's mergers frozen), and vlm.train_vision the tower's blocks and patch embedding too (every one of them
    feeds the merger). One packed backward: gradients reach exactly those (the optimizer takes the parameters that
    require grad: test_vlm_qwen_zero3 counts its state)."""
    from transformers import AutoModelForImageTextToText

    qwen = request.getfixturevalue(ARCHS[arch])
    model = AutoModelForImageTextToText.from_pretrained(qwen.folder, dtype=torch.float32)
    freeze_for_stage(model, stage, train_vision, train_projector=train_projector)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    merger = {n for n, _ in model.named_parameters() if n.startswith(MERGERS)}
    assert any(n.startswith(MERGERS[1]) for n in merger) == (arch == "qwen3_vl")
    language = {n for n, _ in model.named_parameters() if n.startswith(("model.language_model.", "lm_head."))}
    tower = {n for n, _ in model.named_parameters() if n.startswith("model.visual.")} - merger
    want = merger if stage == "align" else language | (merger if train_projector else set())
    assert trainable == want | (tower if train_vision else set())
    samples = [
        encode_qwen(conversation(n), ims, qwen.tokenizer, qwen.image_processor)
        for n, ims in ((0, []), (2, [image(56, 84, 1), image(140, 224, 2)]))
    ]
    batch = pack_qwen(
        samples,
        rope_index_for(model.config),
        max_seq_len=512,
        pad_id=qwen.tokenizer.pad_token_id,
        image_pad_id=qwen.image_pad,
        video_pad_id=qwen.video_pad,
    )
    model(**batch.model_inputs("sdpa"), use_cache=False).loss.backward()
    reached = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert reached == trainable


def test_pixel_budget_overrides_the_folder_and_bad_ones_are_one_line(qwen):
    """data.min_pixels / data.max_pixels replace the folder's budget: a 300x200 image then has the tokens
    transformers' smart_resize gives for it within the new budget; an inverted or too small budget, and a tokenizer
    whose <|image_pad|> is not the model's, stop with one line."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    image_token_id = qwen.model.config.image_token_id
    low, high = 28 * 28 * 8, 28 * 28 * 16
    ip = load_processing(qwen.folder, image_token_id, min_pixels=low, max_pixels=high).image_processor
    h, w = smart_resize(300, 200, 28, low, high)
    grid = ip(images=[image(300, 200, 0)], return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == [[1, h // 14, w // 14]] and h * w <= high
    bad = {
        (high, low): f"data.min_pixels={high} is above data.max_pixels={low}",
        (28 * 28 * 100, 0): "the pixel budget 78400..50176 is inverted (data.min_pixels / data.max_pixels)",
        (0, 700): "data.max_pixels=700 is below one merged 28x28 patch (784 pixels)",
    }
    for (mn, mx), message in bad.items():
        with pytest.raises(ConfigError) as err:
            load_processing(qwen.folder, image_token_id, min_pixels=mn, max_pixels=mx)
        assert str(err.value) == message
    with pytest.raises(
        ConfigError, match=r"the tokenizer's <\|image_pad\|> is id \d+, the model's image_token_id is 3$"
    ):
        load_processing(qwen.folder, 3)


@pytest.mark.parametrize(("arch", "name", "unit"), [("qwen2_5_vl", "Qwen2.5-VL", 28), ("qwen3_vl", "Qwen3-VL", 32)])
def test_init_from_a_qwen_folder_sets_the_model_keys_and_bad_keys_are_one_line(request, arch, name, unit):
    """model.init_from=<a Qwen2.5-VL or Qwen3-VL folder>: the model.* keys are its config's (its own tower: model.vision
    qwen2_5_vl / qwen3_vl), vlm.stage=align (the merger alone) composes, and the pixel budget keys compose; an inverted
    budget, one below the architecture's merged patch (28 or 32 px square), a budget for a LLaVA and a chosen
    model.vision stop at composition, one line."""
    from recipes.vlm.inputs import LlavaInputs, QwenInputs
    from recipes.vlm.qwen import QwenProcessing
    from scripts.kiln.launch import compose

    qwen = request.getfixturevalue(ARCHS[arch])
    folder, c = str(qwen.folder), qwen.model.config
    cfg = compose(
        ["recipe=vlm_tiny", "data=llava", f"model.init_from={folder}", "vlm.stage=align", "data.max_pixels=12544"]
    )
    m, v, t = cfg.model, c.vision_config, c.text_config
    assert (m.vision, m.vision_hidden_size, m.vision_layers, m.vision_heads, m.vision_patch_size) == (
        arch,
        v.hidden_size,
        v.depth,
        v.num_heads,
        v.patch_size,
    )
    assert (m.text_hidden_size, m.text_layers, m.text_kv_heads, m.vocab_size, m.max_seq_len) == (
        t.hidden_size,
        t.num_hidden_layers,
        t.num_key_value_heads,
        t.vocab_size,
        t.max_position_embeddings,
    )
    assert (cfg.data.min_pixels, cfg.data.max_pixels) == (0, 12544)
    bad = {
        (f"model.init_from={folder}", "data.min_pixels=12544", "data.max_pixels=3136"): (
            "data.min_pixels=12544 is above data.max_pixels=3136"
        ),
        (f"model.init_from={folder}", f"data.max_pixels={unit * unit - 1}"): (
            f"data.max_pixels={unit * unit - 1} is below one merged {unit}x{unit} patch ({unit * unit} pixels)"
        ),
        ("data.max_pixels=12544",): (
            "data.min_pixels / data.max_pixels are the pixel budget of a native-resolution model "
            "(model.init_from=<a Qwen2.5-VL or Qwen3-VL folder>); a LLaVA resizes every image to its tower's image "
            "size"
        ),
        (f"model.vision={arch}",): f"model.vision={arch} is read from model.init_from=<a {name} folder>, not chosen",
        ("data.video_fps=1",): (
            "data.video_fps / data.max_frames sample the videos of a native-resolution model "
            "(model.init_from=<a Qwen2.5-VL or Qwen3-VL folder>); a LLaVA takes images only"
        ),
        (f"model.init_from={folder}", "data.video_fps=0"): (
            "data.video_fps=0.0 must be above 0 (frames sampled per second of video)"
        ),
        (f"model.init_from={folder}", "data.max_frames=1"): (
            "data.max_frames=1 is below one temporal patch (2 frames) of the tower"
        ),
    }
    for overrides, message in bad.items():
        with pytest.raises(ConfigError) as err:
            compose(["recipe=vlm_tiny", "data=llava", *overrides])
        assert str(err.value) == message, overrides
    with pytest.raises(ConfigError, match=r"^the dataset has 3 sample\(s\) with a video; a LLaVA takes images only"):
        LlavaInputs(None, None, None, {"format": "llava-conversations", "videos": 3})
    video = compose(
        ["recipe=vlm_tiny", "data=llava", f"model.init_from={folder}", "data.video_fps=1", "data.max_frames=64"]
    )
    assert (video.data.video_fps, video.data.max_frames) == (1.0, 64)
    videos = {"format": "llava-conversations", "videos": 2}  # data with videos sets up (and its blank video)
    assert QwenInputs(
        QwenProcessing(qwen.tokenizer, qwen.image_processor, qwen.video), qwen.model, qwen, videos
    ).blank_video
    # parallel.cp composes for both (Qwen3-VL's DeepStack inputs are cut with the tokens: test_vlm_context_parallel).
    assert compose(["recipe=vlm_tiny", "data=llava", f"model.init_from={folder}", "parallel.cp=2"]).parallel.cp == 2


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_export_is_a_peft_adapter_over_the_release(request, arch, tmp_path):
    """finetune=lora on a Qwen2.5-VL / Qwen3-VL: adapters on the language model's linears, the merger(s) in full,
    nothing else trains; the export is a PEFT folder that peft itself loads over the release with the adapted model's
    logits, and export.merge_lora's merged folder loads as the release's class with them too (fp32)."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from recipes.vlm.lora import write_export
    from recipes.vlm.parallelize import trainable_parts
    from recipes.vlm.qwen import load_qwen
    from scripts.kiln.launch import compose

    qwen = request.getfixturevalue(ARCHS[arch])
    cfg = compose(
        ["recipe=vlm_tiny", "data=llava", f"model.init_from={qwen.folder}", "finetune=lora", "export.merge_lora=true"]
    )
    model = load_qwen(qwen.folder, "sdpa")
    assert type(model) is type(qwen.model)
    trainable_parts(model, cfg)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    merger = [n for n in trained if n.startswith(MERGERS)]
    adapters = [n for n in trained if n.startswith("model.language_model.layers.") and ".lora_" in n]
    layers = model.config.text_config.num_hidden_layers
    assert merger and len(adapters) == layers * 7 * 2 and sorted(trained) == sorted(merger + adapters)
    torch.manual_seed(1)
    with torch.no_grad():  # as training leaves them: B off zero, the merger moved
        for n in trained:
            p = model.get_parameter(n)
            p.add_(torch.randn_like(p) * 0.05)
    processing = load_processing(qwen.folder, model.config.image_token_id)
    write_export(model, cfg, tmp_path, base=str(qwen.folder), processor=processing)
    s = encode_qwen(conversation(1), [image(300, 200, 0)], qwen.tokenizer, qwen.image_processor)
    ids = s["input_ids"][None]
    inputs = dict(
        input_ids=ids,
        pixel_values=s["pixel_values"],
        image_grid_thw=s["image_grid_thw"],
        mm_token_type_ids=modality_types(ids, qwen.image_pad, qwen.video_pad),
    )
    base = AutoModelForImageTextToText.from_pretrained(qwen.folder, dtype=torch.float32)
    with torch.no_grad():
        want = model.eval()(**inputs).logits
        peft = PeftModel.from_pretrained(base, tmp_path).eval()(**inputs).logits
        merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", dtype=torch.float32)
        assert type(merged) is type(qwen.model)
        merged = merged.eval()(**inputs).logits
        plain = qwen.model(**inputs).logits
    diffs = [(x - want).abs().max().item() for x in (peft, merged)]
    print(f"{arch}: max |peft - trained|, |merged - trained| logits: {diffs}")
    assert max(diffs) < 1e-5 and (plain - want).abs().max().item() > 1e-3  # the adapter changes the logits


@pytest.mark.parametrize("arch", ["qwen2.5-vl", "qwen3-vl"])
def test_a_tiny_qwen_vl_base_is_one_command_and_vllm_cpu_serves_it(arch, tmp_path, capsys):
    """python -m data.tiny_qwen_vl: a release folder transformers loads, whose heads vLLM's CPU attention runs; a
    folder there is left alone."""
    from transformers import AutoConfig

    from data.tiny_qwen_vl import main
    from scripts.kiln.serving import head_size, vllm_cpu_refuses

    out = tmp_path / "base"
    assert main(["--out", str(out), "--arch", arch]) == 0
    assert AutoConfig.from_pretrained(out).model_type == {"qwen2.5-vl": "qwen2_5_vl", "qwen3-vl": "qwen3_vl"}[arch]
    assert head_size(out) == 32 and vllm_cpu_refuses(out) is None
    assert main(["--out", str(out), "--arch", arch]) == 0 and "nothing to do" in capsys.readouterr().out
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    assert main(["--out", str(tmp_path / "mine")]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and (tmp_path / "mine" / "notes.txt").exists()
