"""Paper-scale dataset sources: each dataset read from its native on-disk format into
natural-dtype numpy arrays (:class:`SourceArrays`), with real download code and checksums.

Layout: every source's native files live under ``<root>/<source>/`` (``root`` is a raw-data
directory such as ``data/raw``), exactly as distributed (archives are unpacked beside
themselves). A missing or corrupt file is one :class:`~fedforget.utils.FedForgetError`
saying what is wrong and how to get the file; nothing is downloaded unless the caller passes
``download=True``.

======================  ==========================================  ==========================
name                    native files (under ``<root>/<source>/``)   x
======================  ==========================================  ==========================
cifar10, cifar100       cifar-10(0)-python.tar.gz (pickle batches)  uint8 [N, 3, 32, 32]
mnist                   {train,t10k}-{images,labels}-idx?-ubyte.gz  uint8 [N, 1, 28, 28]
svhn                    {train,test}_32x32.mat                      uint8 [N, 3, 32, 32]
pathmnist, tissuemnist  <name>.npz                                  uint8 [N, 3|1, 28, 28]
cinic10                 CINIC-10.tar.gz (PNG tree)                  uint8 [N, 3, S, S] memmap
tiny_imagenet           tiny-imagenet-200.zip (JPEG tree)           uint8 [N, 3, S, S] memmap
imagenet100             imagenet/{train,val}/<wnid>/ (no download)  uint8 [N, 3, S, S] memmap
imagenet_r              imagenet-r.tar (JPEG tree, seeded split)    uint8 [N, 3, S, S] memmap
domainnet               <domain>.zip + <domain>_{train,test}.txt    uint8 [N, 3, S, S] memmap
mnli snli sst2 sentiment140 marc yelp yahoo
                        a DatasetDict.save_to_disk folder           int64 token ids [N, L]
======================  ==========================================  ==========================

Labels are always int64 ``[N]``. Use :func:`read_source` with a name and the reader's
options, or the readers themselves.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Any

from ...utils import FedForgetError
from .cifar import read_cifar10, read_cifar100
from .cinic import read_cinic10
from .domainnet import read_domainnet
from .fetch import download, file_digest, require_file, require_unpacked, source_dir, unpack
from .imagenet import imagenet_r_split, read_imagenet100, read_imagenet_r
from .medmnist import read_medmnist
from .mnist import read_idx, read_mnist
from .result import SourceArrays
from .svhn import read_svhn
from .table import SOURCES, RemoteFile, Source, TextHub
from .text import read_text, tokenize
from .tiny_imagenet import read_tiny_imagenet

READERS: dict[str, Callable[..., SourceArrays]] = {
    "cifar10": read_cifar10,
    "cifar100": read_cifar100,
    "mnist": read_mnist,
    "svhn": read_svhn,
    "pathmnist": partial(read_medmnist, "pathmnist"),
    "tissuemnist": partial(read_medmnist, "tissuemnist"),
    "cinic10": read_cinic10,
    "tiny_imagenet": read_tiny_imagenet,
    "imagenet100": read_imagenet100,
    "imagenet_r": read_imagenet_r,
    "domainnet": read_domainnet,
    **{
        name: partial(read_text, name)
        for name in ("mnli", "snli", "sst2", "sentiment140", "marc", "yelp", "yahoo")
    },
}


def read_source(name: str, root: str | os.PathLike, **options: Any) -> SourceArrays:
    """Read dataset ``name`` from ``root`` with its reader's keyword options (``download``,
    ``out_dir`` and ``size`` for image folders, ``tokenizer`` and ``max_length`` for text)."""
    try:
        reader = READERS[name]
    except KeyError:
        raise FedForgetError(
            f"unknown dataset source '{name}'; allowed: {', '.join(sorted(READERS))}"
        ) from None
    return reader(root=root, **options)


__all__ = [
    "READERS",
    "SOURCES",
    "RemoteFile",
    "Source",
    "SourceArrays",
    "TextHub",
    "download",
    "file_digest",
    "imagenet_r_split",
    "read_cifar10",
    "read_cifar100",
    "read_cinic10",
    "read_domainnet",
    "read_idx",
    "read_imagenet100",
    "read_imagenet_r",
    "read_medmnist",
    "read_mnist",
    "read_source",
    "read_svhn",
    "read_text",
    "read_tiny_imagenet",
    "require_file",
    "require_unpacked",
    "source_dir",
    "tokenize",
    "unpack",
]
