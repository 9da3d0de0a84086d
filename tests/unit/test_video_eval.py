"""The video demo's prompt-adherence scorer (recipes/video/evaluate.py) on real clips: moving digits straight from the
generator (common/data/moving_digits.py, labelled by its own digits and directions, not by their captions) that the
classifier never fitted on score as the prompted digit and direction; noise, a constant clip and a still clip score no
better than chance where they carry no signal, so the eval can fail."""

from __future__ import annotations

import torch

from common.data.moving_digits import moving_digit_clips


def clips(n: int, seed: int):
    from recipes.video.evaluate import MovingDigitClips

    frames, captions, digits, directions = moving_digit_clips(n, 9, 32, 32, seed)
    videos = torch.from_numpy(frames).permute(0, 4, 1, 2, 3).float() / 127.5 - 1
    return MovingDigitClips(set(captions), videos, torch.tensor(digits), directions)


def test_the_scorer_reads_real_clips_right_and_noise_at_chance():
    from recipes.video.evaluate import MAX_PROMPTS_PER_PAIR, digit_crops, eval_prompts, score_prompt_adherence

    train, val = clips(240, seed=0), clips(80, seed=1)  # another seed: other digit images, other places
    prompts, digits, directions = eval_prompts(per_pair=50)
    assert len(prompts) == 40 * MAX_PROMPTS_PER_PAIR and not set(prompts) & (train.captions | val.captions)

    # A window about the digit: the same sprite wherever it is in the frame.
    crops = digit_crops(val.videos[:1])
    assert crops.shape == (9, 1, 20, 20) and (crops[0] - crops[-1]).abs().mean() < 0.1

    real = score_prompt_adherence(val.videos, val.digits, val.directions, prompts, train, val)
    print({k: v for k, v in real.items() if not isinstance(v, (dict, list))})
    assert real["digit_accuracy"] >= 0.9 and real["direction_accuracy"] == 1.0  # measured 0.938, 1.0
    assert real["classifier_frame_accuracy_on_real_val"] >= 0.9 and real["prompts_seen_in_training"] == 0
    assert real["real_val_digit_accuracy"] == real["digit_accuracy"]
    assert (real["chance_digit"], real["chance_direction"]) == (0.1, 0.25)

    # The right clips for the wrong prompts: the next digit, the opposite way.
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}
    wrong = score_prompt_adherence(
        val.videos, (val.digits + 1) % 10, [opposite[w] for w in val.directions], prompts, train, val
    )
    assert wrong["digit_accuracy"] <= 0.1 and wrong["direction_accuracy"] == 0.0

    n = len(prompts)
    noise = torch.rand(n, 3, 9, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    constant = torch.full((n, 3, 9, 32, 32), -0.5)
    for name, videos in (("noise", noise), ("constant", constant)):
        score = score_prompt_adherence(videos, digits, directions, prompts, train, val)
        print(name, score["digit_accuracy"], score["direction_accuracy"])
        assert score["digit_accuracy"] <= 0.2 and score["direction_accuracy"] <= 0.4, name  # measured 0.1, 0.1 / 0
    still = val.videos[:, :, :1].expand(-1, -1, 9, -1, -1)  # the digit, not moving: its digit, no direction
    score = score_prompt_adherence(still, val.digits, val.directions, prompts, train, val)
    assert score["digit_accuracy"] >= 0.9 and score["direction_accuracy"] == 0.0
