"""Decoding image files into a memory-mapped uint8 ``[N, 3, S, S]`` ``.npy``, chunk by chunk.

Each image is decoded with PIL, converted to RGB, its shorter side resized to ``S``
(bilinear, antialiased) and centre-cropped to ``S x S``; an image already ``S x S`` is kept
as it is (lossless formats keep their exact pixels). Files are decoded in the order given
(readers sort them), so a rerun writes the same bytes.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ...utils import FedForgetError, atomic_write

log = logging.getLogger(__name__)

CHUNK = 512  # images decoded per step: the memory held at once is CHUNK * 3 * S * S bytes


def load_image(path: str | os.PathLike, size: int) -> np.ndarray:
    """One image as uint8 ``[3, size, size]``."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im = im.convert("RGB")
            w, h = im.size
            if (w, h) != (size, size):
                scale = size / min(w, h)
                nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
                im = im.resize((nw, nh), Image.Resampling.BILINEAR)
                left, top = (nw - size) // 2, (nh - size) // 2
                im = im.crop((left, top, left + size, top + size))
            arr = np.asarray(im, dtype=np.uint8)
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise FedForgetError(
            f"cannot decode image {path} ({e}); the file is corrupt: delete the dataset's "
            "unpacked folder (or the file) and unpack or fetch it again"
        ) from None
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


def decode_to_npy(
    paths: Sequence[str | os.PathLike],
    size: int,
    out: str | os.PathLike,
    workers: int = 1,
    desc: str = "",
) -> np.ndarray:
    """Decode ``paths`` into ``out`` (a ``.npy`` written atomically through
    ``numpy.lib.format.open_memmap``) and return it opened read-only as a memory map.
    ``workers`` threads decode in parallel (PIL releases the GIL while decoding); the result
    does not depend on their number."""
    if size < 1:
        raise FedForgetError(f"image size {size!r}: allowed: a positive number of pixels")
    out = Path(out)
    n = len(paths)
    shape = (n, 3, size, size)
    progress = sys.stderr.isatty()

    def write(tmp: str) -> None:
        if n == 0:  # a zero-length memory map cannot be opened
            with open(tmp, "wb") as f:
                np.save(f, np.zeros(shape, np.uint8))
            return
        arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=shape)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=n, unit="img", desc=desc or out.name)
        try:
            with ThreadPoolExecutor(max_workers=max(1, int(workers))) as pool:
                for start in range(0, n, CHUNK):
                    chunk = paths[start : start + CHUNK]
                    for i, img in enumerate(pool.map(load_image, chunk, [size] * len(chunk))):
                        arr[start + i] = img
                    if bar is not None:
                        bar.update(len(chunk))
            arr.flush()
        finally:
            if bar is not None:
                bar.close()
            del arr

    log.info("decoding %d images to %s (%dx%d)", n, out, size, size)
    atomic_write(out, write)
    return np.load(out, mmap_mode="r") if n else np.load(out)


def read_wnid_names(*candidates: Path) -> dict[str, str]:
    """wnid -> class name from the first file found among ``candidates``: Tiny-ImageNet's
    ``words.txt`` (``wnid<TAB>names``) or Kaggle ImageNet's ``LOC_synset_mapping.txt``
    (``wnid names``). Empty when none exists."""
    for path in candidates:
        if path.is_file():
            names = {}
            for line in path.read_text(encoding="utf-8").splitlines():
                parts = line.strip().split(None, 1)
                if len(parts) == 2:
                    names[parts[0]] = parts[1].strip()
            return names
    return {}


def list_images(folder: Path, suffixes: tuple[str, ...] = (".jpg", ".jpeg", ".png")) -> list[Path]:
    """Image files directly in ``folder``, sorted by name (deterministic order)."""
    if not folder.is_dir():
        raise FedForgetError(
            f"image folder {folder} is missing; the dataset's tree is incomplete: delete it "
            "(and its .unpacked marker) to unpack or fetch it again"
        )
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in suffixes)
