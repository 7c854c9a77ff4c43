"""Datasets that ship inside scikit-learn: Iris and the 8x8 digits (no network needed)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..utils import FedForgetError
from .base import DATASETS, Arrays, DatasetInfo

SPLIT_SEED = 0  # fixed train/test split: part of the dataset's definition


def _split(x: np.ndarray, y: np.ndarray, test_size: float):
    from sklearn.model_selection import train_test_split

    return train_test_split(x, y, test_size=test_size, stratify=y, random_state=SPLIT_SEED)


def build_iris(pca: int = 0) -> Arrays:
    """Iris, 120 train / 30 test (stratified), features standardised with train statistics;
    ``pca=2`` projects onto the first two principal components of the training split (the
    2-D view of the FedProj pilot study)."""
    from sklearn.datasets import load_iris
    from sklearn.decomposition import PCA

    bunch = load_iris()
    x_tr, x_te, y_tr, y_te = _split(bunch.data.astype(np.float64), bunch.target, 0.2)
    mu, sd = x_tr.mean(0), x_tr.std(0)
    x_tr, x_te = (x_tr - mu) / sd, (x_te - mu) / sd
    if pca:
        proj = PCA(n_components=pca, svd_solver="full").fit(x_tr)
        x_tr, x_te = proj.transform(x_tr), proj.transform(x_te)
    return Arrays(x_tr, y_tr, x_te, y_te, [str(n) for n in bunch.target_names])


def _check_iris(o: Mapping[str, Any]) -> None:
    pca = o["pca"]
    if isinstance(pca, bool) or not isinstance(pca, int) or pca not in (0, 1, 2, 3, 4):
        raise FedForgetError(
            f"dataset 'iris': option pca={pca!r}; allowed: 0 (off) or 1..4 components"
        )


DATASETS.register("iris")(
    DatasetInfo(
        name="iris",
        description="scikit-learn Iris (150 samples, 4 features, 3 classes); optional PCA view",
        build=build_iris,
        defaults={"pca": 0},
        input_shape=lambda o: (o["pca"] or 4,),
        num_classes=3,
        sizes=lambda o: (120, 30),
        check_options=_check_iris,
    )
)


def build_digits() -> Arrays:
    """scikit-learn's 8x8 handwritten digits as 1x8x8 images scaled to [0, 1];
    1347 train / 450 test (stratified, fixed seed)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images.astype(np.float64) / 16.0)[:, None, :, :]
    x_tr, x_te, y_tr, y_te = _split(x, bunch.target, 0.25)
    return Arrays(x_tr, y_tr, x_te, y_te, [str(i) for i in range(10)])


DATASETS.register("digits")(
    DatasetInfo(
        name="digits",
        description="scikit-learn 8x8 digits (1797 images, 10 classes) as 1x8x8 tensors",
        build=build_digits,
        defaults={},
        input_shape=lambda o: (1, 8, 8),
        num_classes=10,
        sizes=lambda o: (1347, 450),
    )
)
