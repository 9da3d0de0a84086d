"""The DiT's class accuracy: the shared classifier (common/diffusion/evaluate.py) fitted on the run's own image
dataset. For the digits this is the recipe's eval bar (dit_tiny: mean accuracy >= 0.95); on other image folders
it is a sanity check of class conditioning."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.diffusion.evaluate import MAX_PER_CLASS, fit_image_classifier
from common.diffusion.images import to_model_space
from recipes.dit.data import load_split_arrays

if TYPE_CHECKING:
    from sklearn.svm import SVC


def fit_classifier(data_root: str | Path, image_size: int, seed: int = 0) -> tuple[SVC, float]:
    """An RBF SVM on real training images at the model's resolution; returns it and its held-out accuracy."""

    def split(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = load_split_arrays(data_root, name, max_per_class=MAX_PER_CLASS)
        return to_model_space(torch.from_numpy(images), image_size), torch.from_numpy(labels)

    return fit_image_classifier(split("train"), split("val"), seed)
