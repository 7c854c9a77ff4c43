"""A finished run's outputs, kept where a failed Snakemake group does not delete them.

Snakemake runs a group's jobs (profiles/slurm: up to ``group-components`` training jobs in one
submission, issue 32) as one job. When one of them fails, it removes the outputs of every job
of the group, finished ones included ("Removing output files of failed job train since they
might be corrupted"), and its retry runs them all again (``--force``). A finished run has no
checkpoint.pt left to resume from, so without this module each sibling would train again from
round 0, and once the retries are spent its results would be gone (seen on the test cluster:
one failing job of a submission of two deleted its sibling's finished run twice).

[D] ``fedforget train`` keeps hard links of a finished run's outputs (``OUTPUTS``, rule train's)
under ``<run dir>/.finished/`` (a copy where the file system has no hard links; nothing more on
disk otherwise), with the sha256 of the files it read (``INPUTS``: the prepared data's
meta.json, which holds each array's sha256, its public set's, the partition's assignment). When
it is asked to train a run whose directory holds such a copy of the same run
(``provenance.stale_reasons``: the same config hash and code digest; the same inputs; the same
versions of the packages the arithmetic runs on, ``NUMERIC``; the same device type, on a GPU
the same GPU model, on a CPU the same torch threads, ``provenance.threads_differ``), it puts
those outputs back instead of training: the result that the same command already produced. A
run that differs in any of these trains as before, and its start removes the old copy.
``fedforget train --fresh`` trains anyway; deleting the run directory does too.

Not in the training code's digest (``provenance.training_code``): only the CLI imports it, so
finished runs are not rerun by its changes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from .provenance import ENDED, inputs_of, stale_reasons, threads_differ, versions_differ
from .utils import dir_busy, package_versions

KEPT = ".finished"  # in the run directory
# rule train's outputs (workflow/rules/train.smk), every one written by a run that finished;
# run.json last, so a copy without it is never taken for a whole one
OUTPUTS = ("metrics.csv", "timings.csv", "tasks.csv", "accuracy_matrix.csv", "model.pt", "run.json")
INPUTS = "inputs.json"  # in the kept copy: {input file: sha256, or None where absent}
STOPPED = "run.stopped.json"  # a run.json set aside by set_aside_stopped


def _link(src: Path, dst: Path) -> None:
    """``dst`` becomes ``src``'s file (a hard link, else a copy), replacing what is there in
    one rename: a reader sees the old file or the new one."""
    tmp = dst.with_name(f".{dst.name}.{KEPT[1:]}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:  # no hard links here (some network and FUSE file systems)
        shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def keep(rc: Any, out_dir: str | Path) -> bool:
    """After run ``rc`` finished in ``out_dir``: its outputs linked under ``.finished/`` (a
    previous copy replaced) with its inputs' sha256. False, and nothing kept, if an output is
    missing."""
    out = Path(out_dir)
    if not all((out / name).is_file() for name in OUTPUTS):
        return False
    kept, tmp = out / KEPT, out / f"{KEPT}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    (tmp / INPUTS).write_text(json.dumps(inputs_of(rc), indent=1, sort_keys=True) + "\n")
    for name in OUTPUTS:
        _link(out / name, tmp / name)
    shutil.rmtree(kept, ignore_errors=True)
    os.replace(tmp, kept)
    return True


def drop(out_dir: str | Path) -> None:
    """Before a run trains in ``out_dir``: the copy of an earlier one removed (it stands for
    another config, code or machine, or for the run this one replaces)."""
    out = Path(out_dir)
    for d in (out / KEPT, out / f"{KEPT}.tmp"):
        shutil.rmtree(d, ignore_errors=True)


def why_not_restored(
    rc: Any, out_dir: str | Path, device: str, threads: int | None, gpu: str | None = None
) -> str | None:
    """Why the copy kept in ``out_dir`` is not the run ``rc`` (a RunConfig) on ``device``
    (its type: cpu, cuda; ``gpu``: the GPU's name) with ``threads`` torch threads and this
    process's package versions; None if it is."""
    kept = Path(out_dir) / KEPT
    missing = [name for name in OUTPUTS if not (kept / name).is_file()]
    if missing:
        return f"no kept copy ({', '.join(missing)} missing in {kept})"
    reasons = stale_reasons(rc, kept)
    if reasons:
        return "; ".join(reasons)
    try:
        read = json.loads((kept / INPUTS).read_text())
    except (OSError, ValueError):
        return f"no record of its inputs ({kept / INPUTS})"
    changed = [f for f, h in inputs_of(rc).items() if read.get(f, "unrecorded") != h]
    if changed:
        return f"inputs changed since: {', '.join(changed)}"
    rec = json.loads((kept / "run.json").read_text())
    other = versions_differ(rec.get("versions") or {}, package_versions())
    if other:
        return f"other versions: {', '.join(other)}"
    kind = str(rec.get("device", "")).split(":")[0]
    if kind != device:
        return f"trained on {kind or 'an unrecorded device'}, this job runs on {device}"
    made_on = (rec.get("host") or {}).get("gpu")
    if device == "cuda" and made_on != gpu:
        return f"trained on a {made_on}, this job runs on a {gpu}"
    return threads_differ(rec, threads, rc.train.concurrent_clients)


def restore(
    rc: Any, out_dir: str | Path, device: str, threads: int | None, gpu: str | None = None
) -> dict[str, Any] | None:
    """The kept copy of run ``rc`` put back as ``out_dir``'s outputs (``why_not_restored``
    is None), each with the time of now (Snakemake then sees outputs newer than their
    inputs); its run.json record, or None where nothing was restored. A checkpoint.pt left
    there goes: the directory is then the finished run's, as its end left it (any training
    since would have dropped the copy first)."""
    if why_not_restored(rc, out_dir, device, threads, gpu) is not None:
        return None
    from .checkpoint import CHECKPOINT  # (torch: only where a copy is put back)

    out, kept = Path(out_dir), Path(out_dir) / KEPT
    for name in OUTPUTS:  # run.json last
        _link(kept / name, out / name)
        os.utime(out / name)
    (out / CHECKPOINT).unlink(missing_ok=True)
    return json.loads((out / "run.json").read_text())


def set_aside_stopped(run_dirs: Any) -> tuple[list[str], list[str]]:
    """The runs among ``run_dirs`` that stopped before their end, outside Snakemake: a
    run.json whose status is not an end (``running``: the process was killed, ``failed``)
    while no process holds the directory (``utils.dir_busy``). Snakemake removes a failed or
    killed job's outputs itself, but not those of ``fedforget train`` run by hand: one killed
    after model.pt and before its last run.json left every output of rule train in place,
    and Snakemake took it for finished [D, found in review]. Each such run.json is moved to
    ``run.stopped.json`` (kept for the record), so that Snakemake, a declared output
    missing, trains the run again (from its checkpoint.pt where one is left). Returns (the
    directories set aside, those left because their file system cannot tell whether a
    process holds them)."""
    moved, unknown = [], []
    for d in run_dirs:
        path = Path(d) / "run.json"
        try:
            status = json.loads(path.read_text()).get("status")
        except FileNotFoundError:
            continue
        except (OSError, ValueError, AttributeError):
            status = None  # unreadable: a writer killed mid-write cannot leave it (atomic), so a stray file
        if status in ENDED:
            continue
        busy = dir_busy(d)
        if busy is None:
            unknown.append(str(d))
        elif not busy:
            os.replace(path, Path(d) / STOPPED)
            moved.append(str(d))
    return moved, unknown
