"""fetch.py: download through a local HTTP server (offline), checksums, safe unpacking, and
the one error message for a missing or corrupt file."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
import zipfile

import pytest

from fedforget.data.sources import fetch
from fedforget.data.sources.table import SOURCES
from fedforget.utils import FedForgetError

PAYLOAD = b"native bytes " * 1000


def test_download_verifies_md5_and_sha256(http_dir, tmp_path, patch_file):
    served, url = http_dir
    (served / "pathmnist.npz").write_bytes(PAYLOAD)
    patch_file(
        "pathmnist",
        "pathmnist.npz",
        urls=(url + "pathmnist.npz",),
        md5=hashlib.md5(PAYLOAD).hexdigest(),
        sha256=hashlib.sha256(PAYLOAD).hexdigest(),
    )
    path = fetch.require_file("pathmnist", "pathmnist.npz", tmp_path / "raw", download_ok=True)
    assert path == tmp_path / "raw" / "pathmnist" / "pathmnist.npz"
    assert path.read_bytes() == PAYLOAD
    assert [p.name for p in path.parent.iterdir()] == ["pathmnist.npz"]  # no temporary left


def test_download_tries_mirrors_in_order(http_dir, tmp_path, patch_file):
    served, url = http_dir
    (served / "t.gz").write_bytes(PAYLOAD)
    patch_file(
        "mnist",
        "t10k-labels-idx1-ubyte.gz",
        urls=(url + "absent/t.gz", url + "t.gz"),
        md5=hashlib.md5(PAYLOAD).hexdigest(),
    )
    path = fetch.require_file("mnist", "t10k-labels-idx1-ubyte.gz", tmp_path, download_ok=True)
    assert path.read_bytes() == PAYLOAD


def test_download_with_wrong_checksum_keeps_nothing(http_dir, tmp_path, patch_file):
    served, url = http_dir
    (served / "f.npz").write_bytes(PAYLOAD)
    patch_file("pathmnist", "pathmnist.npz", urls=(url + "f.npz",), md5="0" * 32)
    with pytest.raises(FedForgetError) as e:
        fetch.require_file("pathmnist", "pathmnist.npz", tmp_path, download_ok=True)
    msg = str(e.value)
    assert "'pathmnist'" in msg and "md5 expected " + "0" * 32 in msg
    assert hashlib.md5(PAYLOAD).hexdigest() in msg and url + "f.npz" in msg
    assert not (tmp_path / "pathmnist" / "pathmnist.npz").exists()


def test_unreachable_url_is_one_error_naming_every_url(http_dir, tmp_path, patch_file):
    _, url = http_dir
    patch_file("svhn", "test_32x32.mat", urls=(url + "a.mat", url + "b.mat"))
    with pytest.raises(FedForgetError) as e:
        fetch.require_file("svhn", "test_32x32.mat", tmp_path, download_ok=True)
    msg = str(e.value)
    assert "'svhn'" in msg and url + "a.mat" in msg and url + "b.mat" in msg and "404" in msg
    assert str(tmp_path / "svhn" / "test_32x32.mat") in msg


def test_missing_file_without_download_names_dataset_url_and_place(tmp_path):
    with pytest.raises(FedForgetError) as e:
        fetch.require_file("cifar10", "cifar-10-python.tar.gz", tmp_path)
    msg = str(e.value)
    assert msg.startswith("dataset 'cifar10': file ")
    assert "is missing" in msg and "`download: true`" in msg
    assert SOURCES["cifar10"].files[0].urls[0] in msg
    assert str(tmp_path / "cifar10" / "cifar-10-python.tar.gz") in msg


def test_corrupt_file_names_expected_and_actual(tmp_path, patch_file, util):
    path = tmp_path / "svhn" / "train_32x32.mat"
    path.parent.mkdir()
    path.write_bytes(PAYLOAD)
    patch_file("svhn", "train_32x32.mat", md5=util.md5_of(path))
    fetch.require_file("svhn", "train_32x32.mat", tmp_path)  # intact: passes
    util.flip_byte(path, 5)
    with pytest.raises(FedForgetError) as e:
        fetch.require_file("svhn", "train_32x32.mat", tmp_path)
    msg = str(e.value)
    assert "'svhn'" in msg and "corrupt" in msg
    assert f"md5 expected {hashlib.md5(PAYLOAD).hexdigest()}, got {util.md5_of(path)}" in msg
    assert SOURCES["svhn"].file("train_32x32.mat").urls[0] in msg


def test_unknown_source_lists_the_allowed_ones():
    with pytest.raises(FedForgetError, match="unknown dataset source 'nope'; allowed: .*cifar10"):
        fetch.get_source("nope")


# ----------------------------------------------------------------------------- unpacking


def _tar(path, members: dict[str, bytes], mode="w:gz"):
    with tarfile.open(path, mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_unpack_tar_zip_and_gz(tmp_path):
    _tar(tmp_path / "a.tar.gz", {"top/x.txt": b"x", "top/sub/y.txt": b"y"})
    _tar(tmp_path / "b.tar", {"z.txt": b"z"}, mode="w")
    with zipfile.ZipFile(tmp_path / "c.zip", "w") as zf:
        zf.writestr("dir/", b"")
        zf.writestr("dir/w.txt", b"w")
    (tmp_path / "d.txt.gz").write_bytes(gzip.compress(b"plain"))
    out = tmp_path / "out"
    for name in ("a.tar.gz", "b.tar", "c.zip", "d.txt.gz"):
        fetch.unpack(tmp_path / name, out)
    assert (out / "top" / "sub" / "y.txt").read_bytes() == b"y"
    assert (out / "z.txt").read_bytes() == b"z"
    assert (out / "dir" / "w.txt").read_bytes() == b"w"
    assert (out / "d.txt").read_bytes() == b"plain"
    assert sorted(p.name for p in out.iterdir()) == ["d.txt", "dir", "top", "z.txt"]


@pytest.mark.parametrize("bad", ["../evil.txt", "/abs/evil.txt", "ok/../../evil.txt"])
def test_unpack_refuses_path_traversal(tmp_path, bad):
    _tar(tmp_path / "t.tar.gz", {"fine.txt": b"f", bad: b"evil"})
    with zipfile.ZipFile(tmp_path / "z.zip", "w") as zf:
        zf.writestr("fine.txt", b"f")
        zf.writestr(bad, b"evil")
    for name in ("t.tar.gz", "z.zip"):
        with pytest.raises(FedForgetError, match="unsafe path"):
            fetch.unpack(tmp_path / name, tmp_path / "out")
    assert not (tmp_path / "evil.txt").exists()
    assert not (tmp_path / "out" / "fine.txt").exists()  # nothing moved into place


def test_unpack_skips_links(tmp_path):
    with tarfile.open(tmp_path / "l.tar", "w") as tar:
        info = tarfile.TarInfo("link")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
        data = tarfile.TarInfo("file.txt")
        data.size = 1
        tar.addfile(data, io.BytesIO(b"1"))
    fetch.unpack(tmp_path / "l.tar", tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["file.txt"]


def test_unpack_unknown_type_lists_the_allowed_ones(tmp_path):
    (tmp_path / "x.rar").write_bytes(b"")
    with pytest.raises(FedForgetError, match="allowed: .tar, .tar.gz, .tgz, .zip, .gz"):
        fetch.unpack(tmp_path / "x.rar", tmp_path / "out")


def test_require_unpacked_verifies_once_then_trusts_the_marker(tmp_path, patch_file, util):
    base = tmp_path / "imagenet_r"
    base.mkdir()
    _tar(base / "imagenet-r.tar", {"imagenet-r/n01/a.txt": b"a"}, mode="w")
    patch_file("imagenet_r", "imagenet-r.tar", md5=util.md5_of(base / "imagenet-r.tar"))
    tree = fetch.require_unpacked("imagenet_r", "imagenet-r.tar", tmp_path)
    assert tree == base / "imagenet-r" and (tree / "n01" / "a.txt").read_bytes() == b"a"
    assert (base / ".imagenet-r.tar.unpacked").read_text().startswith("md5:")
    (base / "imagenet-r.tar").unlink()  # the archive may go once unpacked
    assert fetch.require_unpacked("imagenet_r", "imagenet-r.tar", tmp_path) == tree


def test_require_unpacked_uses_a_tree_unpacked_by_hand(tmp_path):
    tree = tmp_path / "tiny_imagenet" / "tiny-imagenet-200"
    tree.mkdir(parents=True)
    got = fetch.require_unpacked("tiny_imagenet", "tiny-imagenet-200.zip", tmp_path)
    assert got == tree


def test_require_unpacked_rejects_a_corrupt_archive(tmp_path, patch_file, util):
    base = tmp_path / "cinic10"
    base.mkdir()
    _tar(base / "CINIC-10.tar.gz", {"train/a.txt": b"a"})
    patch_file("cinic10", "CINIC-10.tar.gz", md5=util.md5_of(base / "CINIC-10.tar.gz"))
    util.flip_byte(base / "CINIC-10.tar.gz", 20)
    with pytest.raises(FedForgetError, match="dataset 'cinic10': file .* is corrupt: md5 expected"):
        fetch.require_unpacked("cinic10", "CINIC-10.tar.gz", tmp_path)
    assert not (base / "CINIC-10").exists()
