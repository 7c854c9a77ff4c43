"""CIFAR-10/100 readers on tiny archives in the official layout (python-pickle batches in a
tar.gz), written here; download through a local HTTP server."""

from __future__ import annotations

import io
import pickle
import tarfile

import numpy as np
import pytest

from fedforget.data.sources import read_cifar10, read_cifar100, read_source
from fedforget.utils import FedForgetError

C10_NAMES = [
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
]


def _pickle(obj) -> bytes:
    """A protocol-2 pickle, as the batches are, naming numpy's module as numpy 1 did."""
    return pickle.dumps(obj, protocol=2).replace(
        b"numpy._core.multiarray", b"numpy.core.multiarray"
    )


def _add(tar, name, data: bytes):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_cifar10(path, per_batch=2, seed=0):
    """Five training batches and a test batch of ``per_batch`` images each; keys are bytes,
    as Python 2's str keys load under ``encoding="bytes"``. Returns (x_train, y_train,
    x_test, y_test) as written."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            x = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
            y = [int(v) for v in rng.integers(0, 10, size=per_batch)]
            batch = {b"batch_label": name.encode(), b"labels": y, b"data": x,
                     b"filenames": [b"f.png"] * per_batch}  # fmt: skip
            _add(tar, f"cifar-10-batches-py/{name}", _pickle(batch))
            xs.append(x.reshape(-1, 3, 32, 32))
            ys.append(np.asarray(y, dtype=np.int64))
        meta = {b"label_names": [n.encode() for n in C10_NAMES], b"num_vis": 3072}
        _add(tar, "cifar-10-batches-py/batches.meta", _pickle(meta))
    return np.concatenate(xs[:5]), np.concatenate(ys[:5]), xs[5], ys[5]


def write_cifar100(path, n_train=6, n_test=4, seed=1):
    rng = np.random.default_rng(seed)
    out = {}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for split, n in (("train", n_train), ("test", n_test)):
            x = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
            fine = [int(v) for v in rng.integers(0, 100, size=n)]
            coarse = [f // 5 for f in fine]
            batch = {
                "data": x,
                "fine_labels": fine,
                "coarse_labels": coarse,
                "filenames": ["f"] * n,
            }
            _add(tar, f"cifar-100-python/{split}", _pickle(batch))
            out[split] = (x.reshape(-1, 3, 32, 32), np.asarray(fine), np.asarray(coarse))
        meta = {"fine_label_names": [f"fine{i}" for i in range(100)],
                "coarse_label_names": [f"coarse{i}" for i in range(20)]}  # fmt: skip
        _add(tar, "cifar-100-python/meta", _pickle(meta))
    return out


@pytest.fixture
def cifar10_root(tmp_path, patch_file, util):
    path = tmp_path / "cifar10" / "cifar-10-python.tar.gz"
    written = write_cifar10(path)
    patch_file("cifar10", path.name, md5=util.md5_of(path))
    return tmp_path, written


def test_cifar10_reads_pixels_labels_and_names(cifar10_root):
    root, (x_train, y_train, x_test, y_test) = cifar10_root
    d = read_cifar10(root)
    assert d.x_train.shape == (10, 3, 32, 32) and d.x_train.dtype == np.uint8
    assert d.x_test.shape == (2, 3, 32, 32) and d.y_test.dtype == np.int64
    np.testing.assert_array_equal(d.x_train, x_train)
    np.testing.assert_array_equal(d.y_train, y_train)
    np.testing.assert_array_equal(d.x_test, x_test)
    np.testing.assert_array_equal(d.y_test, y_test)
    assert d.class_names == tuple(C10_NAMES) and d.num_classes == 10
    again = read_source("cifar10", root)
    assert again.x_train.tobytes() == d.x_train.tobytes()  # deterministic
    assert again.y_train.tobytes() == d.y_train.tobytes()


def test_cifar100_fine_labels_and_coarse_extra(tmp_path, patch_file, util):
    path = tmp_path / "cifar100" / "cifar-100-python.tar.gz"
    written = write_cifar100(path)
    patch_file("cifar100", path.name, md5=util.md5_of(path))
    d = read_cifar100(tmp_path)
    np.testing.assert_array_equal(d.x_train, written["train"][0])
    np.testing.assert_array_equal(d.y_train, written["train"][1])
    np.testing.assert_array_equal(d.x_test, written["test"][0])
    np.testing.assert_array_equal(d.extra["coarse_test"], written["test"][2])
    assert d.y_test.dtype == np.int64 and d.extra["coarse_train"].dtype == np.int64
    assert d.class_names[7] == "fine7" and len(d.class_names) == 100
    assert d.extra["coarse_names"][19] == "coarse19"


def test_cifar10_missing_and_corrupt(tmp_path, cifar10_root, util):
    with pytest.raises(FedForgetError) as e:
        read_cifar10(tmp_path / "elsewhere")
    msg = str(e.value)
    assert "dataset 'cifar10'" in msg and "is missing" in msg
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in msg
    root, _ = cifar10_root
    path = root / "cifar10" / "cifar-10-python.tar.gz"
    good = util.md5_of(path)
    util.flip_byte(path, 100)
    with pytest.raises(FedForgetError) as e:
        read_cifar10(root)
    assert f"md5 expected {good}, got {util.md5_of(path)}" in str(e.value)


def test_cifar_refuses_pickles_that_build_other_objects(tmp_path, patch_file, util):
    path = tmp_path / "cifar10" / "cifar-10-python.tar.gz"
    path.parent.mkdir()
    with tarfile.open(path, "w:gz") as tar:
        _add(tar, "cifar-10-batches-py/data_batch_1", pickle.dumps({"x": print}, protocol=2))
    patch_file("cifar10", path.name, md5=util.md5_of(path))
    with pytest.raises(FedForgetError, match=r"global \w+\.print is not allowed"):
        read_cifar10(tmp_path)


def test_cifar_archive_without_the_batches(tmp_path, patch_file, util):
    path = tmp_path / "cifar100" / "cifar-100-python.tar.gz"
    path.parent.mkdir()
    with tarfile.open(path, "w:gz") as tar:
        _add(tar, "cifar-100-python/train", _pickle({"data": np.zeros((1, 3072), np.uint8)}))
    patch_file("cifar100", path.name, md5=util.md5_of(path))
    with pytest.raises(
        FedForgetError, match="no member.*cifar-100-python/test, cifar-100-python/meta"
    ):
        read_cifar100(tmp_path)


def test_cifar10_download_offline(http_dir, tmp_path, patch_file, util):
    served, url = http_dir
    x_train, *_ = write_cifar10(served / "cifar-10-python.tar.gz")
    patch_file(
        "cifar10",
        "cifar-10-python.tar.gz",
        urls=(url + "cifar-10-python.tar.gz",),
        md5=util.md5_of(served / "cifar-10-python.tar.gz"),
    )
    with pytest.raises(FedForgetError, match="is missing"):
        read_cifar10(tmp_path / "raw")  # no download unless allowed
    d = read_cifar10(tmp_path / "raw", download=True)
    np.testing.assert_array_equal(d.x_train, x_train)
    assert (tmp_path / "raw" / "cifar10" / "cifar-10-python.tar.gz").is_file()
