"""MNIST reader on tiny gzipped IDX files written here."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from fedforget.data.sources import read_idx, read_mnist
from fedforget.utils import FedForgetError

FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


def idx_bytes(arr: np.ndarray) -> bytes:
    """The IDX encoding of a uint8 array: 0, 0, 0x08, ndim, big-endian dims, the bytes."""
    header = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + np.ascontiguousarray(arr, dtype=np.uint8).tobytes()


@pytest.fixture
def mnist_root(tmp_path, patch_file, util):
    rng = np.random.default_rng(0)
    base = tmp_path / "mnist"
    base.mkdir()
    written = {}
    for split, n in (("train", 7), ("test", 3)):
        x = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        y = rng.integers(0, 10, size=n).astype(np.uint8)
        for fn, arr in zip(FILES[split], (x, y)):
            (base / fn).write_bytes(gzip.compress(idx_bytes(arr)))
            patch_file("mnist", fn, md5=util.md5_of(base / fn))
        written[split] = (x, y)
    return tmp_path, written


def test_mnist_reads_idx_files(mnist_root):
    root, written = mnist_root
    d = read_mnist(root)
    assert d.x_train.shape == (7, 1, 28, 28) and d.x_train.dtype == np.uint8
    assert d.y_train.dtype == np.int64 and d.x_test.shape == (3, 1, 28, 28)
    np.testing.assert_array_equal(d.x_train[:, 0], written["train"][0])
    np.testing.assert_array_equal(d.y_train, written["train"][1])
    np.testing.assert_array_equal(d.x_test[:, 0], written["test"][0])
    np.testing.assert_array_equal(d.y_test, written["test"][1])
    assert d.class_names == tuple(str(i) for i in range(10))
    assert read_mnist(root).x_train.tobytes() == d.x_train.tobytes()


def test_mnist_missing_file_names_mirror_and_place(mnist_root):
    root, _ = mnist_root
    (root / "mnist" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FedForgetError) as e:
        read_mnist(root)
    msg = str(e.value)
    assert "dataset 'mnist'" in msg and "t10k-labels-idx1-ubyte.gz is missing" in msg
    assert "https://ossci-datasets.s3.amazonaws.com/mnist/t10k-labels-idx1-ubyte.gz" in msg


def test_mnist_corrupt_file(mnist_root, util):
    root, _ = mnist_root
    path = root / "mnist" / "train-images-idx3-ubyte.gz"
    good = util.md5_of(path)
    util.flip_byte(path, -10)
    with pytest.raises(FedForgetError, match=f"md5 expected {good}, got {util.md5_of(path)}"):
        read_mnist(root)


def test_read_idx_rejects_other_types_and_short_bodies(tmp_path):
    (tmp_path / "f.idx").write_bytes(bytes([0, 0, 0x0D, 1, 0, 0, 0, 1]) + b"\0\0\0\0")
    with pytest.raises(FedForgetError, match="not an IDX file of unsigned bytes"):
        read_idx(tmp_path / "f.idx")
    (tmp_path / "g.idx").write_bytes(idx_bytes(np.zeros((2, 3), np.uint8))[:-1])
    with pytest.raises(FedForgetError, match=r"header says \(2, 3\)"):
        read_idx(tmp_path / "g.idx")
