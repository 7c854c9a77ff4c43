"""CINIC-10 reader on a tiny CINIC-10.tar.gz (PNG tree, no top folder) written here."""

from __future__ import annotations

import tarfile

import numpy as np
import pytest

from fedforget.data.sources import read_cinic10
from fedforget.utils import FedForgetError

CLASSES = ("airplane", "cat")
LAYOUT = {f"{s}/{c}": n for s, n in (("train", 3), ("valid", 2), ("test", 2)) for c in CLASSES}


@pytest.fixture
def cinic_root(tmp_path, patch_file, util):
    tree = tmp_path / "build"
    written = util.write_images(tree, LAYOUT, size=(32, 32))
    archive = tmp_path / "raw" / "cinic10" / "CINIC-10.tar.gz"
    archive.parent.mkdir(parents=True)
    with tarfile.open(archive, "w:gz") as tar:
        for split in ("train", "valid", "test"):
            tar.add(tree / split, arcname=split)
    patch_file("cinic10", archive.name, md5=util.md5_of(archive))
    return tmp_path / "raw", tree, written


def test_cinic10_reads_png_pixels_in_sorted_order(cinic_root, tmp_path):
    root, tree, written = cinic_root
    d = read_cinic10(root, tmp_path / "out1")
    assert d.class_names == CLASSES
    assert d.x_train.shape == (6, 3, 32, 32) and d.x_train.dtype == np.uint8
    assert d.y_train.dtype == np.int64
    np.testing.assert_array_equal(d.y_train, [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(d.y_test, [0, 0, 1, 1])
    np.testing.assert_array_equal(d.extra["y_val"], [0, 0, 1, 1])
    np.testing.assert_array_equal(d.x_train[4], written[tree / "train" / "cat" / "img_1.png"])
    np.testing.assert_array_equal(d.x_test[0], written[tree / "test" / "airplane" / "img_0.png"])
    np.testing.assert_array_equal(
        d.extra["x_val"][3], written[tree / "valid" / "cat" / "img_1.png"]
    )
    assert isinstance(d.x_train, np.memmap)
    again = read_cinic10(root, tmp_path / "out2")  # unpacked already: reads the tree
    for name in ("x_train.npy", "x_test.npy", "x_val.npy"):
        assert (tmp_path / "out1" / name).read_bytes() == (tmp_path / "out2" / name).read_bytes()
    assert again.y_train.tobytes() == d.y_train.tobytes()


def test_cinic10_val_options(cinic_root, tmp_path):
    root, *_ = cinic_root
    merged = read_cinic10(root, tmp_path / "o", val="train")
    assert merged.x_train.shape[0] == 10 and not merged.extra
    np.testing.assert_array_equal(merged.y_train, [0, 0, 0, 1, 1, 1, 0, 0, 1, 1])
    assert not (tmp_path / "o" / "x_val.npy").exists()
    assert read_cinic10(root, tmp_path / "d", val="drop").x_train.shape[0] == 6
    with pytest.raises(FedForgetError, match="val='x'; allowed: extra, train, drop"):
        read_cinic10(root, tmp_path / "e", val="x")


def test_cinic10_resizes_on_request(cinic_root, tmp_path):
    root, *_ = cinic_root
    assert read_cinic10(root, tmp_path / "o", size=16).x_test.shape == (4, 3, 16, 16)


def test_cinic10_missing_and_corrupt(cinic_root, tmp_path, util):
    with pytest.raises(FedForgetError) as e:
        read_cinic10(tmp_path / "empty", tmp_path / "o")
    assert "dataset 'cinic10'" in str(e.value) and "CINIC-10.tar.gz is missing" in str(e.value)
    assert "https://datashare.ed.ac.uk/" in str(e.value)
    root, *_ = cinic_root
    archive = root / "cinic10" / "CINIC-10.tar.gz"
    good = util.md5_of(archive)
    util.flip_byte(archive, 30)
    with pytest.raises(FedForgetError, match=f"md5 expected {good}, got {util.md5_of(archive)}"):
        read_cinic10(root, tmp_path / "o")
