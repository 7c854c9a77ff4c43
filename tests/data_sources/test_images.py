"""images.py: one image to uint8 [3, S, S] (RGB, shorter side resized, centre crop) and the
chunked, memory-mapped, deterministic decoding of many."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from fedforget.data.sources import images
from fedforget.utils import FedForgetError


def test_load_image_keeps_exact_pixels_at_native_size(tmp_path):
    arr = np.random.default_rng(0).integers(0, 256, size=(6, 6, 3), dtype=np.uint8)
    Image.fromarray(arr).save(tmp_path / "a.png")
    out = images.load_image(tmp_path / "a.png", 6)
    assert out.dtype == np.uint8 and out.shape == (3, 6, 6)
    np.testing.assert_array_equal(out, arr.transpose(2, 0, 1))


def test_load_image_converts_gray_and_palette_to_rgb(tmp_path):
    Image.fromarray(np.full((4, 4), 77, np.uint8), mode="L").save(tmp_path / "g.png")
    out = images.load_image(tmp_path / "g.png", 4)
    assert out.shape == (3, 4, 4) and (out == 77).all()
    Image.new("P", (4, 4), 3).save(tmp_path / "p.png")
    assert images.load_image(tmp_path / "p.png", 4).shape == (3, 4, 4)


def test_load_image_resizes_the_shorter_side_and_centre_crops(tmp_path):
    # an 80x20 image: left quarter red, middle half green, right quarter blue
    arr = np.zeros((20, 80, 3), np.uint8)
    arr[:, :20, 0] = 255
    arr[:, 20:60, 1] = 255
    arr[:, 60:, 2] = 255
    Image.fromarray(arr).save(tmp_path / "wide.png")
    out = images.load_image(tmp_path / "wide.png", 10)  # 80x20 -> 40x10 -> its centre 10x10
    assert out.shape == (3, 10, 10)
    assert (out[1] == 255).all() and (out[0] == 0).all() and (out[2] == 0).all()


def test_load_image_corrupt_file_is_a_user_error(tmp_path):
    (tmp_path / "bad.jpg").write_bytes(b"not an image")
    with pytest.raises(FedForgetError, match=r"cannot decode image .*bad\.jpg"):
        images.load_image(tmp_path / "bad.jpg", 8)


def test_decode_to_npy_is_a_deterministic_memmap(tmp_path, util, monkeypatch):
    monkeypatch.setattr(images, "CHUNK", 3)  # several chunks
    written = util.write_images(tmp_path / "imgs", {"a": 4, "b": 3}, size=(9, 7))
    paths = sorted(written)
    one = images.decode_to_npy(paths, 5, tmp_path / "one" / "x.npy", workers=1)
    images.decode_to_npy(paths, 5, tmp_path / "two" / "x.npy", workers=3)
    assert isinstance(one, np.memmap) and not one.flags.writeable
    assert one.shape == (7, 3, 5, 5) and one.dtype == np.uint8
    assert (tmp_path / "one" / "x.npy").read_bytes() == (tmp_path / "two" / "x.npy").read_bytes()
    for i, p in enumerate(paths):
        np.testing.assert_array_equal(one[i], images.load_image(p, 5))
    assert sorted(q.name for q in (tmp_path / "one").iterdir()) == ["x.npy"]  # no temporaries


def test_decode_to_npy_with_no_images(tmp_path):
    out = images.decode_to_npy([], 4, tmp_path / "x.npy")
    assert out.shape == (0, 3, 4, 4) and out.dtype == np.uint8


def test_read_wnid_names_and_list_images(tmp_path):
    (tmp_path / "words.txt").write_text("n01\tgoldfish, Carassius auratus\nn02\tshark\n")
    names = images.read_wnid_names(tmp_path / "absent.txt", tmp_path / "words.txt")
    assert names == {"n01": "goldfish, Carassius auratus", "n02": "shark"}
    assert images.read_wnid_names(tmp_path / "absent.txt") == {}
    for n in ("b.JPEG", "a.png", "c.txt"):
        (tmp_path / n).write_bytes(b"")
    assert [p.name for p in images.list_images(tmp_path)] == ["a.png", "b.JPEG"]
    with pytest.raises(FedForgetError, match="image folder .* is missing"):
        images.list_images(tmp_path / "nope")
