"""The text-to-image prompt-adherence eval's parts: the held-out phrasings are absent from every training caption
the digits demo builds, and the scorer (the DiT's digit classifier, fitted on caption shards labelled by their
captions) reads real digit images of the prompted class as adherent and images of another class as not -- the
images and their classes taken straight from scikit-learn, not through the captions."""

from __future__ import annotations

import functools

import numpy as np
import torch

from common.data.digit_captions import (
    CAPTION_TEMPLATES,
    DIGIT_WORDS,
    HELD_OUT_TEMPLATES,
    caption_digit,
    digit_caption,
    held_out_prompts,
)


def test_held_out_phrasings_are_absent_from_the_training_captions(tmp_path):
    from data.tiny_bases import make_caption_folder

    # What data.prepare_captions --digits captions, read back from the folder it writes (its 180 images per digit
    # take the phrasings in turn: 8 show them all).
    folder = make_caption_folder(tmp_path, per_digit=8, size=8, bad=False)
    training = {p.read_text() for p in folder.glob("*.txt")}
    assert len(training) == 10 * len(CAPTION_TEMPLATES)  # every training phrasing of every digit is used
    prompts, digits = held_out_prompts(per_digit=4)
    assert len(prompts) == 40 and digits == [d for d in range(10) for _ in range(4)]
    assert not set(prompts) & training
    assert {p for p in prompts if digits[prompts.index(p)] == 7} == {
        "the handwritten digit 7",
        "a drawing of the number seven",
    }
    # No held-out phrasing is a training one written otherwise (the templates, not only these digits' captions).
    assert not set(HELD_OUT_TEMPLATES) & set(CAPTION_TEMPLATES)
    # The digit a caption names, for every phrasing and digit; other text names none.
    for templates in (CAPTION_TEMPLATES, HELD_OUT_TEMPLATES):
        for d in range(10):
            for i in range(len(templates)):
                assert caption_digit(digit_caption(d, i, templates)) == d
    assert caption_digit("a photo of a cat") is None and caption_digit("the digit 12") is None
    assert caption_digit(f"a handwritten {DIGIT_WORDS[3]} and a cat") is None


def sklearn_digits(rows: np.ndarray, image_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Digit images [N, 3, S, S] in [-1, 1] and their classes, straight from scikit-learn (no captions)."""
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.from_numpy(data.images[rows] / 16.0 * 2 - 1).float()[:, None]
    x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    return x.repeat(1, 3, 1, 1), torch.from_numpy(data.target[rows])


def test_the_scorer_reads_the_prompted_digit_on_real_images_and_not_another(tmp_path):
    from sklearn.datasets import load_digits

    from common.data.dataset import load_dataset_meta
    from common.diffusion import vae as vae_lib
    from data.prepare_captions import build_caption_shards
    from data.tiny_bases import make_caption_folder, make_vae
    from recipes.t2i.evaluate import eval_prompts, read_captioned_digits, score_prompt_adherence, through_vae

    per_digit = 30
    folder = make_caption_folder(tmp_path / "in", per_digit=per_digit, size=8, bad=False)
    build_caption_shards(tmp_path / "shards", input=folder, image_size=16, train_shards=1, val_shards=1)
    meta = load_dataset_meta(tmp_path / "shards")
    train, val = (read_captioned_digits(meta[f"{s}_urls"], 16) for s in ("train", "val"))
    assert len(train.labels) + len(val.labels) == 10 * per_digit
    assert torch.equal(torch.bincount(torch.cat([train.labels, val.labels])), torch.full((10,), per_digit))

    # Real digits the classifier never fitted on (make_caption_folder takes each digit's first rows), 4 per digit in
    # eval_prompts' order: "drawn" for the prompted digit, then for the next digit.
    target = load_digits().target
    rows = np.concatenate([np.flatnonzero(target == d)[per_digit : per_digit + 4] for d in range(10)])
    prompts, digits = eval_prompts(4)
    images, classes = sklearn_digits(rows, 16)
    assert torch.equal(classes, digits)
    right = score_prompt_adherence(images, digits, prompts, train, val)
    assert right["mean_accuracy"] >= 0.9 and right["classifier_accuracy_on_real_val"] >= 0.9
    assert right["chance"] == 0.1 and right["num_samples"] == 40 and right["prompts_seen_in_training"] == 0
    assert np.isclose(np.mean(list(right["per_class_accuracy"].values())), right["mean_accuracy"])
    wrong = score_prompt_adherence(images, (digits + 1) % 10, prompts, train, val)
    assert wrong["mean_accuracy"] <= 0.1
    # Samples come out of the pipeline's VAE: the classifier fits on the real images as that VAE renders them, and
    # then reads real digits rendered by a random VAE (the tests' and the demo's stand-in) as their class.
    vae_folder = make_vae(tmp_path / "vae", block_out_channels=(16, 32), latent_channels=16)
    geometry = vae_lib.vae_geometry(vae_folder, 16)
    render = functools.partial(through_vae, vae_lib.load_vae(geometry, torch.device("cpu")), geometry)
    rendered = render(images)
    assert rendered.shape == images.shape and not torch.allclose(rendered, images, atol=0.1)
    through = score_prompt_adherence(rendered, digits, prompts, train, val, render=render)
    assert through["mean_accuracy"] >= 0.9 and through["classifier_accuracy_on_real_val"] >= 0.9
    assert (
        score_prompt_adherence(rendered, (digits + 1) % 10, prompts, train, val, render=render)["mean_accuracy"] <= 0.1
    )
    # A caption shard that is not the captioned digits has no classifier: the eval is skipped, not guessed.
    (folder / "0_0000.txt").write_text("a photo of a cat")
    build_caption_shards(tmp_path / "other", input=folder, image_size=16, train_shards=1, val_shards=1)
    other = load_dataset_meta(tmp_path / "other")
    assert read_captioned_digits(other["train_urls"] + other["val_urls"], 16, images=False) is None
