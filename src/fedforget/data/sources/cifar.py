"""CIFAR-10 and CIFAR-100 from the python-pickle batches inside their ``.tar.gz``.

The archive is read in place (no unpacking). Pickles run code when loaded, so they are
loaded only after the archive's md5 matched, and through an unpickler that builds nothing but
dicts, lists, strings, numbers and numpy arrays.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from ...utils import FedForgetError
from .fetch import require_file
from .result import SourceArrays

log = logging.getLogger(__name__)

_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),  # protocol-2 pickles of bytes
}


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")


def _load_batches(archive: Path, dataset: str, members: list[str]) -> dict[str, dict]:
    """The pickled dicts ``members`` of a CIFAR archive, read in one pass over the tar (its
    members are in no particular order, and seeking back in a .gz means decompressing
    again)."""
    wanted, out = set(members), {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for info in tar:
                if info.name not in wanted or not info.isfile():
                    continue
                data = tar.extractfile(info).read()
                # latin1: the batches were pickled by Python 2 (str keys, buffers as str)
                obj = _ArrayUnpickler(io.BytesIO(data), encoding="latin1").load()
                out[info.name] = {
                    k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()
                }
    except (tarfile.TarError, EOFError, OSError) as e:
        raise FedForgetError(
            f"dataset '{dataset}': cannot read {archive} ({e}); delete it and fetch it again"
        ) from None
    except (pickle.UnpicklingError, ValueError, TypeError, AttributeError) as e:
        raise FedForgetError(
            f"dataset '{dataset}': cannot read a batch in {archive}: {e}"
        ) from None
    missing = [m for m in members if m not in out]
    if missing:
        raise FedForgetError(
            f"dataset '{dataset}': {archive} has no member(s) {', '.join(missing)}; it is not "
            "the CIFAR python archive: delete it and fetch it again"
        )
    return out


def _names(values: list) -> tuple[str, ...]:
    return tuple(v.decode("latin1") if isinstance(v, bytes) else str(v) for v in values)


def _images(batch: dict) -> np.ndarray:
    data = np.asarray(batch["data"], dtype=np.uint8)
    return data.reshape(len(data), 3, 32, 32)


def read_cifar10(root: str | os.PathLike, download: bool = False) -> SourceArrays:
    """CIFAR-10: 50000 train / 10000 test images uint8 [N, 3, 32, 32], 10 classes."""
    archive = require_file("cifar10", "cifar-10-python.tar.gz", root, download)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]
    got = _load_batches(archive, "cifar10", [f"cifar-10-batches-py/{n}" for n in names])
    *train, test, meta = (got[f"cifar-10-batches-py/{n}"] for n in names)
    return SourceArrays(
        x_train=np.concatenate([_images(b) for b in train]),
        y_train=np.concatenate([np.asarray(b["labels"], dtype=np.int64) for b in train]),
        x_test=_images(test),
        y_test=np.asarray(test["labels"], dtype=np.int64),
        class_names=_names(meta["label_names"]),
    )


def read_cifar100(root: str | os.PathLike, download: bool = False) -> SourceArrays:
    """CIFAR-100 with its 100 fine labels: 50000 train / 10000 test images uint8
    [N, 3, 32, 32]. The 20 coarse labels are in ``extra`` (``coarse_train``,
    ``coarse_test``, ``coarse_names``)."""
    archive = require_file("cifar100", "cifar-100-python.tar.gz", root, download)
    names = [f"cifar-100-python/{n}" for n in ("train", "test", "meta")]
    got = _load_batches(archive, "cifar100", names)
    train, test, meta = (got[n] for n in names)
    return SourceArrays(
        x_train=_images(train),
        y_train=np.asarray(train["fine_labels"], dtype=np.int64),
        x_test=_images(test),
        y_test=np.asarray(test["fine_labels"], dtype=np.int64),
        class_names=_names(meta["fine_label_names"]),
        extra={
            "coarse_train": np.asarray(train["coarse_labels"], dtype=np.int64),
            "coarse_test": np.asarray(test["coarse_labels"], dtype=np.int64),
            "coarse_names": _names(meta["coarse_label_names"]),
        },
    )
