"""ImageNet-100 (a 100-wnid subset of an ImageNet-style tree) and ImageNet-R (a tar of
JPEG folders with a seeded stratified split), on tiny trees written here."""

from __future__ import annotations

import shutil
import tarfile

import numpy as np
import pytest

from fedforget.data.sources import imagenet_r_split, read_imagenet100, read_imagenet_r
from fedforget.data.sources.table import IMAGENET100_WNIDS
from fedforget.utils import FedForgetError


def test_imagenet100_list_is_cmc():
    assert len(IMAGENET100_WNIDS) == len(set(IMAGENET100_WNIDS)) == 100
    assert IMAGENET100_WNIDS[0] == "n02869837" and IMAGENET100_WNIDS[-1] == "n02090622"
    assert all(w.startswith("n") and len(w) == 9 for w in IMAGENET100_WNIDS)


@pytest.fixture
def imagenet_root(tmp_path, util):
    """An ImageNet tree with the 100 classes (one train and one val image each) plus one
    class that is not among them."""
    base = tmp_path / "raw" / "imagenet"
    extra = "n99999999"
    layout = {f"{s}/{w}": 1 for s in ("train", "val") for w in (*IMAGENET100_WNIDS, extra)}
    written = util.write_images(base, layout, size=(6, 6))
    (base / "LOC_synset_mapping.txt").write_text("n01558993 robin, American robin\n")
    return tmp_path / "raw", written


def test_imagenet100_reads_the_subset(imagenet_root, tmp_path):
    root, written = imagenet_root
    d = read_imagenet100(root, tmp_path / "o1", size=6)
    wnids = sorted(IMAGENET100_WNIDS)
    assert d.extra["wnids"] == tuple(wnids)
    assert d.x_train.shape == (100, 3, 6, 6) and d.x_test.shape == (100, 3, 6, 6)
    assert d.x_train.dtype == np.uint8 and d.y_train.dtype == np.int64
    np.testing.assert_array_equal(d.y_train, np.arange(100))
    i = wnids.index("n01558993")
    assert d.class_names[i] == "robin, American robin" and d.class_names[1] == wnids[1]
    base = root / "imagenet"
    np.testing.assert_array_equal(d.x_test[i], written[base / "val" / "n01558993" / "img_0.png"])
    read_imagenet100(root, tmp_path / "o2", size=6)
    for name in ("x_train.npy", "x_test.npy"):
        assert (tmp_path / "o1" / name).read_bytes() == (tmp_path / "o2" / name).read_bytes()


def test_imagenet100_missing_tree_and_classes(imagenet_root, tmp_path):
    with pytest.raises(FedForgetError) as e:
        read_imagenet100(tmp_path / "nothing", tmp_path / "o")
    msg = str(e.value)
    assert "dataset 'imagenet100'" in msg and "is missing" in msg
    assert "https://image-net.org" in msg and "val/<wnid>" in msg
    root, _ = imagenet_root
    shutil.rmtree(root / "imagenet" / "val" / "n02869837")
    with pytest.raises(FedForgetError, match="1 of its classes have no folder .* n02869837"):
        read_imagenet100(root, tmp_path / "o")


# ----------------------------------------------------------------------------- ImageNet-R

R_CLASSES = {"n01443537": 5, "n01484850": 10, "n01494475": 1}


@pytest.fixture
def imagenet_r_root(tmp_path, patch_file, util):
    build = tmp_path / "build"
    written = util.write_images(build / "imagenet-r", R_CLASSES, size=(12, 12), ext=".jpg")
    archive = tmp_path / "raw" / "imagenet_r" / "imagenet-r.tar"
    archive.parent.mkdir(parents=True)
    with tarfile.open(archive, "w") as tar:
        tar.add(build / "imagenet-r", arcname="imagenet-r")
    patch_file("imagenet_r", archive.name, md5=util.md5_of(archive))
    return tmp_path / "raw", written


def test_imagenet_r_split_is_stratified_seeded_and_per_class():
    for n in (0, 1, 5, 10, 101):
        train, test = imagenet_r_split(n, "n01443537", 0.2, 0)
        assert len(test) == int(np.floor(0.2 * n + 0.5)) and len(train) + len(test) == n
        assert sorted(np.concatenate([train, test]).tolist()) == list(range(n))
        assert (np.diff(train) > 0).all() and (np.diff(test) > 0).all()
    a = imagenet_r_split(50, "n01443537", 0.2, 0)[1]
    assert a.tolist() == imagenet_r_split(50, "n01443537", 0.2, 0)[1].tolist()
    assert a.tolist() != imagenet_r_split(50, "n01443537", 0.2, 1)[1].tolist()
    assert a.tolist() != imagenet_r_split(50, "n01484850", 0.2, 0)[1].tolist()


def test_imagenet_r_reads_with_the_split(imagenet_r_root, tmp_path, util):
    root, _ = imagenet_r_root
    d = read_imagenet_r(root, tmp_path / "o1", size=12)
    assert d.class_names == tuple(sorted(R_CLASSES))  # no names file: the wnids
    assert d.x_train.shape == (13, 3, 12, 12) and d.x_test.shape == (3, 3, 12, 12)
    assert d.x_train.dtype == np.uint8 and d.y_test.dtype == np.int64
    np.testing.assert_array_equal(np.bincount(d.y_test, minlength=3), [1, 2, 0])
    np.testing.assert_array_equal(np.bincount(d.y_train, minlength=3), [4, 8, 1])
    tree = root / "imagenet_r" / "imagenet-r"
    files = sorted((tree / "n01484850").iterdir())
    _, test_rows = imagenet_r_split(10, "n01484850", 0.2, 0)
    np.testing.assert_array_equal(d.x_test[1], util.decoded(files[test_rows[0]]))
    read_imagenet_r(root, tmp_path / "o2", size=12)
    for name in ("x_train.npy", "x_test.npy"):
        assert (tmp_path / "o1" / name).read_bytes() == (tmp_path / "o2" / name).read_bytes()
    other = read_imagenet_r(root, tmp_path / "o3", size=12, split_seed=3, test_fraction=0.5)
    np.testing.assert_array_equal(np.bincount(other.y_test, minlength=3), [3, 5, 1])  # half up


def test_imagenet_r_errors(imagenet_r_root, tmp_path, util):
    root, _ = imagenet_r_root
    with pytest.raises(FedForgetError, match="test_fraction=1.0; allowed: 0 < f < 1"):
        read_imagenet_r(root, tmp_path / "o", test_fraction=1.0)
    with pytest.raises(FedForgetError) as e:
        read_imagenet_r(tmp_path / "none", tmp_path / "o")
    assert "dataset 'imagenet_r'" in str(e.value)
    assert "https://people.eecs.berkeley.edu/~hendrycks/imagenet-r.tar" in str(e.value)
    archive = root / "imagenet_r" / "imagenet-r.tar"
    good = util.md5_of(archive)
    util.flip_byte(archive, 600)
    with pytest.raises(FedForgetError, match=f"md5 expected {good}, got {util.md5_of(archive)}"):
        read_imagenet_r(root, tmp_path / "o")
