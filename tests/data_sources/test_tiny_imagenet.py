"""Tiny-ImageNet reader on a tiny tiny-imagenet-200.zip (JPEG tree) written here, fetched
through a local HTTP server."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest

from fedforget.data.sources import read_tiny_imagenet
from fedforget.utils import FedForgetError

WNIDS = ("n02", "n01")  # wnids.txt is not sorted; classes are


def write_tiny(tmp_path, util):
    """The archive's tree: wnids.txt, words.txt, train/<wnid>/images, val/images with
    val_annotations.txt, test/images (unlabelled, unused)."""
    tree = tmp_path / "build" / "tiny-imagenet-200"
    util.write_images(tree, {f"train/{w}/images": 2 for w in WNIDS}, size=(16, 16), ext=".JPEG")
    for w in WNIDS:
        (tree / "train" / w / f"{w}_boxes.txt").write_text("")
    util.write_images(tree, {"val/images": 3, "test/images": 1}, size=(16, 16), seed=1, ext=".JPEG")
    (tree / "wnids.txt").write_text("\n".join(WNIDS) + "\n")
    (tree / "words.txt").write_text("n01\tgoldfish, Carassius auratus\nn02\tshark\nn03\tother\n")
    (tree / "val" / "val_annotations.txt").write_text(
        "img_0.JPEG\tn02\t0\t0\t8\t8\nimg_1.JPEG\tn01\t1\t1\t9\t9\nimg_2.JPEG\tn02\t0\t0\t4\t4\n"
    )
    archive = tmp_path / "served" / "tiny-imagenet-200.zip"
    archive.parent.mkdir(exist_ok=True)
    with zipfile.ZipFile(archive, "w") as zf:
        for p in sorted(tree.rglob("*")):
            zf.write(p, p.relative_to(tree.parent).as_posix())
    return archive


def test_tiny_imagenet_download_and_read(http_dir, tmp_path, patch_file, util):
    served, url = http_dir
    archive = write_tiny(tmp_path, util)
    patch_file("tiny_imagenet", archive.name, urls=(url + archive.name,), md5=util.md5_of(archive))
    root = tmp_path / "raw"
    with pytest.raises(FedForgetError, match="dataset 'tiny_imagenet': file .* is missing"):
        read_tiny_imagenet(root, tmp_path / "o")
    d = read_tiny_imagenet(root, tmp_path / "o1", size=16, download=True)
    tree = root / "tiny_imagenet" / "tiny-imagenet-200"
    assert d.class_names == ("goldfish, Carassius auratus", "shark")
    assert d.extra["wnids"] == ("n01", "n02")
    assert d.x_train.shape == (4, 3, 16, 16) and d.x_train.dtype == np.uint8
    np.testing.assert_array_equal(d.y_train, [0, 0, 1, 1])
    np.testing.assert_array_equal(d.y_test, [1, 0, 1])  # val_annotations: n02, n01, n02
    assert d.y_test.dtype == np.int64
    np.testing.assert_array_equal(d.x_train[2], util.decoded(tree / "train/n02/images/img_0.JPEG"))
    np.testing.assert_array_equal(d.x_test[1], util.decoded(tree / "val/images/img_1.JPEG"))
    read_tiny_imagenet(root, tmp_path / "o2", size=16)
    for name in ("x_train.npy", "x_test.npy"):
        assert (tmp_path / "o1" / name).read_bytes() == (tmp_path / "o2" / name).read_bytes()
    assert read_tiny_imagenet(root, tmp_path / "o3", size=8).x_train.shape == (4, 3, 8, 8)


def test_tiny_imagenet_corrupt_archive(tmp_path, patch_file, util):
    archive = write_tiny(tmp_path, util)
    root = tmp_path / "raw"
    (root / "tiny_imagenet").mkdir(parents=True)
    target = root / "tiny_imagenet" / archive.name
    target.write_bytes(archive.read_bytes())
    patch_file("tiny_imagenet", archive.name, md5=util.md5_of(archive))
    util.flip_byte(target, 40)
    with pytest.raises(FedForgetError) as e:
        read_tiny_imagenet(root, tmp_path / "o")
    msg = str(e.value)
    assert "dataset 'tiny_imagenet'" in msg and "corrupt" in msg
    assert f"md5 expected {util.md5_of(archive)}, got {util.md5_of(target)}" in msg
    assert "http://cs231n.stanford.edu/tiny-imagenet-200.zip" in msg
