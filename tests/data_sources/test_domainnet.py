"""DomainNet reader on two tiny domains (zips of JPEG folders plus the official-style split
lists ``<domain>_{train,test}.txt``) written here."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest

from fedforget.data.sources import read_domainnet
from fedforget.data.sources.table import SOURCES
from fedforget.utils import FedForgetError

CLASSES = ("aircraft_carrier", "zebra")


@pytest.fixture
def domainnet_root(tmp_path, util):
    base = tmp_path / "raw" / "domainnet"
    build = tmp_path / "build"
    base.mkdir(parents=True)
    for domain in ("clipart", "sketch"):
        layout = {f"{domain}/{c}": 3 for c in CLASSES}
        util.write_images(build, layout, size=(10, 10), seed=len(domain), ext=".jpg")
        with zipfile.ZipFile(base / f"{domain}.zip", "w") as zf:
            for p in sorted((build / domain).rglob("*")):
                zf.write(p, p.relative_to(build).as_posix())
        # lists in an unsorted order; test gets the last image of each class
        for split, idx in (("train", (1, 0)), ("test", (2,))):
            lines = [
                f"{domain}/{c}/img_{i}.jpg {label}"
                for label, c in reversed(list(enumerate(CLASSES)))
                for i in idx
            ]
            (base / f"{domain}_{split}.txt").write_text("\n".join(lines) + "\n")
    return tmp_path / "raw"


def test_domainnet_reads_lists_domains_and_classes(domainnet_root, tmp_path, util):
    d = read_domainnet(domainnet_root, tmp_path / "o1", domains=["sketch", "clipart"], size=10)
    assert d.class_names == CLASSES
    assert d.x_train.shape == (8, 3, 10, 10) and d.x_test.shape == (4, 3, 10, 10)
    assert d.x_train.dtype == np.uint8 and d.y_train.dtype == np.int64
    assert d.extra["domain_names"] == ("sketch", "clipart")
    np.testing.assert_array_equal(d.extra["domain_train"], [0, 0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(d.extra["domain_test"], [0, 0, 1, 1])
    np.testing.assert_array_equal(d.y_train, [0, 0, 1, 1, 0, 0, 1, 1])  # sorted by path
    np.testing.assert_array_equal(d.y_test, [0, 1, 0, 1])
    base = domainnet_root / "domainnet"
    np.testing.assert_array_equal(d.x_train[3], util.decoded(base / "sketch/zebra/img_1.jpg"))
    np.testing.assert_array_equal(
        d.x_test[2], util.decoded(base / "clipart/aircraft_carrier/img_2.jpg")
    )
    read_domainnet(domainnet_root, tmp_path / "o2", domains=["sketch", "clipart"], size=10)
    for name in ("x_train.npy", "x_test.npy"):
        assert (tmp_path / "o1" / name).read_bytes() == (tmp_path / "o2" / name).read_bytes()
    one = read_domainnet(domainnet_root, tmp_path / "o3", domains=["clipart"], size=4)
    assert one.x_train.shape == (4, 3, 4, 4) and one.extra["domain_names"] == ("clipart",)


def test_domainnet_errors(domainnet_root, tmp_path):
    with pytest.raises(FedForgetError, match=r"domains=\['photo'\]; allowed: .*clipart, infograph"):
        read_domainnet(domainnet_root, tmp_path / "o", domains=["photo"])
    with pytest.raises(FedForgetError) as e:
        read_domainnet(domainnet_root, tmp_path / "o", domains=["real"])
    msg = str(e.value)
    assert "dataset 'domainnet'" in msg and "real.zip is missing" in msg
    assert SOURCES["domainnet"].file("real.zip").urls[0] in msg
    listing = domainnet_root / "domainnet" / "clipart_test.txt"
    listing.write_text("clipart/zebra/img_2.jpg 0\n")  # zebra is label 1 elsewhere
    with pytest.raises(
        FedForgetError, match="label 0 is class 'aircraft_carrier' elsewhere but 'zebra'"
    ):
        read_domainnet(domainnet_root, tmp_path / "o", domains=["clipart"])
    listing.unlink()
    with pytest.raises(FedForgetError, match="clipart_test.txt is missing"):
        read_domainnet(domainnet_root, tmp_path / "o", domains=["clipart"])
