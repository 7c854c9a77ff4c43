"""ImageNet-100 (a 100-class subset of an ImageNet-style folder tree) and ImageNet-R
(``imagenet-r.tar``: ``imagenet-r/<wnid>/*.jpg``, with a seeded stratified split)."""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ...utils import FedForgetError
from .fetch import require_tree, require_unpacked, source_dir
from .folders import by_class, class_folders, decode_splits
from .images import list_images, read_wnid_names
from .result import SourceArrays
from .table import IMAGENET100_WNIDS


def read_imagenet100(
    root: str | os.PathLike,
    out_dir: str | os.PathLike,
    size: int = 224,
    workers: int = 1,
    wnids: Sequence[str] = IMAGENET100_WNIDS,
) -> SourceArrays:
    """ImageNet-100: the 100 classes of ``wnids`` (default: CMC's list) read from an
    ImageNet-style tree ``<root>/imagenet/{train,val}/<wnid>/*.JPEG``; the 50 validation
    images per class are the test split. About 126700 train / 5000 test images, uint8
    [N, 3, size, size]; at size 224 that is ~19 GB on disk (memory-mapped). Classes are the
    sorted wnids; names from ``words.txt`` or ``LOC_synset_mapping.txt`` beside ``train``
    when present, else the wnids. ImageNet has no download: see the error text."""
    base = require_tree("imagenet", source_dir(root, "imagenet"), "folder", "imagenet100")
    wnids = sorted(wnids)
    lists = {}
    for split in ("train", "val"):
        split_dir = require_tree("imagenet", base / split, "folder", "imagenet100")
        missing = [w for w in wnids if not (split_dir / w).is_dir()]
        if missing:
            raise FedForgetError(
                f"dataset 'imagenet100': {len(missing)} of its classes have no folder in "
                f"{split_dir} (first: {', '.join(missing[:5])}); the tree must hold "
                f"{split}/<wnid>/ for every ImageNet-1k class (or at least these 100)"
            )
        lists[split] = by_class(split_dir, wnids)
    names = read_wnid_names(base / "words.txt", base / "LOC_synset_mapping.txt")
    x = decode_splits({"train": lists["train"][0], "test": lists["val"][0]}, size, out_dir, workers)
    return SourceArrays(
        x["train"], lists["train"][1], x["test"], lists["val"][1],
        tuple(names.get(w, w) for w in wnids), {"wnids": tuple(wnids)},
    )  # fmt: skip


def imagenet_r_split(
    n: int, wnid: str, test_fraction: float, split_seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, test rows) of one class of ``n`` sorted files: ``round(test_fraction *
    n)`` rows drawn for test by a generator seeded with (``split_seed``, the wnid's crc32),
    so each class's split depends on nothing else. Both sorted."""
    rng = np.random.default_rng(
        np.random.SeedSequence([int(split_seed), zlib.crc32(wnid.encode())])
    )
    n_test = int(np.floor(test_fraction * n + 0.5))
    perm = rng.permutation(n)
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def read_imagenet_r(
    root: str | os.PathLike,
    out_dir: str | os.PathLike,
    size: int = 224,
    test_fraction: float = 0.2,
    split_seed: int = 0,
    download: bool = False,
    workers: int = 1,
) -> SourceArrays:
    """ImageNet-R: 30000 renditions of 200 ImageNet classes (``imagenet-r/<wnid>/*.jpg``),
    uint8 [N, 3, size, size]. There is no official split: each class is split
    ``1 - test_fraction`` / ``test_fraction`` (default 80/20) by :func:`imagenet_r_split`
    with ``split_seed`` (part of the dataset's definition). Classes are the sorted wnids."""
    if not 0.0 < float(test_fraction) < 1.0:
        raise FedForgetError(
            f"dataset 'imagenet_r': option test_fraction={test_fraction!r}; allowed: 0 < f < 1"
        )
    tree = require_unpacked("imagenet_r", "imagenet-r.tar", root, download)
    wnids = class_folders(tree, "imagenet_r")
    parts: dict[str, tuple[list[Path], list[int]]] = {"train": ([], []), "test": ([], [])}
    for label, wnid in enumerate(wnids):
        files = list_images(tree / wnid)
        for split, rows in zip(
            ("train", "test"), imagenet_r_split(len(files), wnid, test_fraction, split_seed)
        ):
            parts[split][0].extend(files[i] for i in rows)
            parts[split][1].extend([label] * len(rows))
    names = read_wnid_names(tree / "README.txt")
    x = decode_splits({s: p[0] for s, p in parts.items()}, size, out_dir, workers)
    return SourceArrays(
        x["train"], np.asarray(parts["train"][1], dtype=np.int64),
        x["test"], np.asarray(parts["test"][1], dtype=np.int64),
        tuple(names.get(w, w) for w in wnids), {"wnids": tuple(wnids)},
    )  # fmt: skip
