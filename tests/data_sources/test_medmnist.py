"""PathMNIST and TissueMNIST readers on tiny .npz files in MedMNIST's layout."""

from __future__ import annotations

import numpy as np
import pytest

from fedforget.data.sources import read_medmnist, read_source
from fedforget.data.sources.table import SOURCES
from fedforget.utils import FedForgetError

SIZES = {"train": 6, "val": 2, "test": 3}


def write_medmnist(path, rgb: bool, n_classes: int, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, n in SIZES.items():
        shape = (n, 28, 28, 3) if rgb else (n, 28, 28)
        arrays[f"{split}_images"] = rng.integers(0, 256, size=shape, dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, n_classes, size=(n, 1)).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
    return arrays


@pytest.mark.parametrize("name,rgb,classes", [("pathmnist", True, 9), ("tissuemnist", False, 8)])
def test_medmnist_layout_labels_and_val(tmp_path, patch_file, util, name, rgb, classes):
    path = tmp_path / name / f"{name}.npz"
    w = write_medmnist(path, rgb, classes)
    patch_file(name, path.name, md5=util.md5_of(path))
    d = read_source(name, tmp_path)
    c = 3 if rgb else 1
    assert d.x_train.shape == (6, c, 28, 28) and d.x_train.dtype == np.uint8
    assert d.x_test.shape == (3, c, 28, 28) and d.y_test.dtype == np.int64
    expect = w["train_images"].transpose(0, 3, 1, 2) if rgb else w["train_images"][:, None]
    np.testing.assert_array_equal(d.x_train, expect)
    np.testing.assert_array_equal(d.y_train, w["train_labels"][:, 0])
    np.testing.assert_array_equal(d.y_test, w["test_labels"][:, 0])
    np.testing.assert_array_equal(d.extra["y_val"], w["val_labels"][:, 0])
    assert d.extra["x_val"].shape == (2, c, 28, 28)
    assert d.class_names == SOURCES[name].class_names and len(d.class_names) == classes
    merged = read_medmnist(name, tmp_path, val="train")
    assert merged.x_train.shape[0] == 8 and not merged.extra
    np.testing.assert_array_equal(merged.y_train[6:], w["val_labels"][:, 0])
    assert read_medmnist(name, tmp_path, val="drop").x_train.tobytes() == d.x_train.tobytes()


def test_medmnist_errors(tmp_path, patch_file, util):
    with pytest.raises(FedForgetError) as e:
        read_medmnist("pathmnist", tmp_path)
    assert "dataset 'pathmnist'" in str(e.value)
    assert "https://zenodo.org/records/10519652/files/pathmnist.npz" in str(e.value)
    with pytest.raises(FedForgetError, match="val='both'; allowed: extra, train, drop"):
        read_medmnist("pathmnist", tmp_path, val="both")
    with pytest.raises(FedForgetError, match="allowed: pathmnist, tissuemnist"):
        read_medmnist("chestmnist", tmp_path)
    path = tmp_path / "tissuemnist" / "tissuemnist.npz"
    write_medmnist(path, False, 8)
    good = util.md5_of(path)
    patch_file("tissuemnist", path.name, md5=good)
    util.flip_byte(path, 50)
    with pytest.raises(FedForgetError, match=f"md5 expected {good}, got {util.md5_of(path)}"):
        read_medmnist("tissuemnist", tmp_path)
