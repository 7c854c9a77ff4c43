# Locks of a killed snakemake, removed on the next run (included before everything else,
# so it runs at parse time, before Snakemake checks its locks).
import json
import os
import socket
import sys
import time
from pathlib import Path

from fedforget.utils import atomic_write_json, process_alive

# A snakemake killed by SIGKILL (or a lost node) leaves its lock files in .snakemake/locks,
# and the next plain `snakemake` stops with a LockException. Several snakemakes may run in
# one directory at once (on disjoint outputs), each with its own lock files. So each run that
# executes jobs records, at its start (onstart, workflow/Snakefile), its own record in
# OWNERS: its pid, host, and the lock files it holds (name, inode, mtime: a file of the same
# name made later by another run is not its); it removes the record when it ends. At parse
# time, before Snakemake checks its locks, the lock files of recorded owners that no longer
# run on this host are removed, and only those. Locks of a live or remote owner, or of
# unknown origin, stay: Snakemake then refuses to start where the outputs overlap (run
# `snakemake --unlock`, as its message says, once no other snakemake runs here).
OWNERS = Path(".snakemake/fedforget/owners")
LOCKS = Path(".snakemake/locks")


def _stamp(path):
    st = path.stat()
    return [st.st_ino, st.st_mtime_ns]


def clear_stale_locks():
    if not LOCKS.is_dir() or not OWNERS.is_dir():
        return
    here = socket.gethostname()
    for record in sorted(OWNERS.glob("*.json")):
        try:
            owner = json.loads(record.read_text())
            pid, host, held = int(owner["pid"]), owner["host"], dict(owner["locks"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if host != here or process_alive(pid, "snakemake"):
            continue
        removed = []
        for name, stamp in held.items():
            lock = LOCKS / name
            try:
                if _stamp(lock) == list(stamp):
                    lock.unlink()
                    removed.append(name)
            except OSError:
                pass
        record.unlink(missing_ok=True)
        if removed:
            print(
                f"fedforget: removed the locks of a snakemake that was killed (pid {pid}, started "
                f"{owner.get('started')}): {', '.join(sorted(removed))}",
                file=sys.stderr,
            )


def _record():
    return OWNERS / f"{socket.gethostname()}-{os.getpid()}.json"


def record_owner(workflow):
    """This run's record: the lock files its persistence wrote (Snakemake's own list; none
    known: nothing of this run will ever be removed by another)."""
    held = getattr(workflow.persistence, "_lockfile", None) or {}
    _record().parent.mkdir(parents=True, exist_ok=True)
    locks = {Path(p).name: _stamp(Path(p)) for p in held.values() if Path(p).exists()}
    atomic_write_json(
        _record(),
        {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "locks": locks},
    )


def forget_owner():
    _record().unlink(missing_ok=True)


clear_stale_locks()
