"""Dataset registry, prepared-format writer/reader with checksums, and public sets."""

from __future__ import annotations

import filecmp
import hashlib
import io
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from ..registry import Registry
from ..utils import (
    FedForgetError,
    atomic_save_npy,
    atomic_write_json,
    byte_size,
    current_umask,
    host_memory_limit,
    sha256_file,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ARRAYS = ("x_train", "y_train", "x_test", "y_test")


@dataclass(frozen=True)
class Arrays:
    """A built dataset. A multi-domain dataset (DomainNet) also gives ``domains``, its
    domain names, and each row's index into them (``domain_train``, ``domain_test``): rows
    grouped by domain, domains in the order of ``domains`` (meta.json records the counts,
    :func:`domain_counts`)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    class_names: list[str]
    domains: tuple[str, ...] = ()
    domain_train: np.ndarray | None = None
    domain_test: np.ndarray | None = None


def int_option(dataset: str, key: str, v: Any, lo: int, hi: int) -> None:
    """A dataset option that must be an integer in lo..hi: a bool, a float (even 2.0), a
    string or None is refused, never cast (``int(1.5)`` would build another dataset than
    its id names)."""
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise FedForgetError(f"dataset '{dataset}': option {key}={v!r}; allowed: an integer in {lo}..{hi}")


def number_option(dataset: str, key: str, v: Any, lo: float, hi: float, *, closed: str = "[]") -> None:
    """A dataset option that must be a finite number (int or float, not bool) between lo and
    hi; ``closed`` names the bounds that are allowed: "[]" both, "()" neither, "[)" or
    "(]" one."""
    ok = isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and math.isfinite(v)
    if ok:
        ok = (lo <= v if closed[0] == "[" else lo < v) and (v <= hi if closed[1] == "]" else v < hi)
    if not ok:
        interval = f"{closed[0]}{lo:g}, {hi:g}{closed[1]}"
        raise FedForgetError(f"dataset '{dataset}': option {key}={v!r}; allowed: a number in {interval}")


@dataclass(frozen=True)
class DatasetInfo:
    """A dataset source: how to build it and what it looks like before it is built, so a
    config can be validated (shapes, sizes) before any job starts."""

    name: str
    description: str
    build: Callable[..., Arrays]
    defaults: Mapping[str, Any]
    input_shape: Callable[[Mapping[str, Any]], tuple[int, ...]]
    num_classes: int
    sizes: Callable[[Mapping[str, Any]], tuple[int, int]]  # (n_train, n_test)
    check_options: Callable[[Mapping[str, Any]], None] = lambda o: None
    # ships with a Python package: no network needed; False: build(RawData, **options)
    embedded: bool = True
    # the domains of a multi-domain dataset under resolved options, in row order (the
    # tasks of scenario kind 'domains'); () for every other dataset
    domains: Callable[[Mapping[str, Any]], tuple[str, ...]] = lambda o: ()
    # whether it is stored as uint8 images under resolved options (what dataset.normalize
    # normalises, fedforget.inputs); False: float features or token ids
    uint8_images: Callable[[Mapping[str, Any]], bool] = lambda o: False
    # the stored dtype of inputs that are not uint8 images: float32 features, int64 token ids
    feature_dtype: str = "float32"
    # whether its build decodes the inputs into memory maps in a scratch folder on the output's
    # file system (the image-folder sets) rather than holding them in memory
    decodes_to_disk: bool = False

    def resolve(self, options: Mapping[str, Any] | None) -> dict[str, Any]:
        """The options with defaults filled in and checked. Every dataset also takes the
        generic ``subset`` (:data:`SUBSET`), kept only when it is not 0 (all rows), so
        the id of a dataset without it is unchanged."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(self.defaults) - {SUBSET})
        if unknown:
            allowed = ", ".join(sorted(self.defaults)) or "none"
            raise FedForgetError(
                f"dataset '{self.name}': unknown option(s) {unknown}; allowed: {allowed} "
                f"(and {SUBSET}, which every dataset takes)"
            )
        subset = options.pop(SUBSET, 0)
        if isinstance(subset, bool) or not isinstance(subset, int) or subset < 0:
            raise FedForgetError(
                f"dataset '{self.name}': option {SUBSET}={subset!r}; allowed: an integer >= 0 "
                "(the first that many rows of each class in each split; 0: every row)"
            )
        merged = {**self.defaults, **options}
        self.check_options(merged)
        if subset:
            merged[SUBSET] = subset
        return merged

    def input_dtype(self, options: Mapping[str, Any]) -> str:
        """The dtype its inputs are prepared in under resolved ``options`` (checked when
        they are written)."""
        return "uint8" if self.uint8_images(options) else self.feature_dtype

    def row_bytes(self, options: Mapping[str, Any]) -> tuple[int, int]:
        """(input, label) bytes of one prepared row under resolved ``options``: its input's
        elements in ``input_dtype``, its int64 label."""
        itemsize = np.dtype(self.input_dtype(options)).itemsize
        return math.prod(self.input_shape(options)) * itemsize, 8

    def prepared_bytes(self, options: Mapping[str, Any]) -> int:
        """The bytes of the prepared arrays under resolved ``options``: ``split_sizes`` rows
        at ``row_bytes`` each (an upper bound with a ``subset``)."""
        return sum(self.split_sizes(options)) * sum(self.row_bytes(options))

    def split_sizes(self, options: Mapping[str, Any]) -> tuple[int, int]:
        """(n_train, n_test) of resolved ``options``: the published sizes, at most
        ``subset`` x classes (x domains) with a subset (an upper bound: a class may have
        fewer rows)."""
        n_train, n_test = self.sizes(options)
        k = int(options.get(SUBSET, 0)) * self.num_classes * max(1, len(self.domains(options)))
        if k:
            n_train, n_test = min(n_train, k), min(n_test, k)
        return n_train, n_test


DATASETS: Registry[DatasetInfo] = Registry("dataset")

# [D] the option every dataset takes besides its own: keep the first N rows of each class in
# each split (of each domain, for a multi-domain dataset; in the source's row order;
# deterministic), e.g. for ``scale: smoke``
# (fedforget.smoke). Applied after the source is read: a subset of a large source still
# reads (decodes, tokenizes) the whole source once.
SUBSET = "subset"


def first_per_class(y: np.ndarray, k: int) -> np.ndarray:
    """Indices (ascending) of the first ``k`` rows of each class of labels ``y``."""
    y = np.asarray(y)
    order = np.argsort(y, kind="stable")  # rows grouped by class, each group in row order
    sorted_y = y[order]
    starts = np.searchsorted(sorted_y, sorted_y, side="left")
    rank = np.arange(len(y)) - starts  # position of each row within its class
    return np.sort(order[rank < k]).astype(np.int64)


def subset_arrays(arrays: Arrays, k: int) -> Arrays:
    """``arrays`` with only the first ``k`` rows of each class in each split, within each
    domain for a multi-domain dataset (every domain keeps rows, so a stream of its domains
    stays whole; rows stay grouped by domain)."""

    def keep(y: np.ndarray, dom: np.ndarray | None) -> np.ndarray:
        if dom is None:
            return first_per_class(y, k)
        dom = np.asarray(dom)  # a class's rank counted within its domain: key (domain, class)
        return first_per_class(dom * (int(np.max(y, initial=0)) + 1) + np.asarray(y), k)

    tr, te = keep(arrays.y_train, arrays.domain_train), keep(arrays.y_test, arrays.domain_test)
    with_domains = arrays.domain_train is not None
    return Arrays(
        arrays.x_train[tr], arrays.y_train[tr], arrays.x_test[te], arrays.y_test[te], list(arrays.class_names),
        arrays.domains,
        arrays.domain_train[tr] if with_domains else None,
        arrays.domain_test[te] if with_domains else None,
    )  # fmt: skip


def domain_counts(arrays: Arrays) -> dict[str, Any]:
    """meta.json's ``domains`` record of a multi-domain dataset: the names and each split's
    rows per domain, ``{"names": [...], "train": [n_0, ...], "test": [...]}``. Rows are
    grouped by domain in the order of the names [D: counts, not a per-row array file: the
    readers write rows domain by domain, so the counts say everything and the array files,
    their checksums and DVC's record stay what they are]; anything else is an error."""
    out: dict[str, Any] = {"names": list(arrays.domains)}
    for split in ("train", "test"):
        d = np.asarray(getattr(arrays, f"domain_{split}"), dtype=np.int64)
        if len(d) != len(getattr(arrays, f"y_{split}")) or (
            len(d) and (np.any(np.diff(d) < 0) or d[0] < 0 or d[-1] >= len(arrays.domains))
        ):
            raise FedForgetError(
                f"{split} split: per-row domains must be indices into {list(arrays.domains)}, "
                "one per row, rows grouped by domain in that order"
            )
        out[split] = [int(v) for v in np.bincount(d, minlength=len(arrays.domains))]
    return out


def domain_ids(meta: Mapping[str, Any], split: str) -> np.ndarray | None:
    """Each row's domain index in a prepared split (from meta.json's ``domains`` counts);
    None for a dataset without domains."""
    rec = meta.get("domains")
    if not rec:
        return None
    counts = rec[split]
    return np.repeat(np.arange(len(counts), dtype=np.int64), counts)


@dataclass(frozen=True)
class RawData:
    """What the build of a dataset that does not ship with a package (``embedded=False``)
    is given besides its options [D]: ``root``, the raw-data directory holding each source's
    native files under ``<root>/<source>/``; ``download``, whether missing files may be
    fetched; ``work_dir``, a scratch folder on the prepared data's file system for decoded
    memory maps (removed after preparation); ``workers``, image-decoding threads. Locations
    and permissions only: none of them enters a dataset's id, its meta.json or any hash, and
    the prepared bytes do not depend on them."""

    root: Path
    download: bool = False
    work_dir: Path | None = None
    workers: int = 1


def dataset_id(name: str, options: Mapping[str, Any] | None = None) -> str:
    """Directory name of a prepared dataset: the name, plus every non-default option."""
    info = DATASETS.get(name)
    opts = info.resolve(options)
    extra = [f"{k}{_fmt(v)}" for k, v in sorted(opts.items()) if info.defaults.get(k) != v]
    return "-".join([name, *extra])


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        return repr(v)  # shortest exact form: distinct values never share an id
    if isinstance(v, (list, tuple)):
        return "x".join(_fmt(i) for i in v)
    if isinstance(v, str) and ("/" in v or "\\" in v):
        # a path or an "org/name" hub id (a tokenizer): a directory name holds no "/", so its
        # last part and a digest of the whole value
        last = PurePosixPath(v.replace("\\", "/").rstrip("/")).name or "root"
        return f"{last}_{hashlib.sha256(v.encode()).hexdigest()[:8]}"
    return str(v)


def _file_record(path: Path, arr: np.ndarray) -> dict[str, Any]:
    return {"sha256": sha256_file(path), "shape": list(arr.shape), "dtype": str(arr.dtype)}


def default_workers() -> int:
    """Image-decoding threads for preparing a dataset: the CPUs this process may use, at most
    8 (decoding is I/O- and GIL-bound beyond that); the bytes do not depend on it."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def prepare_dataset(
    name: str,
    options: Mapping[str, Any] | None,
    root: str | Path,
    raw_dir: str | Path | None = None,
    download: bool = False,
    workers: int | None = None,
) -> Path:
    """Build a dataset from its source and write it in the prepared format. Deterministic:
    the same name and options give the same bytes. A dataset that does not ship with a
    package (``embedded=False``: the paper datasets) reads its native files from ``raw_dir``
    (default ``<root>/raw``) and fetches missing ones only with ``download``; ``raw_dir``,
    ``download`` and ``workers`` are no part of the id or the bytes (:class:`RawData`). The
    generic option ``subset`` (:data:`SUBSET`) keeps the first that many rows of each class
    of the built splits (it is in the id)."""
    info = DATASETS.get(name)
    opts = info.resolve(options)
    did = dataset_id(name, opts)
    out = Path(root) / did
    check_room(info, opts, out)
    subset = opts.get(SUBSET, 0)
    build_opts = {k: v for k, v in opts.items() if k != SUBSET}

    def rows(arrays: Arrays) -> Arrays:
        return subset_arrays(arrays, subset) if subset else arrays

    if info.embedded:
        return _write_prepared(info, opts, did, out, rows(info.build(**build_opts)), None)
    Path(root).mkdir(parents=True, exist_ok=True)
    # scratch on the same file system as the output: decoded memory maps are moved, not copied
    work = Path(tempfile.mkdtemp(prefix=f".{did}.", suffix=".work", dir=root))
    try:
        raw = RawData(
            Path(raw_dir) if raw_dir is not None else Path(root) / "raw",
            bool(download),
            work,
            int(workers) if workers else default_workers(),
        )
        return _write_prepared(info, opts, did, out, rows(info.build(raw, **build_opts)), work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check_room(info: DatasetInfo, opts: Mapping[str, Any], out: Path) -> None:
    """[D] Refuse, before its source is read, a dataset that cannot be prepared here: its
    rows (the published sizes, ``DatasetInfo.sizes``) at ``row_bytes`` each, against the host
    memory an in-memory build holds them in (``utils.host_memory_limit``: memory and swap,
    or the control group's limit) and the disk ``out`` is written to: the prepared files
    (fewer rows with a ``subset``), the files already there subtracted (they are replaced),
    and, for a build that decodes to disk with a subset, the decoded source beside them
    (without one it is moved into place). A well-typed but huge option (``blobs`` with
    ``size: 4096``, a text set's ``max_length: 8192``, ``imagenet100`` at ``size: 1024``) was
    refused only when an allocation or a write failed, after hours of decoding or
    tokenizing for a large source. Lower bounds: only a certain failure is refused (a build
    holds temporary copies too)."""
    n_train, n_test = info.sizes(opts)
    x_row, y_row = info.row_bytes(opts)
    shape, dtype = list(info.input_shape(opts)), info.input_dtype(opts)

    def refuse(need: int, what: str, have: int) -> FedForgetError:
        return FedForgetError(
            f"dataset '{info.name}' with options {dict(opts)}: {n_train:,} train and {n_test:,} test rows of "
            f"{shape} {dtype} need at least {byte_size(need)} of {what} ({byte_size(have)}): "
            "give it smaller options (e.g. subset, size) or more room"
        )

    built = (n_train + n_test) * (x_row + y_row)
    if not info.decodes_to_disk:
        limit = host_memory_limit()
        if limit is not None and built > limit[0]:
            raise refuse(built, f"memory to build in, more than {limit[1]}", limit[0])
    need = info.prepared_bytes(opts)
    if info.decodes_to_disk and SUBSET in opts:
        need += (n_train + n_test) * x_row
    if out.is_dir():
        need -= sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    place = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(place).free
    if need > free:
        raise refuse(need, f"disk, more than {place} has free", free)


def _write_prepared(
    info: DatasetInfo, opts: dict[str, Any], did: str, out: Path, arrays: Arrays, work: Path | None
) -> Path:
    name = info.name
    stored = {key: stored_dtype(getattr(arrays, key).dtype) for key in ("x_train", "x_test")}
    if set(stored.values()) != {np.dtype(info.input_dtype(opts))}:  # what configs were validated and sized by
        raise FedForgetError(
            f"dataset '{name}': its registry entry says inputs of {info.input_dtype(opts)}, but its build gave "
            f"{', '.join(f'{k} {v}' for k, v in stored.items())} (DatasetInfo.uint8_images, feature_dtype)"
        )
    files = {}
    for key in ARRAYS:
        arr = getattr(arrays, key)
        arr = stored_inputs(arr) if key.startswith("x") else arr.astype(np.int64)
        path = out / f"{key}.npy"
        save_array(path, arr, movable_from=work)  # a rerun keeps unchanged files' mtimes
        files[path.name] = _file_record(path, arr)
    meta = {
        "format_version": FORMAT_VERSION,
        "id": did,
        "name": name,
        "options": opts,
        "description": info.description,
        "input_shape": list(arrays.x_train.shape[1:]),
        "num_classes": info.num_classes,
        "class_names": list(arrays.class_names),
        "n_train": int(len(arrays.y_train)),
        "n_test": int(len(arrays.y_test)),
        "files": files,
    }
    if arrays.domains:  # a multi-domain dataset: rows per domain of each split
        meta["domains"] = domain_counts(arrays)
    if arrays.x_train.dtype == np.uint8:  # images: how fedforget.inputs makes model inputs of them
        meta["normalize"] = channel_stats(arrays.x_train)
    atomic_write_json(out / "meta.json", meta, keep_same=True)  # written last: its presence marks completion
    log.info("prepared %s -> %s (%d train, %d test)", did, out, meta["n_train"], meta["n_test"])
    return out


def stored_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype inputs of ``dtype`` are prepared in: uint8 images as they are, integer token
    ids as int64, any float as float32 (the embedded datasets' format since version 1)."""
    if dtype == np.uint8:
        return np.dtype(np.uint8)
    return np.dtype(np.int64 if np.issubdtype(dtype, np.integer) else np.float32)


def stored_inputs(x: np.ndarray) -> np.ndarray:
    """Inputs in the dtype they are prepared in (``stored_dtype``), byte for byte."""
    if x.dtype == np.uint8:
        return x
    return x.astype(stored_dtype(x.dtype), copy=np.issubdtype(x.dtype, np.floating))  # (floats copied, as always)


STREAM_MIN_BYTES = 64 << 20  # arrays above this (and every memory map) are written in chunks
CHUNK_BYTES = 64 << 20


def npy_header(arr: np.ndarray) -> bytes:
    """The header ``np.save`` writes before ``arr``'s C-order bytes (format 1.0, or 2.0 for a
    header too long for it)."""
    fmt, d = np.lib.format, np.lib.format.header_data_from_array_1_0(arr)
    try:
        buf = io.BytesIO()
        fmt.write_array_header_1_0(buf, d)
    except ValueError:  # header too long for format 1.0: np.save then writes 2.0
        buf = io.BytesIO()
        fmt.write_array_header_2_0(buf, d)
    return buf.getvalue()


def _npy_file_of(arr: np.ndarray, folder: Path) -> Path | None:
    """The file of ``arr`` if it is a memory map of a whole ``.npy`` inside ``folder`` whose
    bytes are what ``np.save(arr)`` would write (a decoded image split), else None."""
    filename = getattr(arr, "filename", None)
    if not isinstance(arr, np.memmap) or not filename or not arr.flags.c_contiguous:
        return None
    path = Path(filename).resolve()
    if path.parent != folder.resolve() or not path.is_file():
        return None
    header = npy_header(arr)
    if arr.offset != len(header) or path.stat().st_size != len(header) + arr.nbytes:
        return None
    with open(path, "rb") as f:
        return path if f.read(len(header)) == header else None


def save_array(path: str | Path, arr: np.ndarray, movable_from: Path | None = None) -> bool:
    """Write ``arr`` to ``path`` with exactly the bytes ``np.save`` gives, atomically, leaving
    a file that already holds them alone (its mtime too). Small in-memory arrays go through
    ``atomic_save_npy`` as they always did; larger ones and memory maps are written in chunks
    of CHUNK_BYTES, never held whole in memory, and a memory map that already is such a file
    in ``movable_from`` (a scratch folder) is moved into place instead of copied. Returns
    whether it wrote."""
    path = Path(path)
    if not isinstance(arr, np.memmap) and arr.nbytes <= STREAM_MIN_BYTES:
        return atomic_save_npy(path, arr, keep_same=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    source = _npy_file_of(arr, movable_from) if movable_from is not None else None
    if source is None:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        source = Path(tmp)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(npy_header(arr))
                row = max(1, int(np.prod(arr.shape[1:], dtype=np.int64)) * arr.itemsize)
                step = max(1, CHUNK_BYTES // row)
                for s in range(0, len(arr), step):
                    f.write(np.ascontiguousarray(arr[s : s + step]).tobytes())
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            source.unlink(missing_ok=True)
            raise
    if path.is_file() and filecmp.cmp(source, path, shallow=False):
        if source.parent == path.parent:  # our temporary file; a scratch file goes with its folder
            source.unlink()
        return False
    os.chmod(source, 0o666 & ~current_umask())
    os.replace(source, path)
    return True


def channel_stats(x: np.ndarray, chunk: int = 4096) -> dict[str, Any]:
    """{scale: 255, mean, std} per channel of uint8 images ``x`` [N, C, ...] scaled to [0, 1],
    over the training split, in float64 and in chunks (a memory map is read once, never
    whole): what ``fedforget.inputs`` normalises inputs by. Rounded to 6 digits so the
    meta.json bytes do not depend on the platform's last float digit."""
    c = x.shape[1]
    total, sq, n = np.zeros(c), np.zeros(c), 0
    # at most ~256 MB of float64 at once (4096 rows of 3x32x32 images; fewer of larger ones)
    row = 8 * max(1, int(np.prod(x.shape[1:], dtype=np.int64)))
    chunk = max(1, min(chunk, (256 << 20) // row))
    for s in range(0, len(x), chunk):
        b = np.asarray(x[s : s + chunk], dtype=np.float64).reshape(min(chunk, len(x) - s), c, -1) / 255.0
        total += b.sum(axis=(0, 2))
        sq += (b * b).sum(axis=(0, 2))
        n += b.shape[0] * b.shape[2]
    mean = total / max(n, 1)
    std = np.sqrt(np.maximum(sq / max(n, 1) - mean * mean, 0.0))
    std = np.where(std > 0, std, 1.0)
    return {"scale": 255, "mean": [round(float(v), 6) for v in mean], "std": [round(float(v), 6) for v in std]}


def read_meta(directory: Path, what: str, hint: str) -> dict[str, Any]:
    path = directory / "meta.json"
    if not path.exists():
        raise FedForgetError(f"{what} not prepared: {path} is missing; {hint}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise FedForgetError(f"corrupt metadata file {path}: {e}") from None


def restore_hint(path: Path) -> str:
    """How to get a prepared file back: from DVC, or by preparing its directory again."""
    return (
        f"restore it with `dvc checkout` or `dvc pull` (data.dvc), or delete {path.parent} "
        "and rerun `snakemake` (or `fedforget prepare`) to prepare it again"
    )


def load_verified(
    path: Path, record: Mapping[str, Any], verify: bool = True, mmap: bool = False
) -> np.ndarray:
    if not path.exists():
        raise FedForgetError(f"missing data file {path}; {restore_hint(path)}")
    if verify:
        actual = sha256_file(path)
        if actual != record["sha256"]:
            raise FedForgetError(
                f"corrupt data file {path}: sha256 expected {record['sha256']}, got {actual}; {restore_hint(path)}"
            )
    try:
        arr = np.load(path, allow_pickle=False, mmap_mode="r" if mmap else None)
    except ValueError as e:
        raise FedForgetError(f"corrupt data file {path}: {e}") from None
    if list(arr.shape) != list(record["shape"]):
        raise FedForgetError(f"data file {path}: shape {list(arr.shape)} != {record['shape']}")
    return arr


CACHE_MIN_BYTES = 64 << 20


def corrupt_files(directory: str | Path, cache: dict[str, Any] | None = None) -> list[str]:
    """Problems with an existing prepared directory (a dataset or a public set), one line
    per file: a file whose sha256 differs from its meta.json record, or an unreadable
    meta.json. Missing files are not problems here (the workflow prepares them again).
    ``cache`` maps a large file (over CACHE_MIN_BYTES) to the (size, mtime_ns, sha256) it
    last had, so such files that are unchanged since they were last hashed are not read at
    every workflow start (as DVC's own cache of hashes does); it is updated in place.
    Smaller files are always hashed."""
    directory = Path(directory)
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        return []
    try:
        files = json.loads(meta_path.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        return [f"{meta_path} cannot be read ({e}); delete {directory} to prepare it again"]
    problems = []
    for name, record in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            continue
        st = path.stat()
        key, stamp = str(path.resolve()), [st.st_size, st.st_mtime_ns]
        cached = cache is not None and st.st_size > CACHE_MIN_BYTES
        hit = cache.get(key) if cached else None
        digest = hit[2] if hit and hit[:2] == stamp else sha256_file(path)
        if cached:
            cache[key] = [*stamp, digest]
        if digest != record["sha256"]:
            problems.append(
                f"data file {path} does not match the sha256 in {meta_path} (corrupt or changed); {restore_hint(path)}"
            )
    return problems


@dataclass
class TensorData:
    """A prepared dataset loaded into memory (numpy; the engine moves it to the device)."""

    id: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    class_names: list[str]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def load_dataset(did: str, root: str | Path, verify: bool = True, mmap: bool = False) -> TensorData:
    """A prepared dataset; ``mmap``: ``x_train`` as a read-only memory map (read a row at a
    time when streamed, ``fedforget.inputs.Pool``), the rest in memory."""
    directory = Path(root) / did
    meta = read_meta(
        directory, f"dataset '{did}'", f"run `fedforget prepare --dataset {did.split('-')[0]}`"
    )
    arrays = {
        k: load_verified(directory / f"{k}.npy", meta["files"][f"{k}.npy"], verify, mmap and k == "x_train")
        for k in ARRAYS
    }
    return TensorData(
        id=did,
        num_classes=int(meta["num_classes"]),
        class_names=list(meta["class_names"]),
        meta=meta,
        **arrays,
    )


# ----------------------------------------------------------------------------- public sets


def public_id(spec: Mapping[str, Any], private_id: str) -> str:
    """Id of a public set: ``<dataset>-holdout<fraction>-s<seed>`` for a held-out slice of the
    private training split, or the other dataset's id."""
    if spec["source"] == "holdout":
        return f"{private_id}-holdout{_fmt(float(spec['fraction']))}-s{int(spec['seed'])}"
    return dataset_id(spec["dataset"], spec.get("options"))


def public_splits(spec: Mapping[str, Any], private_name: str, key: str = "public") -> dict[str, Any]:
    """A ``source: dataset`` public block with its ``splits`` resolved: ``train`` (the
    default) dropped, so a run keeps the identity it had before the key; ``train+test``
    refused where the public dataset is the private one (its test set would be public)."""
    spec = dict(spec)
    if spec.get("splits") == "train":
        del spec["splits"]
    if spec.get("splits") == "train+test" and spec["dataset"] == private_name:
        raise FedForgetError(
            f"{key}.splits: 'train+test' of '{private_name}', the private dataset itself, would put its test set "
            f"in the public set; use splits: train or a held-out slice (source: holdout)"
        )
    return spec


def holdout_indices(n: int, fraction: float, seed: int) -> np.ndarray:
    """Rows of the training split held out as the public set (sorted; seeded)."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x9B1C]))
    k = int(round(fraction * n))
    return np.sort(rng.permutation(n)[:k]).astype(np.int64)


def public_dir(spec: Mapping[str, Any], private_id: str, root: str | Path) -> Path:
    """The directory under ``root`` of the public set ``spec`` of dataset ``private_id``: a
    held-out slice's ``public/<id>``, another dataset's own ``<id>``."""
    pid = public_id(spec, private_id)
    return Path(root) / "public" / pid if spec["source"] == "holdout" else Path(root) / pid


def prepare_public(spec: Mapping[str, Any], private_id: str, root: str | Path) -> Path:
    """Write a held-out public slice into ``data/public/<id>``. A public set that is another
    dataset needs no extra copy: prepare that dataset instead."""
    if spec["source"] != "holdout":
        raise FedForgetError(
            f"public source '{spec['source']}' is a dataset: run `fedforget prepare --dataset {spec['dataset']}`"
        )
    data = load_dataset(private_id, root)
    idx = holdout_indices(len(data.y_train), float(spec["fraction"]), int(spec["seed"]))
    pid = public_id(spec, private_id)
    out = public_dir(spec, private_id, root)
    files = {}
    for key, arr in (("x", data.x_train[idx]), ("y", data.y_train[idx]), ("indices", idx)):
        atomic_save_npy(out / f"{key}.npy", arr, keep_same=True)
        files[f"{key}.npy"] = _file_record(out / f"{key}.npy", arr)
    atomic_write_json(
        out / "meta.json",
        keep_same=True,
        obj={
            "format_version": FORMAT_VERSION,
            "id": pid,
            "source": "holdout",
            "private_dataset": private_id,
            "fraction": float(spec["fraction"]),
            "seed": int(spec["seed"]),
            "n": int(len(idx)),
            "files": files,
        },
    )
    return out


@dataclass
class PublicSet:
    """Public/proxy data for methods that use one (FedDF, FedET, FedProj). ``y`` is None
    unless the method is allowed to see public labels."""

    id: str
    x: np.ndarray
    y: np.ndarray | None
    excluded_train_rows: np.ndarray  # rows of the private train split that are not private


def load_public(
    spec: Mapping[str, Any] | None,
    private_id: str,
    root: str | Path,
    with_labels: bool,
    verify: bool = True,
) -> PublicSet | None:
    if not spec:
        return None
    pid = public_id(spec, private_id)
    if spec["source"] == "holdout":
        directory = public_dir(spec, private_id, root)
        meta = read_meta(
            directory, f"public set '{pid}'", "run `fedforget prepare` with the experiment config"
        )
        arr = {
            k: load_verified(directory / f"{k}.npy", meta["files"][f"{k}.npy"], verify)
            for k in ("x", "y", "indices")
        }
        return PublicSet(pid, arr["x"], arr["y"] if with_labels else None, arr["indices"])
    other = load_dataset(pid, root, verify)
    x, y = other.x_train, other.y_train
    if spec.get("splits") == "train+test":  # [C] the FedProj code's ConcatDataset of both splits
        x, y = np.concatenate([x, other.x_test]), np.concatenate([y, other.y_test])
        pid = f"{pid}+test"
    return PublicSet(pid, x, y if with_labels else None, np.zeros(0, dtype=np.int64))
