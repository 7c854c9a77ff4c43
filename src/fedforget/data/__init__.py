"""Datasets: a registry of sources (one module each), the prepared on-disk format and
public/proxy sets.

Prepared format (``data/<dataset_id>/``), chosen to be byte-deterministic so DVC hashes
reproduce on every machine::

    x_train.npy  float32 [N, *input_shape]   (np.save, no pickle)
    y_train.npy  int64   [N]
    x_test.npy   float32 [M, *input_shape]
    y_test.npy   int64   [M]
    meta.json    id, source, options, shapes, class names and the sha256 of every array file

Public (proxy) sets held out of a training split live in ``data/public/<public_id>/``
with ``x.npy``, ``y.npy``, ``indices.npy`` (rows of the source training split) and
``meta.json``; a public set that is another dataset is that dataset's training split.
"""

from . import sklearn_sets, synthetic  # noqa: F401  (register the sources)
from .base import (
    DATASETS,
    DatasetInfo,
    PublicSet,
    TensorData,
    dataset_id,
    load_dataset,
    load_public,
    prepare_dataset,
    prepare_public,
    public_id,
)

__all__ = [
    "DATASETS",
    "DatasetInfo",
    "PublicSet",
    "TensorData",
    "dataset_id",
    "load_dataset",
    "load_public",
    "prepare_dataset",
    "prepare_public",
    "public_id",
]
