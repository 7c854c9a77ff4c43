"""Datasets: a registry of sources (one module each), the prepared on-disk format and
public/proxy sets.

Prepared format (``data/<dataset_id>/``), chosen to be byte-deterministic so DVC hashes
reproduce on every machine::

    x_train.npy  [N, *input_shape] in its natural dtype (np.save, no pickle): float32
                 features, uint8 images, int64 token ids (base.stored_inputs)
    y_train.npy  int64   [N]
    x_test.npy   [M, *input_shape], as x_train
    y_test.npy   int64   [M]
    meta.json    id, source, options, shapes, class names, the sha256 of every array file and,
                 for uint8 images, the training split's per-channel mean and std
                 (``normalize``: how ``fedforget.inputs`` turns stored rows into model inputs);
                 a multi-domain dataset's rows per domain of each split (``domains``: rows
                 are grouped by domain, base.domain_counts)

The paper datasets (``paper_sets``: CIFAR, MNIST, SVHN, MedMNIST, the image-folder sets and
the text sets) are built from native files under a raw-data directory (default
``data/raw``), given to their build as ``base.RawData``: a location, never part of an id.

Public (proxy) sets held out of a training split live in ``data/public/<public_id>/``
with ``x.npy``, ``y.npy``, ``indices.npy`` (rows of the source training split) and
``meta.json``; a public set that is another dataset is that dataset's training split.
"""

from . import paper_sets, sklearn_sets, synthetic  # noqa: F401  (register the sources)
from .base import (
    DATASETS,
    DatasetInfo,
    PublicSet,
    RawData,
    TensorData,
    dataset_id,
    load_dataset,
    load_public,
    prepare_dataset,
    prepare_public,
    public_dir,
    public_id,
)

__all__ = [
    "DATASETS",
    "DatasetInfo",
    "PublicSet",
    "RawData",
    "TensorData",
    "dataset_id",
    "load_dataset",
    "load_public",
    "prepare_dataset",
    "prepare_public",
    "public_dir",
    "public_id",
]
