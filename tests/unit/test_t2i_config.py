"""The text-to-image recipe's inputs: captioned image folders to shards (skips counted, not-text captions refused)
and pipeline folders Kiln does not train refused with one line."""

from __future__ import annotations

import json

import pytest

from common.errors import ConfigError
from scripts.kiln.launch import compose, main


@pytest.mark.parametrize("metadata", [False, True], ids=["txt_beside", "metadata_jsonl"])
def test_captioned_folder_to_shards_counts_its_skips(tmp_path, metadata):
    from common.data.dataset import load_dataset_meta
    from common.data.webdataset import iter_samples
    from data.prepare_captions import build_caption_shards, skip_summary
    from data.tiny_bases import digit_caption, make_caption_folder

    folder = make_caption_folder(tmp_path / "in", per_digit=3, digits=2, size=8, metadata=metadata)
    meta, built = build_caption_shards(tmp_path / "out", input=folder, image_size=16, train_shards=2, val_shards=1)
    assert built and meta["image_files"] == 9  # 6 digits, a broken file, an uncaptioned and an empty-captioned image
    assert meta["skipped"] == {
        "undecodable": ["broken.png"],
        "no_caption": ["uncaptioned.png"],
        "empty_caption": ["empty_caption.png"],
    }
    assert skip_summary(meta).startswith("skipped 3 file(s): 1 undecodable (broken.png)")
    urls = load_dataset_meta(tmp_path / "out")
    samples = [s for split in ("train", "val") for s in iter_samples(urls[f"{split}_urls"])]
    assert meta["splits"]["train"]["samples"] + meta["splits"]["val"]["samples"] == len(samples) == 6
    captions = sorted(s["txt"].decode() if isinstance(s["txt"], bytes) else s["txt"] for s in samples)
    assert captions == sorted(digit_caption(d, i) for d in range(2) for i in range(3))
    assert "a handwritten zero" in captions and "the digit 1" in captions  # several phrasings


def test_an_empty_val_split_is_said_in_one_line(tmp_path, capsys):
    from data.prepare_captions import main as prepare
    from data.prepare_captions import split_rows
    from data.tiny_bases import make_caption_folder

    # Two digits and a broken file with a caption: 3 usable images, one held out; a seed that holds out the broken one.
    folder = make_caption_folder(tmp_path / "in", per_digit=1, digits=2, size=8)
    seed = next(s for s in range(100) if split_rows(3, val_fraction=0.05, seed=s)["val"].tolist() == [2])
    argv = ["--input", str(folder), "--out", str(tmp_path / "out"), "--image-size", "16", "--seed", str(seed)]
    assert prepare(argv) == 0
    out = capsys.readouterr().out
    assert "val 0 samples" in out
    said = [line for line in out.splitlines() if "val split is empty" in line]
    assert len(said) == 1 and "training captions" in said[0], out


def test_a_caption_that_is_not_text_is_one_line(tmp_path):
    from data.prepare_captions import main as prepare
    from data.tiny_bases import make_caption_folder

    folder = make_caption_folder(tmp_path / "in", per_digit=2, digits=1, size=8, bad=False)
    (folder / "0_0000.txt").write_bytes(b"\xff\xfe\x00binary")
    assert prepare(["--input", str(folder), "--out", str(tmp_path / "out"), "--image-size", "16"]) == 2
    assert not (tmp_path / "out").exists()


def test_a_pipeline_kiln_does_not_train_is_refused_with_one_line(tmp_path, capsys):
    flux = tmp_path / "sdxl"
    flux.mkdir()
    (flux / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(
        ConfigError,
        match="is a StableDiffusionXLPipeline; the text-to-image recipe trains StableDiffusion3Pipeline, FluxPipeline",
    ):
        compose(["recipe=t2i_tiny", f"model.init_from={flux}"])
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        main(["recipe=t2i_tiny", f"model.init_from={flux}", f"run.dir={run_dir}"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith("kiln: error: model.init_from=") and len(err.splitlines()) == 1
    assert not run_dir.exists()
    with pytest.raises(ConfigError, match="no diffusers pipeline folder there"):
        compose(["recipe=t2i_tiny", f"model.init_from={tmp_path}"])


@pytest.mark.parametrize("key", ["diffusion.class_dropout=0.2", "diffusion.vae=/x", "diffusion.samples_per_class=2"])
def test_a_class_conditional_diffusion_key_is_refused_not_ignored(key):
    with pytest.raises(ConfigError, match=f"^{key.split('=')[0]} is not read by the text-to-image recipe: "):
        compose(["recipe=t2i_tiny", key])


def test_t2i_lora_targets_and_refusals(tmp_path, capsys):
    """finetune=lora fills in the joint attention's linears (diffusers' SD3 LoRA example's); a target the recipe's LoRA
    cannot take, and one that the transformer has no linear of, each stop with one line, nothing written."""
    import torch
    from diffusers import SD3Transformer2DModel

    from recipes.t2i.parallelize import parallelize

    cfg = compose(["recipe=t2i_tiny", "finetune=lora"])
    targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
    assert cfg.lora.targets == targets  # config.yaml records what ran
    run_dir = tmp_path / "run"
    capsys.readouterr()  # what importing peft and diffusers printed
    with pytest.raises(SystemExit) as exit_:
        main(["recipe=t2i_tiny", "finetune=lora", "lora.targets=[to_q,ff.net.0.proj]", f"run.dir={run_dir}"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and not run_dir.exists()
    assert err.startswith("kiln: error: lora.targets: 'ff.net.0.proj' matches no module the t2i recipe's LoRA"), err

    # One block is SD3's last, context_pre_only: its attention has no to_add_out, so that target matches nothing.
    one_block = SD3Transformer2DModel(
        sample_size=8, num_layers=1, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
        caption_projection_dim=16, pooled_projection_dim=32, out_channels=16, pos_embed_max_size=8,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="^lora.targets: 'to_add_out' matches no linear of this model$"):
        parallelize(one_block, cfg)
    cfg.lora.targets = ["to_q", "add_q_proj"]
    adapted = parallelize(SD3Transformer2DModel.from_config(one_block.config), cfg)
    trainable = sorted(n for n, p in adapted.named_parameters() if p.requires_grad)
    assert trainable == [f"transformer_blocks.0.attn.{m}.lora_{ab}.default.weight" for m in ("add_q_proj", "to_q")
                         for ab in "AB"]  # fmt: skip
    assert torch.equal(adapted.transformer_blocks[0].attn.to_q.lora_B.default.weight, torch.zeros(16, 8))


def test_the_demo_tokenizers_are_the_same_in_every_process(tmp_path):
    """The tiny bases' CLIP and T5 tokenizers (data/tiny_bases.py) are trained in each clone: two processes write
    them byte for byte alike (the `tokenizers` trainers alone numbered and scored them differently in each process,
    so each clone pretrained other text encoders and its demo scored other adherences)."""
    import subprocess
    import sys

    code = (
        "import sys; from data.tiny_bases import MOTION_TOKENIZER_TEXT, make_clip_tokenizer, make_t5_tokenizer; "
        "out = sys.argv[1]; make_clip_tokenizer(out + '/clip'); make_t5_tokenizer(out + '/t5'); "
        "make_t5_tokenizer(out + '/umt5', text=MOTION_TOKENIZER_TEXT, vocab_size=160)"
    )
    for name in ("a", "b"):
        subprocess.run([sys.executable, "-c", code, str(tmp_path / name)], check=True, capture_output=True)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert len(files) >= 6
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
