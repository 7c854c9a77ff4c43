# Locks of a killed snakemake, removed on the next run (included before everything else,
# so it runs at parse time, before Snakemake checks its locks).
import json
import os
import socket
import sys
import time
from pathlib import Path

from fedforget.utils import atomic_write_json, process_alive

# A snakemake killed by SIGKILL (or a lost node) leaves its locks in .snakemake/locks, and
# the next plain `snakemake` stops with a LockException. Each run that executes jobs
# records its pid and host in OWNER (onstart, workflow/Snakefile) and removes it when it
# ends; at parse time, before Snakemake checks its locks, locks whose recorded owner is a
# snakemake process that no longer runs on this host are removed, so the rerun resumes.
# Locks of unknown origin, or of a live or remote owner, stay: `snakemake --unlock` then,
# as Snakemake's message says, once no other snakemake runs in this directory.
OWNER = Path(".snakemake/fedforget/owner.json")


def clear_stale_locks():
    locks = Path(".snakemake/locks")
    if not locks.is_dir() or not any(locks.iterdir()):
        return
    try:
        owner = json.loads(OWNER.read_text())
        pid, host = int(owner["pid"]), owner["host"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    if host != socket.gethostname() or process_alive(pid, "snakemake"):
        return
    for f in locks.iterdir():
        f.unlink(missing_ok=True)
    OWNER.unlink(missing_ok=True)
    print(
        f"fedforget: removed the locks of a snakemake that was killed (pid {pid}, started {owner.get('started')})",
        file=sys.stderr,
    )


def record_owner():
    atomic_write_json(
        OWNER, {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    )


def forget_owner():
    OWNER.unlink(missing_ok=True)


clear_stale_locks()
