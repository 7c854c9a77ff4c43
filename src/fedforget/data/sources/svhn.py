"""SVHN (cropped digits) from ``train_32x32.mat`` and ``test_32x32.mat``."""

from __future__ import annotations

import os

import numpy as np

from ...utils import FedForgetError
from .fetch import require_file
from .result import SourceArrays


def _read_mat(
    root: str | os.PathLike, filename: str, download: bool
) -> tuple[np.ndarray, np.ndarray]:
    from scipy.io import loadmat

    path = require_file("svhn", filename, root, download)
    try:
        mat = loadmat(path)
        x, y = mat["X"], mat["y"]
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise FedForgetError(f"dataset 'svhn': cannot read {path}: {e}") from None
    if x.ndim != 4 or x.shape[2] != 3 or x.shape[3] != y.size:
        raise FedForgetError(
            f"dataset 'svhn': {path}: X {x.shape} and y {y.shape} do not match "
            "(expected X [H, W, 3, N] and y [N, 1])"
        )
    # X is [H, W, C, N] (MATLAB's column-major layout); label 10 is the digit 0
    images = np.ascontiguousarray(x.transpose(3, 2, 0, 1), dtype=np.uint8)
    labels = y.reshape(-1).astype(np.int64)
    labels[labels == 10] = 0
    return images, labels


def read_svhn(root: str | os.PathLike, download: bool = False) -> SourceArrays:
    """SVHN: 73257 train / 26032 test images uint8 [N, 3, 32, 32], classes "0".."9" (the
    files' label 10 is the digit 0). The 531131 "extra" images are not read."""
    x_train, y_train = _read_mat(root, "train_32x32.mat", download)
    x_test, y_test = _read_mat(root, "test_32x32.mat", download)
    return SourceArrays(x_train, y_train, x_test, y_test, tuple(str(i) for i in range(10)))
