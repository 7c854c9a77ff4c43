"""MedMNIST v2 (PathMNIST, TissueMNIST) from their ``.npz`` files."""

from __future__ import annotations

import os
import zipfile

import numpy as np

from ...utils import FedForgetError
from .fetch import get_source, require_file
from .result import SourceArrays

MEDMNIST = ("pathmnist", "tissuemnist")
VAL_CHOICES = ("extra", "train", "drop")


def _images(arr: np.ndarray) -> np.ndarray:
    arr = np.asarray(arr, dtype=np.uint8)
    if arr.ndim == 3:  # grayscale [N, H, W]
        return arr[:, None]
    return np.ascontiguousarray(arr.transpose(0, 3, 1, 2))  # RGB [N, H, W, 3]


def read_medmnist(
    name: str, root: str | os.PathLike, download: bool = False, val: str = "extra"
) -> SourceArrays:
    """PathMNIST (uint8 [N, 3, 28, 28], 9 classes) or TissueMNIST (uint8 [N, 1, 28, 28],
    8 classes) with the official train/val/test split. ``val`` says where the validation
    split goes: "extra" (``extra["x_val"]``, ``extra["y_val"]``), "train" (appended to the
    training split) or "drop"."""
    if name not in MEDMNIST:
        raise FedForgetError(f"unknown MedMNIST dataset '{name}'; allowed: {', '.join(MEDMNIST)}")
    if val not in VAL_CHOICES:
        raise FedForgetError(
            f"dataset '{name}': option val={val!r}; allowed: {', '.join(VAL_CHOICES)}"
        )
    path = require_file(name, f"{name}.npz", root, download)
    try:
        with np.load(path, allow_pickle=False) as npz:
            splits = {
                s: (_images(npz[f"{s}_images"]), npz[f"{s}_labels"].reshape(-1).astype(np.int64))
                for s in ("train", "val", "test")
            }
    except (KeyError, ValueError, OSError, zipfile.BadZipFile) as e:
        raise FedForgetError(
            f"dataset '{name}': cannot read {path} ({e}); expected the MedMNIST keys "
            "train_images, train_labels, val_images, val_labels, test_images, test_labels"
        ) from None
    (x_tr, y_tr), (x_val, y_val), (x_te, y_te) = splits["train"], splits["val"], splits["test"]
    extra = {}
    if val == "train":
        x_tr, y_tr = np.concatenate([x_tr, x_val]), np.concatenate([y_tr, y_val])
    elif val == "extra":
        extra = {"x_val": x_val, "y_val": y_val}
    return SourceArrays(x_tr, y_tr, x_te, y_te, get_source(name).class_names, extra)
