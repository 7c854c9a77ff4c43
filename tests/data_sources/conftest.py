"""Fixtures for the dataset-source tests: a local HTTP server (the download path, offline),
a way to point a source's table entry at test-written files, and small file writers.

Every native-format file these tests read is written by the tests themselves."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import replace
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from fedforget.data.sources.table import SOURCES


def md5_of(path: Path) -> str:
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


def flip_byte(path: Path, offset: int = -1) -> None:
    """Corrupt a file in place: one byte changed, same size."""
    data = bytearray(Path(path).read_bytes())
    data[offset] ^= 0xFF
    Path(path).write_bytes(bytes(data))


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


@pytest.fixture
def http_dir(tmp_path, monkeypatch):
    """(folder, base URL): files put in the folder are served on 127.0.0.1 while the test
    runs."""
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    served = tmp_path / "served"
    served.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(served)))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield served, f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def patch_file(monkeypatch):
    """``patch_file(source, filename, **fields)``: the source's table entry for that file
    with the given fields replaced (``md5``, ``sha256``, ``urls``) for this test only."""

    def patch(source: str, filename: str, **fields) -> None:
        src = SOURCES[source]
        files = tuple(replace(f, **fields) if f.filename == filename else f for f in src.files)
        monkeypatch.setitem(SOURCES, source, replace(src, files=files))

    return patch


def write_png_tree(root: Path, layout: dict[str, int], size=(8, 8), seed: int = 0, ext=".png"):
    """``layout`` {relative folder: count}: that many random RGB images in each folder, named
    img_0<ext>.. ; returns {path: uint8 [3, H, W] array written}."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    written = {}
    for folder, count in layout.items():
        d = root / folder
        d.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            arr = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
            path = d / f"img_{i}{ext}"
            Image.fromarray(arr).save(path)
            written[path] = arr.transpose(2, 0, 1)
    return written


def decoded(path: Path) -> np.ndarray:
    """What PIL decodes from an image file, as uint8 [3, H, W] (for lossy formats)."""
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB")).transpose(2, 0, 1)


@pytest.fixture
def util():
    """The helpers above, for tests (a conftest is not importable under importlib mode)."""
    return SimpleNamespace(
        md5_of=md5_of, flip_byte=flip_byte, write_images=write_png_tree, decoded=decoded
    )
