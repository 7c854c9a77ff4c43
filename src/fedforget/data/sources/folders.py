"""Shared pieces of the image-folder readers (CINIC-10, Tiny-ImageNet, ImageNet-100,
ImageNet-R, DomainNet): sorted file lists per class folder and the decoding of every split
into memory-mapped ``<out_dir>/x_<split>.npy`` files.

Each reader lists its files in a sorted order and decodes them (PIL, RGB, shorter side
resized to ``size`` and centre-cropped) into those files, which it returns read-only; a rerun
writes byte-identical files. ``out_dir`` is where the caller wants the decoded arrays (the
prepared dataset's directory, typically).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from ...utils import FedForgetError
from .images import decode_to_npy, list_images

VAL_CHOICES = ("extra", "train", "drop")


def decode_splits(
    files: Mapping[str, Sequence[Path]], size: int, out_dir: str | os.PathLike, workers: int
) -> dict[str, np.ndarray]:
    out_dir = Path(out_dir)
    return {
        split: decode_to_npy(paths, size, out_dir / f"x_{split}.npy", workers, desc=f"x_{split}")
        for split, paths in files.items()
    }


def class_folders(split_dir: Path, dataset: str) -> list[str]:
    classes = sorted(p.name for p in split_dir.iterdir() if p.is_dir())
    if not classes:
        raise FedForgetError(f"dataset '{dataset}': {split_dir} holds no class folders")
    return classes


def by_class(
    split_dir: Path, classes: Sequence[str], sub: str = ""
) -> tuple[list[Path], np.ndarray]:
    """Files of each class folder (``split_dir/<class>/<sub>``), class by class, sorted."""
    paths: list[Path] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        found = list_images(split_dir / cls / sub if sub else split_dir / cls)
        paths += found
        labels += [label] * len(found)
    return paths, np.asarray(labels, dtype=np.int64)


def check_val(dataset: str, val: str) -> None:
    if val not in VAL_CHOICES:
        raise FedForgetError(
            f"dataset '{dataset}': option val={val!r}; allowed: {', '.join(VAL_CHOICES)}"
        )
