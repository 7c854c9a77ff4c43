"""MNIST from its four gzipped IDX files (``train-images-idx3-ubyte.gz`` ...)."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

from ...utils import FedForgetError
from .fetch import require_file
from .result import SourceArrays

IDX_UBYTE = 0x08


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """An IDX file of unsigned bytes (gzipped or not) as a uint8 array of its shape: the
    header is two zero bytes, the type code (0x08 = ubyte), the number of dimensions, then
    each dimension as a big-endian uint32."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise FedForgetError(f"cannot read IDX file {path}: {e}") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != IDX_UBYTE:
        raise FedForgetError(
            f"{path} is not an IDX file of unsigned bytes (magic {data[:4].hex()}; "
            "allowed: 000008NN)"
        )
    ndim = data[3]
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    offset = 4 + 4 * ndim
    if len(data) - offset != int(np.prod(dims)):
        raise FedForgetError(
            f"IDX file {path}: header says {dims} ({int(np.prod(dims))} bytes), "
            f"body has {len(data) - offset}"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(dims).copy()


def read_mnist(root: str | os.PathLike, download: bool = False) -> SourceArrays:
    """MNIST: 60000 train / 10000 test images uint8 [N, 1, 28, 28], classes "0".."9"."""
    arrays = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images = read_idx(require_file("mnist", f"{prefix}-images-idx3-ubyte.gz", root, download))
        labels = read_idx(require_file("mnist", f"{prefix}-labels-idx1-ubyte.gz", root, download))
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise FedForgetError(
                f"dataset 'mnist': {split} images {images.shape} and labels {labels.shape} "
                "do not match (expected [N, 28, 28] and [N])"
            )
        arrays[split] = (images[:, None], labels.astype(np.int64))
    return SourceArrays(
        *arrays["train"], *arrays["test"], class_names=tuple(str(i) for i in range(10))
    )
