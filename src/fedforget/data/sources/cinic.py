"""CINIC-10 from ``CINIC-10.tar.gz`` (``{train,valid,test}/<class>/*.png``)."""

from __future__ import annotations

import os

import numpy as np

from .fetch import require_tree, require_unpacked
from .folders import by_class, check_val, class_folders, decode_splits
from .result import SourceArrays


def read_cinic10(
    root: str | os.PathLike,
    out_dir: str | os.PathLike,
    size: int = 32,
    val: str = "extra",
    download: bool = False,
    workers: int = 1,
) -> SourceArrays:
    """CINIC-10 (90000 images each in train, valid and test; 10 CIFAR classes) as uint8
    [N, 3, size, size]; its PNGs are 32x32, so the default size keeps their exact pixels.
    ``val``: the "valid" split into ``extra`` (``x_val``/``y_val``), appended to "train",
    or "drop"."""
    check_val("cinic10", val)
    tree = require_unpacked("cinic10", "CINIC-10.tar.gz", root, download)
    for split in ("train", "valid", "test"):
        require_tree("cinic10", tree / split, "folder")
    classes = class_folders(tree / "train", "cinic10")
    lists = {s: by_class(tree / s, classes) for s in ("train", "valid", "test")}
    if val == "train":
        lists["train"] = (
            lists["train"][0] + lists["valid"][0],
            np.concatenate([lists["train"][1], lists["valid"][1]]),
        )
    splits = {"train": "train", "test": "test", **({"val": "valid"} if val == "extra" else {})}
    x = decode_splits({k: lists[v][0] for k, v in splits.items()}, size, out_dir, workers)
    extra = {"x_val": x["val"], "y_val": lists["valid"][1]} if val == "extra" else {}
    return SourceArrays(
        x["train"], lists["train"][1], x["test"], lists["test"][1], tuple(classes), extra
    )
