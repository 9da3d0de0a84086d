"""Sample quality you can measure: a classifier fitted on the real images scores generated ones.

For the digits this is the recipe's eval bar (dit_tiny: mean accuracy >= 0.95). On other image
folders it is a sanity check of class conditioning, only as meaningful as the classifier's own
accuracy on real held-out images (`classifier_accuracy_on_real_val` beside it in eval.json).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from common.diffusion.images import to_model_space
from recipes.dit.data import load_split_arrays

if TYPE_CHECKING:
    from sklearn.svm import SVC

# An RBF SVM on raw pixels: images larger than this are compared at this size, and at most
# MAX_PER_CLASS real images per class fit it, so the fit stays seconds on big datasets.
FEATURE_SIZE = 32
MAX_PER_CLASS = 500


def _features(images: torch.Tensor) -> torch.Tensor:
    if images.shape[-1] > FEATURE_SIZE:
        images = F.interpolate(
            images, size=(FEATURE_SIZE, FEATURE_SIZE), mode="bilinear", antialias=True, align_corners=False
        )
    return images.flatten(1)


def fit_classifier(data_root: str | Path, image_size: int, seed: int = 0) -> tuple[SVC, float]:
    """An RBF SVM on real training images at the model's resolution; returns it and its held-out accuracy."""
    from sklearn.svm import SVC  # here, not at the top: ~1 s of import that a run with trainer.eval=false never needs

    def features(split: str):
        images, labels = load_split_arrays(data_root, split, max_per_class=MAX_PER_CLASS)
        return _features(to_model_space(torch.from_numpy(images), image_size)).numpy(), labels

    x_train, y_train = features("train")
    x_val, y_val = features("val")
    clf = SVC(gamma="scale", C=10.0, random_state=seed).fit(x_train, y_train)
    return clf, float((clf.predict(x_val) == y_val).mean())


def score_samples(clf: SVC, images: torch.Tensor, labels: torch.Tensor, num_classes: int) -> dict:
    """Per-class and mean accuracy of the classifier on generated images ([-1, 1], [N, C, S, S])."""
    pred = clf.predict(_features(images).numpy())
    y = labels.numpy()
    per_class = {str(c): float((pred[y == c] == c).mean()) for c in range(num_classes)}
    return {"mean_accuracy": float((pred == y).mean()), "per_class_accuracy": per_class, "num_samples": int(len(y))}


def class_labels(num_classes: int, per_class: int) -> torch.Tensor:
    """0,0,...,1,1,... : one grid row per class."""
    return torch.arange(num_classes).repeat_interleave(per_class)
