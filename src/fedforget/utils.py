"""Small shared helpers: hashing, atomic writes, seeding and provenance."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import platform
import sys
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


class FedForgetError(Exception):
    """An error with a message meant for the user (bad config, missing data, corrupt file)."""


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation that failed: torch's OutOfMemoryError (CUDA), its CPU allocator's (and
    the MPS backend's) RuntimeError, a MemoryError (numpy's); or one that could not be asked
    for, its size beyond 64 bits (torch's storage size overflowed, or a size it cannot
    unpack); told apart without importing torch."""
    msg = str(e)
    return (
        isinstance(e, MemoryError)
        or type(e).__name__ == "OutOfMemoryError"
        or (type(e) is RuntimeError and any(m in msg for m in ("can't allocate memory", "out of memory",
                                                                 "Storage size calculation overflowed")))
        or (type(e) is TypeError and "argument 'size'" in msg and "Overflow when unpacking" in msg)
    )  # fmt: skip


def is_float_overflow(e: BaseException) -> bool:
    """A real number that overflowed in training: a Python float beyond what a tensor's dtype
    holds (torch: "value cannot be converted to type float without overflow"), or beyond a
    double in ``math`` (``OverflowError``: "math range error", "Numerical result out of
    range"). The run diverged (``engine.Simulation.run``)."""
    msg = str(e)
    return (type(e) is RuntimeError and "cannot be converted to type" in msg and "without overflow" in msg) or (
        type(e) is OverflowError and ("math range error" in msg or "Numerical result out of range" in msg)
    )


MEMINFO, CGROUPS, CGROUP_ROOT = Path("/proc/meminfo"), Path("/proc/self/cgroup"), Path("/sys/fs/cgroup")


def host_memory_limit() -> tuple[int, str] | None:
    """The most memory this process can hold (bytes) and what sets it: the machine's memory
    and swap (/proc/meminfo), or its control group's limit where smaller (cgroup v2
    ``memory.max``, v1 ``memory.limit_in_bytes``, of the group and its parents: a SLURM
    job's ``--mem``); None where neither can be read (not Linux)."""
    found: list[tuple[int, str]] = []
    try:
        kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in MEMINFO.read_text().splitlines() if ":" in line)}
        found.append(((kb["MemTotal"] + kb.get("SwapTotal", 0)) * 1024, "this machine's memory and swap"))
    except (OSError, ValueError, KeyError, IndexError):
        pass
    try:
        lines = CGROUPS.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and controllers == "":  # (a hybrid layout mounts v2 under unified/)
            base, file = CGROUP_ROOT / "unified" if (CGROUP_ROOT / "unified").is_dir() else CGROUP_ROOT, "memory.max"
        elif "memory" in controllers.split(","):
            base, file = CGROUP_ROOT / "memory", "memory.limit_in_bytes"
        else:
            continue
        d = base / path.strip("/")
        while True:
            try:
                v = (d / file).read_text().strip()
                if v.isdigit() and int(v) < 2**60:  # v1 writes ~2**63 for none, v2 "max"
                    found.append((int(v), f"its control group's memory limit ({d / file})"))
            except OSError:
                pass
            if d == base or base not in d.parents:
                break
            d = d.parent
    return min(found) if found else None


def first_line(e: BaseException) -> str:
    """An exception's message's first line (its type's name where it has none): what an
    error for the user quotes of a library's message (torch's allocator adds lines of advice)."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def byte_size(n: float) -> str:
    """``n`` bytes in the largest binary unit it reaches (``1,536`` -> ``1.5 KiB``), one
    decimal: how an error or ``fedforget validate`` states a size."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    i = 0
    while i + 1 < len(units) and abs(n) >= 1024 ** (i + 1):
        i += 1
    return f"{n:,.0f} B" if i == 0 else f"{n / 1024**i:,.1f} {units[i]}"


def file_digest(path: str | os.PathLike, algorithm: str = "sha256", chunk: int = 1 << 20) -> str:
    """Hex digest of a file's bytes (``hashlib`` algorithm name), read in chunks."""
    h = hashlib.new(algorithm, usedforsecurity=False)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    return file_digest(path, "sha256")


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: the input of every config hash."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def config_hash(obj: Any, length: int = 12) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:length]


def current_umask() -> int:
    """The process's file-mode creation mask (read without a window in which it is 0 where
    the OS reports it: Linux's /proc/self/status)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, writer: Callable[[str], None]) -> None:
    """Call ``writer(tmp_path)`` then rename onto ``path``: readers see the old file or the
    complete new one, never a partial file. The file gets the mode a plain ``open`` would
    give it (0666 less the umask; mkstemp's own 0600 would hide results from colleagues on
    a shared disk)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~current_umask())
        writer(tmp)
        fd = os.open(tmp, os.O_RDONLY)  # on disk before it becomes visible under its name
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes, keep_same: bool = False) -> bool:
    """Write ``data`` atomically; with ``keep_same`` a file that already holds exactly these
    bytes is left alone, its mtime too (so Snakemake reruns nothing that reads it). Returns
    whether it wrote."""
    if keep_same and os.path.isfile(path) and Path(path).read_bytes() == data:
        return False

    def _w(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    atomic_write(path, _w)
    return True


def atomic_write_text(path: str | os.PathLike, text: str, keep_same: bool = False) -> bool:
    return atomic_write_bytes(path, text.encode("utf-8"), keep_same)


def atomic_write_json(path: str | os.PathLike, obj: Any, keep_same: bool = False) -> bool:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n", keep_same)


def atomic_save_npy(path: str | os.PathLike, array: np.ndarray, keep_same: bool = False) -> bool:
    """np.save is byte-deterministic (header + raw buffer), unlike np.savez whose zip
    entries carry timestamps; prepared data must hash the same on every machine."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return atomic_write_bytes(path, buf.getvalue(), keep_same)


def atomic_torch_save(path: str | os.PathLike, obj: Any) -> None:
    """``torch.save`` through a file object: the archive's inner folder is then always
    "archive", not the temporary file's name, so equal objects give equal bytes."""
    import torch

    def _w(tmp: str) -> None:
        with open(tmp, "wb") as f:
            torch.save(obj, f)

    try:
        atomic_write(path, _w)
    except RuntimeError as e:  # torch reports a failed write (a full disk, a file size limit) so
        cause = e.__cause__ or e.__context__
        if not isinstance(cause, OSError):
            raise
        raise FedForgetError(f"cannot write {path}: {cause.strerror or cause} (a full disk or a file size limit?); "
                             "the files written before it are kept") from e


@contextlib.contextmanager
def dir_lock(directory: str | os.PathLike, what: str):
    """Hold an exclusive lock on ``directory``/.lock while the block runs (``what``: the work,
    for the error), so that two processes never write one run directory at once (two
    ``fedforget train`` of one job, or a job left running by a killed workflow) [D]. A second
    holder gets a FedForgetError at once. Where the file system has no locks (some network
    file systems) the block runs unlocked, with a warning."""
    import fcntl

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o666 & ~current_umask())
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FedForgetError(
                f"another process is {what} in {directory} (it holds {directory}/.lock); wait for it to end or stop it"
            ) from None
        except OSError as e:  # ENOLCK, EOPNOTSUPP: no locks here
            logging.getLogger(__name__).warning("%s: no file lock (%s); %s unlocked", directory, e.strerror, what)
        yield
    finally:
        os.close(fd)  # releases the lock


def dir_busy(directory: str | os.PathLike) -> bool | None:
    """Whether a process holds ``directory``'s ``dir_lock`` now: True, False (no lock file, or
    its lock free), None where the file system has no locks (it cannot tell). The lock is
    taken and let go at once where it is free."""
    import fcntl

    try:
        fd = os.open(Path(directory) / ".lock", os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:  # ENOLCK, EOPNOTSUPP: no locks here
        return None
    finally:
        os.close(fd)


def seed_sequence(*keys: int) -> np.random.SeedSequence:
    """A numpy SeedSequence from a tuple of integers, e.g. (seed, round, STREAM_ID)."""
    return np.random.SeedSequence([int(k) for k in keys])


def _dispatch_mode():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


def host_to_device(t, device):
    """A host tensor ``t`` on ``device`` [D]: to a GPU from pinned memory without blocking
    (the copy is queued behind the work already on the device, and the host goes on); a
    plain ``.to(device)`` from pageable memory synchronises with the device, so inside a
    training step it would wait for every step queued before it. ``.to(device)`` anywhere
    else (the same tensor where it is already on ``device``). In a step a CUDA graph captures
    it cannot run (its host values would be the capture's): it raises there, and under the
    CPU stand-in of one (``fedforget.cudagraph.Tape``)."""
    import torch

    if t.device.type == "cpu" and (
        getattr(_dispatch_mode(), "forbids_host_copies", False)
        or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    ):
        raise RuntimeError("a host-to-device copy in a captured step (not capturable)")
    if t.device.type != "cpu" or device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def on_device(value, device, dtype=None):
    """``value`` (a tensor, or a Python number) as a tensor on ``device`` (in ``dtype``, if
    given) [D]: a number is filled there (``torch.full``), where ``torch.as_tensor`` would copy
    it from the host, a blocking copy that on a GPU waits for every step queued before it."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype)
    return torch.full((), value, dtype=dtype, device=device)


class Unchanged:
    """Tensors by name, each remembered at ``mark`` as that very object (held weakly) and its
    version counter [D]: ``holds(name, t)`` is true while ``t`` is the tensor marked under
    ``name`` and its counter has not moved since. Work done once on a tensor that has not
    changed (copied into a model, checked finite) is then not done again.

    An operator's in-place write bumps the counter, autograd's or under ``no_grad``, but
    some kernels write without (BatchNorm's running statistics, fused optimizers: seen on a
    CPU with torch 2.14), so only the ``names`` given are ever marked: tensors nothing writes
    into that way (a frozen encoder's weights, the same global tensors round after round);
    any other name never holds."""

    def __init__(self, names: set[str]) -> None:
        self.names = frozenset(names)
        self._marks: dict[str, tuple[weakref.ref, int]] = {}

    def mark(self, name: str, t: Any) -> None:
        if name in self.names:
            self._marks[name] = (weakref.ref(t), t._version)

    def get(self, name: str) -> Any:
        """The tensor marked under ``name`` if it still holds (else None)."""
        m = self._marks.get(name)
        t = None if m is None else m[0]()
        return t if t is not None and t._version == m[1] else None

    def holds(self, name: str, t: Any) -> bool:
        return t is not None and self.get(name) is t


def torch_seed(*keys: int) -> int:
    """A 63-bit torch seed derived from integer keys, independent of call order."""
    return int(seed_sequence(*keys).generate_state(1, dtype=np.uint64)[0]) & ((1 << 63) - 1)


def process_alive(pid: int, name: str | None = None) -> bool:
    """Whether process ``pid`` runs on this host (and, where /proc tells, has ``name`` in
    its command line: a reused pid is another process)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    cmdline = Path(f"/proc/{pid}/cmdline")
    if name is not None and cmdline.exists():
        return name.encode() in cmdline.read_bytes()
    return True


def package_versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in (
        "fedforget",
        "torch",
        "torchvision",
        "numpy",
        "scikit-learn",
        "mnist1d",
        "pandas",
        "snakemake",
        "dvc",
    ):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return out


def paper_tables(paper: dict[str, Any]) -> list[str]:
    """The linked table(s) of an experiment's paper link (``table``: one, or a list), as
    the paper results file writes them."""
    t = paper["table"]
    return [str(v) for v in t] if isinstance(t, list) else [str(t)]
