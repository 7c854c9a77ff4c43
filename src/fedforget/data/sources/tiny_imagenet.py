"""Tiny-ImageNet-200 from ``tiny-imagenet-200.zip`` (``train/<wnid>/images/*.JPEG``,
``val/images`` with ``val/val_annotations.txt``, ``wnids.txt``, ``words.txt``)."""

from __future__ import annotations

import os

import numpy as np

from ...utils import FedForgetError
from .fetch import require_tree, require_unpacked
from .folders import by_class, decode_splits
from .images import list_images, read_wnid_names
from .result import SourceArrays


def read_tiny_imagenet(
    root: str | os.PathLike,
    out_dir: str | os.PathLike,
    size: int = 64,
    download: bool = False,
    workers: int = 1,
) -> SourceArrays:
    """Tiny-ImageNet-200: 100000 train images (500 per class) and its 10000 labelled
    validation images as the test split (the official test labels are not public), uint8
    [N, 3, size, size] (native 64). Classes are the sorted wnids of ``wnids.txt``; class
    names come from ``words.txt``."""
    tree = require_unpacked("tiny_imagenet", "tiny-imagenet-200.zip", root, download)
    wnids_file = tree / "wnids.txt"
    if not wnids_file.is_file():
        raise FedForgetError(
            f"dataset 'tiny_imagenet': {wnids_file} is missing; unpack the archive again"
        )
    wnids = sorted({w.strip() for w in wnids_file.read_text().splitlines() if w.strip()})
    index = {w: i for i, w in enumerate(wnids)}
    train_paths, y_train = by_class(
        require_tree("tiny_imagenet", tree / "train", "folder"), wnids, "images"
    )
    annotations = tree / "val" / "val_annotations.txt"
    if not annotations.is_file():
        raise FedForgetError(
            f"dataset 'tiny_imagenet': {annotations} is missing; unpack the archive again"
        )
    val_label = {}
    for line in annotations.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) >= 2:
            if parts[1] not in index:
                raise FedForgetError(
                    f"dataset 'tiny_imagenet': {annotations}: {parts[0]} has wnid {parts[1]}, "
                    "which is not in wnids.txt"
                )
            val_label[parts[0]] = index[parts[1]]
    test_paths = [p for p in list_images(tree / "val" / "images") if p.name in val_label]
    y_test = np.asarray([val_label[p.name] for p in test_paths], dtype=np.int64)
    words = read_wnid_names(tree / "words.txt")
    x = decode_splits({"train": train_paths, "test": test_paths}, size, out_dir, workers)
    return SourceArrays(
        x["train"],
        y_train,
        x["test"],
        y_test,
        tuple(words.get(w, w) for w in wnids),
        {"wnids": tuple(wnids)},
    )
