"""SVHN reader on tiny .mat files written with scipy.io.savemat."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.io import savemat

from fedforget.data.sources import read_svhn
from fedforget.utils import FedForgetError


@pytest.fixture
def svhn_root(tmp_path, patch_file, util):
    rng = np.random.default_rng(0)
    base = tmp_path / "svhn"
    base.mkdir()
    written = {}
    for split, n in (("train", 5), ("test", 4)):
        x = rng.integers(
            0, 256, size=(32, 32, 3, n), dtype=np.uint8
        )  # [H, W, C, N] as in the files
        y = np.array([[10], [1], [9], [10], [3]][:n], dtype=np.uint8)  # 10 is the digit 0
        savemat(base / f"{split}_32x32.mat", {"X": x, "y": y})
        patch_file("svhn", f"{split}_32x32.mat", md5=util.md5_of(base / f"{split}_32x32.mat"))
        written[split] = (x, y)
    return tmp_path, written


def test_svhn_layout_and_label_ten_is_zero(svhn_root):
    root, written = svhn_root
    d = read_svhn(root)
    assert d.x_train.shape == (5, 3, 32, 32) and d.x_train.dtype == np.uint8
    assert d.x_test.shape == (4, 3, 32, 32) and d.y_train.dtype == np.int64
    x = written["train"][0]
    # image i, channel c, row r, column k is X[r, k, c, i]
    assert d.x_train[2, 1, 3, 4] == x[3, 4, 1, 2]
    np.testing.assert_array_equal(d.x_train, x.transpose(3, 2, 0, 1))
    np.testing.assert_array_equal(d.y_train, [0, 1, 9, 0, 3])
    np.testing.assert_array_equal(d.y_test, [0, 1, 9, 0])
    assert d.class_names == tuple(str(i) for i in range(10))
    assert read_svhn(root).x_test.tobytes() == d.x_test.tobytes()


def test_svhn_missing_and_corrupt(svhn_root, util):
    root, _ = svhn_root
    path = root / "svhn" / "test_32x32.mat"
    good = util.md5_of(path)
    util.flip_byte(path, 200)
    with pytest.raises(FedForgetError, match=f"md5 expected {good}, got {util.md5_of(path)}"):
        read_svhn(root)
    path.unlink()
    with pytest.raises(FedForgetError) as e:
        read_svhn(root)
    assert "dataset 'svhn'" in str(e.value)
    assert "http://ufldl.stanford.edu/housenumbers/test_32x32.mat" in str(e.value)
