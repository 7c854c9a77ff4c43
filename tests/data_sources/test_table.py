"""The source table: every source has a reader, every downloadable file a URL and a
well-formed checksum (only DomainNet's are unknown), and every text source its hub entry."""

from __future__ import annotations

import re

import pytest

from fedforget.data.sources import READERS, SOURCES, read_source
from fedforget.data.sources.table import KIND_HUB, KIND_TREE
from fedforget.utils import FedForgetError

NO_CHECKSUM = {"domainnet"}  # its authors publish none


def test_every_source_has_a_reader_and_every_reader_a_source():
    sources = set(SOURCES) - {"imagenet"} | {"imagenet100"}  # one tree, read as a subset
    assert set(READERS) == sources


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_table_entries_are_well_formed(name):
    src = SOURCES[name]
    assert src.name == name and src.title and src.homepage.startswith("http")
    if src.kind == KIND_HUB:
        assert src.hub is not None and src.class_names and "download: true" in src.obtain
        return
    if src.kind == KIND_TREE:
        assert not src.files and "image-net.org" in src.obtain
        return
    assert src.files and len({f.filename for f in src.files}) == len(src.files)
    for f in src.files:
        assert f.urls and all(u.startswith(("http://", "https://")) for u in f.urls)
        assert f.md5 is None or re.fullmatch(r"[0-9a-f]{32}", f.md5)
        assert f.sha256 is None or re.fullmatch(r"[0-9a-f]{64}", f.sha256)
        if name not in NO_CHECKSUM:
            assert f.md5 or f.sha256, f"{name}/{f.filename} has no checksum"
        if f.extract_to is not None:
            assert f.creates, f"{name}/{f.filename}: an archive says what it unpacks into"


def test_read_source_names_the_allowed_sources(tmp_path):
    with pytest.raises(
        FedForgetError, match="unknown dataset source 'imagenet1k'; allowed: cifar10"
    ):
        read_source("imagenet1k", tmp_path)
