"""Qwen2.5-VL and Qwen3-VL trained by the VLM recipe, end to end on CPU: a tiny random release folder
(make_qwen2_5_vl / make_qwen3_vl) fine-tuned on LLaVA-format data at native resolution (data.min_pixels /
data.max_pixels), packed, in one process; the data has videos too (MP4 files and frame files, sampled at
data.video_fps; Qwen3-VL's with a timestamp text per temporal patch). The loss falls; the export is a folder
transformers loads as
the release's class (Qwen2_5_VLForConditionalGeneration / Qwen3VLForConditionalGeneration) whose logits are the
trained model's (the run's last DeepSpeed checkpoint, loaded into the release's model by transformers, not by Kiln);
the frozen vision tower is the release's bit for bit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from recipes.vlm.archs import QWEN_ARCHS
from tests.conftest import load_script, losses, metrics
from tests.fixtures import vlm as fx

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=QWEN_ARCHS)
def run(request, trained):
    """(run folder, release folder, model_type). Qwen2.5-VL: the cached run test_vlm_qwen_zero3 takes as its 1-rank
    ZeRO-0 reference (conftest's qwen_world, with videos); Qwen3-VL: its own release over the same conversations
    (conftest's qwen3_world: the cached run test_serve_vllm_qwen serves)."""
    world = request.getfixturevalue("qwen_world" if request.param == "qwen2_5_vl" else "qwen3_world")
    return trained(fx.qwen_run_args(world)), world["qwen"], request.param


def test_qwen_trains_at_native_resolution_and_the_loss_falls(run):
    run_dir = run[0]
    loss = losses(run_dir)
    assert sorted(loss) == [1, 2, 3] and loss[3] < loss[1]
    records = list(metrics(run_dir).values())
    assert all(r["skipped_samples"] == 0 for r in records)  # the images fit data.max_seq_len
    assert sum(r["text_only_samples"] for r in records) > 0  # text-only conversations trained beside the images
    if QWEN_ARCHS[run[2]].video:  # and videos (their frames decoded in the loader)
        assert sum(r["video_samples"] for r in records) > 0
    assert not any(r.get("corrupt_shards") for r in records)
    assert json.loads((run_dir / "eval.json").read_text())["val_tokens"] > 0


def test_export_is_the_trained_qwen_and_the_tower_stays_the_release(run):
    """The export loads as the release's class (with its tokenizer and the run's pixel budget); its logits on a
    conversation with an image equal those of the run's final checkpoint loaded into the release's model (fp32); the
    frozen tower is the release's bit for bit, the merger(s) (Qwen3-VL's DeepStack ones too) and the language model
    moved."""
    from PIL import Image
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    run_dir, release, arch = run
    export = run_dir / "export"
    assert AutoConfig.from_pretrained(export).model_type == arch
    model = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32).eval()
    trained = AutoModelForImageTextToText.from_pretrained(release, dtype=torch.float32).eval()
    assert type(model) is type(trained) and type(model).__name__ == QWEN_ARCHS[arch].model
    (step,) = (run_dir / "checkpoints").glob("step_*")
    module = torch.load(step / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    trained.load_state_dict(module, strict=True)
    tokenizer, image_processor = AutoTokenizer.from_pretrained(export), AutoImageProcessor.from_pretrained(export)
    unit = QWEN_ARCHS[arch].unit  # images of 4..16 merged tokens (tests/fixtures/vlm.py qwen_run_args)
    assert image_processor.size == {"shortest_edge": unit**2 * 4, "longest_edge": unit**2 * 16}
    # its video processor config: the run's rate (data.video_fps=4), the release's video budget (Qwen2.5-VL's: its
    # image processor's, which transformers reads in the absence of a video config) and frame cap; transformers
    # loading it: tests/integration/test_vlm_qwen_processor.py
    video = json.loads((export / "video_preprocessor_config.json").read_text())
    source = next(
        p for p in (release / "video_preprocessor_config.json", release / "preprocessor_config.json") if p.exists()
    )
    assert video["fps"] == 4.0 and video["video_processor_type"] == QWEN_ARCHS[arch].video.processor
    assert (video["size"], video["max_frames"]) == (json.loads(source.read_text())["size"], 768)

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (90, 60, 3), dtype=np.uint8))
    vision = image_processor(images=[image], return_tensors="pt")
    tokens = int(vision["image_grid_thw"].prod()) // image_processor.merge_size**2
    # Qwen2_5_VLProcessor's expansion of the image's one pad (its processor needs torchvision, not in the training env).
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What digit is this?"}]}],
        add_generation_prompt=True,
        tokenize=False,
    ).replace("<|image_pad|>", "<|image_pad|>" * tokens)
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    inputs = dict(input_ids=ids, mm_token_type_ids=(ids == pad).int(), **vision)
    with torch.no_grad():
        got, want = model(**inputs).logits, trained(**inputs).logits
    print(f"max |export - trained| logits: {(got - want).abs().max().item():.3g}")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)

    before, after = load_file(release / "model.safetensors"), load_file(export / "model.safetensors")
    assert set(after) == set(before)
    # Names as transformers saves each (the releases' layouts: Qwen2.5-VL's visual.*, model.layers.*; Qwen3-VL's
    # model.visual.*, model.language_model.layers.*).
    tower = [k for k in before if "visual." in k and "merger" not in k]
    merger = [k for k in before if "merger" in k and k.endswith("weight")]
    layers = [k for k in before if ".layers." in k and k.endswith("proj.weight")]
    assert any("deepstack_merger_list" in k for k in merger) == QWEN_ARCHS[arch].deepstack
    assert tower and all(torch.equal(after[k], before[k]) for k in tower)
    assert merger and layers and all(not torch.equal(after[k], before[k]) for k in merger + layers)


def test_export_from_the_checkpoint_is_the_run_export(run, tmp_path):
    """scripts/export.py on the run's final checkpoint writes the end-of-run export tensor for tensor, with the same
    tokenizer and pixel budget."""
    run_dir = run[0]
    assert load_script("export").main([str(run_dir), "--out", str(tmp_path / "export")]) == 0
    got, want = (
        load_file(tmp_path / "export" / "model.safetensors"),
        load_file(run_dir / "export" / "model.safetensors"),
    )
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    for name in (
        "preprocessor_config.json",
        "video_preprocessor_config.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        assert (tmp_path / "export" / name).read_text() == (run_dir / "export" / name).read_text(), name
