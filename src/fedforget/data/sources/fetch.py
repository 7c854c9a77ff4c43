"""Getting a source's native files: download (only when the caller allows it), checksum
verification and safe unpacking of archives.

A missing or corrupt file is one :class:`FedForgetError` whose message names the dataset, the
file, what is wrong (missing, or the checksum expected and the one found) and how to get the
file (``download: true``, or the URL and where to put it).
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import logging
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path, PurePosixPath

from ...utils import FedForgetError, atomic_write, atomic_write_text, file_digest
from .table import KIND_TREE, SOURCES, RemoteFile, Source

log = logging.getLogger(__name__)

CHUNK = 1 << 20
TIMEOUT_S = 60
USER_AGENT = "fedforget-dataset-fetch"


def get_source(name: str) -> Source:
    try:
        return SOURCES[name]
    except KeyError:
        raise FedForgetError(
            f"unknown dataset source '{name}'; allowed: {', '.join(sorted(SOURCES))}"
        ) from None


def source_dir(root: str | os.PathLike, name: str) -> Path:
    """Where a source's native files live: ``<root>/<name>``."""
    return Path(root) / name


def _expected(rf: RemoteFile) -> list[tuple[str, str]]:
    return [(a, v.lower()) for a, v in (("md5", rf.md5), ("sha256", rf.sha256)) if v]


def _how_to_get(dataset: str, rf: RemoteFile, path: Path) -> str:
    if not rf.urls:
        return f"put the file at {path}"
    return (
        f"set `download: true` to fetch it from {rf.urls[0]}, or download it yourself and "
        f"put it at {path}"
    )


def missing_error(dataset: str, rf: RemoteFile, path: Path) -> FedForgetError:
    return FedForgetError(
        f"dataset '{dataset}': file {path} is missing; {_how_to_get(dataset, rf, path)}"
    )


def corrupt_error(
    dataset: str, rf: RemoteFile, path: Path, algorithm: str, expected: str, actual: str
) -> FedForgetError:
    return FedForgetError(
        f"dataset '{dataset}': file {path} is corrupt: {algorithm} expected {expected}, got "
        f"{actual}; delete it, then {_how_to_get(dataset, rf, path)}"
    )


def verify_file(dataset: str, rf: RemoteFile, path: Path) -> None:
    """Check ``path`` against every checksum its table entry gives (none: nothing to check)."""
    for algorithm, expected in _expected(rf):
        actual = file_digest(path, algorithm)
        if actual != expected:
            raise corrupt_error(dataset, rf, path, algorithm, expected, actual)


class _BadDownload(Exception):
    """A download whose checksum does not match (the next mirror is tried)."""


def _stream(url: str, tmp: str, progress: bool, algorithms: list[str]) -> dict[str, str]:
    """Copy ``url`` into ``tmp`` in chunks, hashing on the way; returns the digests."""
    hashes = {a: hashlib.new(a, usedforsecurity=False) for a in algorithms}
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response, open(tmp, "wb") as out:
        total = response.headers.get("Content-Length")
        bar = None
        if progress:
            from tqdm.auto import tqdm

            name = PurePosixPath(url.split("?")[0]).name
            bar = tqdm(total=int(total) if total else None, unit="B", unit_scale=True, desc=name)
        try:
            while block := response.read(CHUNK):
                out.write(block)
                for h in hashes.values():
                    h.update(block)
                if bar is not None:
                    bar.update(len(block))
        finally:
            if bar is not None:
                bar.close()
    return {a: h.hexdigest() for a, h in hashes.items()}


def _fetch_one(
    url: str, path: Path, progress: bool, expected: list[tuple[str, str]]
) -> dict[str, str]:
    """One URL to ``path`` (atomically, only when every expected checksum matches); returns
    the digests (sha256 when none is expected)."""
    got: dict[str, str] = {}

    def write(tmp: str) -> None:
        got.update(_stream(url, tmp, progress, [a for a, _ in expected] or ["sha256"]))
        for algorithm, want in expected:
            if got[algorithm] != want:
                raise _BadDownload(
                    f"{url}: corrupt download: {algorithm} expected {want}, got {got[algorithm]}"
                )

    atomic_write(path, write)
    return got


def download(dataset: str, rf: RemoteFile, path: Path, progress: bool | None = None) -> Path:
    """Fetch ``rf`` to ``path`` from its URLs in order (mirrors), streaming in chunks into a
    temporary file that is renamed into place only once its checksum matches; a URL that
    fails or serves other bytes is skipped for the next. A bar shows progress on a terminal
    (``progress=None``) and stays quiet in logs."""
    if not rf.urls:
        raise missing_error(dataset, rf, path)
    progress = sys.stderr.isatty() if progress is None else progress
    expected = _expected(rf)
    errors = []
    for url in rf.urls:
        log.info("dataset '%s': downloading %s -> %s", dataset, url, path)
        try:
            got = _fetch_one(url, path, progress, expected)
        except _BadDownload as e:
            errors.append(str(e))
            continue
        except (OSError, http.client.HTTPException) as e:  # URLError, HTTPError, timeouts
            errors.append(f"{url}: {e}")
            continue
        if not expected:
            log.warning(
                "dataset '%s': %s has no known checksum; its sha256 is %s (pin it in the "
                "source table)", dataset, path.name, got["sha256"],
            )  # fmt: skip
        return path
    raise FedForgetError(
        f"dataset '{dataset}': could not download {path.name} ({'; '.join(errors)}); try "
        f"again later, or download it yourself and put it at {path}"
    )


def require_file(
    name: str, filename: str, root: str | os.PathLike, download_ok: bool = False
) -> Path:
    """The verified path of one native file of source ``name``; downloaded when missing
    and ``download_ok``, otherwise a missing file is an error."""
    src = get_source(name)
    rf = src.file(filename)
    path = source_dir(root, name) / filename
    if not path.is_file():
        if not download_ok:
            raise missing_error(name, rf, path)
        download(name, rf, path)
    else:
        verify_file(name, rf, path)
    return path


# ----------------------------------------------------------------------------- unpacking


def _safe_member(name: str, archive: Path) -> PurePosixPath:
    p = PurePosixPath(name.replace("\\", "/"))
    if p.is_absolute() or ".." in p.parts or (p.parts and ":" in p.parts[0]):
        raise FedForgetError(
            f"archive {archive} holds an unsafe path {name!r} (absolute or with '..'); "
            "refusing to unpack it: delete it and fetch it again"
        )
    return p


def _unpack_tar(archive: Path, dest: Path) -> None:
    with tarfile.open(archive) as tar:
        members = []
        for m in tar.getmembers():
            _safe_member(m.name, archive)
            if m.isfile() or m.isdir():  # links and devices are never needed by datasets
                members.append(m)
            else:
                log.warning("archive %s: skipping %s (not a file or folder)", archive, m.name)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:  # pragma: no cover - Python before 3.10.12
            tar.extractall(dest, members=members)


def _unpack_zip(archive: Path, dest: Path) -> None:
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            rel = _safe_member(info.filename, archive)
            target = dest.joinpath(*rel.parts)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as fin, open(target, "wb") as fout:
                shutil.copyfileobj(fin, fout, CHUNK)


def _unpack_gz(archive: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with gzip.open(archive, "rb") as fin, open(dest / archive.name[: -len(".gz")], "wb") as fout:
        shutil.copyfileobj(fin, fout, CHUNK)


def unpack(archive: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Unpack a .tar, .tar.gz/.tgz, .zip or .gz archive into ``dest``, refusing absolute
    paths and ``..`` (path traversal) and skipping links. Entries are unpacked into a
    temporary folder beside ``dest`` first and moved into place only when all are out, so an
    interrupted run leaves no half-unpacked tree under the final names."""
    archive, dest = Path(archive), Path(dest)
    name = archive.name.lower()
    if name.endswith((".tar", ".tar.gz", ".tgz")):
        unpacker = _unpack_tar
    elif name.endswith(".zip"):
        unpacker = _unpack_zip
    elif name.endswith(".gz"):
        unpacker = _unpack_gz
    else:
        raise FedForgetError(
            f"cannot unpack {archive}: unknown archive type; allowed: .tar, .tar.gz, .tgz, "
            ".zip, .gz"
        )
    dest.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{archive.name}.", suffix=".partial", dir=dest))
    try:
        try:
            unpacker(archive, tmp)
        except (tarfile.TarError, zipfile.BadZipFile, EOFError, gzip.BadGzipFile) as e:
            raise FedForgetError(
                f"cannot unpack {archive} ({e}); delete it and fetch it again"
            ) from None
        for entry in sorted(tmp.iterdir()):
            target = dest / entry.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
            os.replace(entry, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def require_unpacked(
    name: str, filename: str, root: str | os.PathLike, download_ok: bool = False
) -> Path:
    """The folder an archive of source ``name`` unpacks into (its ``creates`` path),
    unpacking it (after verifying, and downloading if allowed) the first time. A marker file
    ``.<archive>.unpacked`` records the archive's checksum once unpacking finished, so later
    calls neither hash nor need the archive. A tree already there without the archive or a
    marker (unpacked by hand) is used as it is, with a warning that it was not verified."""
    src = get_source(name)
    rf = src.file(filename)
    base = source_dir(root, name)
    tree = base / (rf.creates or ".")
    marker = base / f".{filename}.unpacked"
    if marker.is_file() and tree.exists():
        return tree
    archive = base / filename
    if not archive.is_file() and tree.is_dir():
        log.warning(
            "dataset '%s': using %s as it is (no %s to verify it against)", name, tree, filename
        )
        return tree
    archive = require_file(name, filename, root, download_ok)
    log.info("dataset '%s': unpacking %s", name, archive)
    unpack(archive, base / (rf.extract_to or "."))
    stamp = " ".join(f"{a}:{v}" for a, v in _expected(rf)) or "unverified"
    atomic_write_text(marker, stamp + "\n")
    return tree


def require_tree(name: str, path: Path, what: str, dataset: str | None = None) -> Path:
    """A folder the user provides (no download) for source ``name``: its path, or an error
    naming ``dataset`` (default: the source) and saying how to get the folder."""
    src = get_source(name)
    if not path.is_dir():
        hint = src.obtain if src.kind == KIND_TREE else f"see {src.homepage}"
        raise FedForgetError(f"dataset '{dataset or name}': {what} {path} is missing; {hint}")
    return path
