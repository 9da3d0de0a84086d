"""Sample quality you can measure: a classifier fitted on real images scores generated ones (the class-conditional
DiT's class accuracy, recipes/dit/evaluate.py; the text-to-image demo's prompt adherence, recipes/t2i/evaluate.py).

Only as meaningful as the classifier's own accuracy on real held-out images (`classifier_accuracy_on_real_val`
beside the score in eval.json): on the digits it is ~0.99.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

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


def fit_image_classifier(
    train: tuple[torch.Tensor, torch.Tensor], val: tuple[torch.Tensor, torch.Tensor], seed: int = 0
) -> tuple[SVC, float]:
    """An RBF SVM on real (images [N, C, S, S] in [-1, 1] at the model's resolution, labels [N]) training pairs;
    returns it and its accuracy on the `val` pairs."""
    from sklearn.svm import SVC  # here, not at the top: ~1 s of import that a run with trainer.eval=false never needs

    clf = SVC(gamma="scale", C=10.0, random_state=seed).fit(_features(train[0]).numpy(), train[1].numpy())
    return clf, float((clf.predict(_features(val[0]).numpy()) == val[1].numpy()).mean())


def score_samples(clf: SVC, images: torch.Tensor, labels: torch.Tensor, num_classes: int) -> dict:
    """Per-class and mean accuracy of the classifier on generated images ([-1, 1], [N, C, S, S]): the share of
    samples it reads as the class they were drawn for."""
    pred = clf.predict(_features(images.float()).numpy())
    y = labels.numpy()
    per_class = {str(c): float((pred[y == c] == c).mean()) for c in range(num_classes) if (y == c).any()}
    return {"mean_accuracy": float((pred == y).mean()), "per_class_accuracy": per_class, "num_samples": int(len(y))}


def class_labels(num_classes: int, per_class: int) -> torch.Tensor:
    """0,0,...,1,1,... : one grid row per class."""
    return torch.arange(num_classes).repeat_interleave(per_class)
