"""Sample quality you can measure: a classifier fitted on real digits scores generated ones."""

from __future__ import annotations

from pathlib import Path

import torch
from sklearn.svm import SVC

from recipes.dit.data import load_split_arrays, to_model_space


def fit_digit_classifier(data_root: str | Path, image_size: int, seed: int = 0) -> tuple[SVC, float]:
    """An RBF SVM on real training digits at the model's resolution; returns it and its held-out accuracy."""
    def features(split: str):
        images, labels = load_split_arrays(data_root, split)
        x = to_model_space(torch.from_numpy(images), image_size).flatten(1).numpy()
        return x, labels

    x_train, y_train = features("train")
    x_val, y_val = features("val")
    clf = SVC(gamma="scale", C=10.0, random_state=seed).fit(x_train, y_train)
    return clf, float((clf.predict(x_val) == y_val).mean())


def score_samples(clf: SVC, images: torch.Tensor, labels: torch.Tensor, num_classes: int) -> dict:
    """Per-class and mean accuracy of the classifier on generated images ([-1, 1], [N, 1, S, S])."""
    pred = clf.predict(images.flatten(1).numpy())
    y = labels.numpy()
    per_class = {str(c): float((pred[y == c] == c).mean()) for c in range(num_classes)}
    return {"mean_accuracy": float((pred == y).mean()), "per_class_accuracy": per_class, "num_samples": int(len(y))}


def class_labels(num_classes: int, per_class: int) -> torch.Tensor:
    """0,0,...,1,1,... : one grid row per class."""
    return torch.arange(num_classes).repeat_interleave(per_class)
