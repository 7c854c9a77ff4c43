"""The workflow's parse-time work, cached: validation of the config and the code digests the
rules need, reused while neither the config nor the package changes.

Every ``snakemake`` call parses the Snakefile, which validates the whole config (schema,
registries, sizes: ``parse.parse_config``) and computes each training job's code digest
(``provenance.training_code``). Both need the method, model and scenario modules, hence
torch, whose import is most of a Snakemake start (about 2.5 of 3.5 s CPU on 2 cores). Both
are pure functions of three inputs: the config dict, the package's source files and the
files the config names (the papers' results CSV). ``parse_workflow`` keys its result by a
digest of all three and keeps it under ``.snakemake/fedforget/``; a later call with the same
key loads it without importing torch, and any change (an edited method, a new option, another
CSV) is a miss that validates again from scratch. Errors are never cached: a bad config
fails at every start with the same message.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import PAPER_RESULTS, WorkflowConfig, run_hash
from .provenance import strings_in
from .utils import atomic_write_bytes, canonical_json

ROOT = Path(__file__).resolve().parent
CACHE_DIR = Path(".snakemake") / "fedforget"
KEEP = 8  # cached parses kept (one per config recently used in this directory)
FORMAT = 5  # 3: digests["training_bytes"]; 4: canonical digests["code"], digests["code_bytes"];
# 5: digests["runs"][...]["client_state_mb"]


def source_digest() -> str:
    """sha256 over the package's source files (every .py, .yaml and .json under it, less
    ``__pycache__``: bytecode and provenance's kept file facts), paths and contents: any edit
    to the package changes it."""
    h = hashlib.sha256()
    for path in sorted(
        p for p in ROOT.rglob("*")
        if p.suffix in (".py", ".yaml", ".json") and "__pycache__" not in p.relative_to(ROOT).parts and p.is_file()
    ):  # fmt: skip
        h.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def parse_key(raw: Mapping[str, Any]) -> str:
    """The cache key: the config, the package source, the contents of every file the config
    names (a string that is an existing file's path), Python's version and the format. The
    config's ``only`` is left out: it selects targets and changes nothing a parse computes
    (pipeline.parse_only checks it at every start), so a dry run of part of a file reuses
    the parse of the whole."""
    raw = {k: v for k, v in raw.items() if k != "only"}
    h = hashlib.sha256()
    h.update(f"{FORMAT}\0{sys.version}\0{source_digest()}\0".encode())
    h.update(canonical_json(raw).encode())
    # the files validation reads: every string of the config naming a file, and the papers'
    # results file, named or the default (present or not: its removal is an error to report)
    for s in sorted(set(strings_in(raw)) | {str(raw.get("paper_results", PAPER_RESULTS))}):
        try:
            if len(s) < 4096 and os.path.isfile(s):
                h.update(b"\0file\0" + s.encode() + b"\0" + Path(s).read_bytes())
        except OSError:
            continue
    return h.hexdigest()[:32]


def training_key(method: str, params: Mapping[str, Any] | None) -> str:
    """How ``digests["training"]`` names a method with its hyperparameters."""
    return f"{method} {canonical_json(dict(params or {}))}"


def code_roots(wf: WorkflowConfig) -> list[tuple[str, ...]]:
    """The module sets whose code digests (``provenance.module_code``) the workflow's rules
    take as params: each prepared dataset's source with the prepared-format writer, the
    partitioner, the table, paper-table and plot modules, each figure's module."""
    from .data import DATASETS
    from .figures import FIGURES

    names = {name for name, _ in wf.datasets_to_prepare().values()}
    roots = [(DATASETS.get(n).build.__module__, "fedforget.data.base") for n in sorted(names)]
    roots += [("fedforget.partition",), ("fedforget.aggregate",), ("fedforget.paper_tables",), ("fedforget.plots",)]
    figures = sorted({FIGURES.get(f.name).__module__ for e in wf.experiments for f in e.figures})
    return roots + [("fedforget.figures", m) for m in figures]


def _validated(raw: dict[str, Any]) -> tuple[WorkflowConfig, dict[str, Any]]:
    """The torch-importing part of a parse, done on a miss only: the config validated
    (``parse.parse_config``, raising ``FedForgetError``) and what the rules need beside it,
    slow to recompute for thousands of jobs: each run's training-code digest, and the
    same in the ``bytes`` form by which runs recorded before the canonical form keep their
    identity (``training_bytes``: provenance.kept_digest), the module of each figure
    function, the code digests of the other rules (``code``, by module set:
    :func:`code_roots`, and the same in the ``bytes`` form: ``code_bytes``), and each run's
    resolved config as JSON, its hash and the host memory of the model copies its clients
    keep (the train rule's resource: ``parse.client_state_mb``) (``runs``, by run directory)."""
    from .figures import FIGURES
    from .parse import client_state_mb, parse_config
    from .provenance import BYTES, module_code, training_code

    wf = parse_config(raw)
    training = {}
    training_bytes = {}
    runs = {}
    models: dict = {}  # the models made on the meta device, for client_state_mb
    for rc in wf.runs():
        key = training_key(rc.method.name, rc.method.params)
        if key not in training:
            training[key] = training_code(rc.method.name, rc.method.params).digest
            training_bytes[key] = training_code(rc.method.name, rc.method.params, BYTES).digest
        d = rc.to_dict()
        runs[str(rc.run_dir)] = {"config": canonical_json(d), "hash": run_hash(d),
                                 "client_state_mb": client_state_mb(rc, models)}  # fmt: skip
    figures = {f.name: FIGURES.get(f.name).__module__ for e in wf.experiments for f in e.figures}
    roots = code_roots(wf)
    code = {r: module_code(*r).digest for r in roots}
    code_bytes = {r: module_code(*r, form=BYTES).digest for r in roots}
    return wf, {"training": training, "training_bytes": training_bytes, "figures": figures, "code": code,
                "code_bytes": code_bytes, "runs": runs}  # fmt: skip


def parse_workflow(
    raw: dict[str, Any], directory: str | Path = CACHE_DIR, create: bool = False
) -> tuple[WorkflowConfig, dict[str, Any]]:
    """(the validated config, its digests) for the raw config dict ``raw``: from the cache
    in ``directory`` when an earlier parse had the same key, else validated now (raising
    ``FedForgetError`` as ``parse_config`` does) and cached. The cache is written where
    ``directory``'s parent exists (a Snakemake working directory's ``.snakemake/``), or
    anywhere with ``create``: the Snakefile's parse, which Snakemake runs before it makes
    ``.snakemake/`` in a new working directory (without it, the first start there would
    cache nothing and the second would validate again). ``FEDFORGET_PARSE_CACHE=0`` turns
    the cache off."""
    use = os.environ.get("FEDFORGET_PARSE_CACHE", "1") != "0"
    directory = Path(directory)
    path = directory / f"parse-{parse_key(raw)}.pickle" if use else None
    if path is not None and path.is_file():
        try:
            wf, digests = pickle.loads(path.read_bytes())
            return wf, digests
        except Exception:  # noqa: BLE001 - a damaged or foreign cache file is a miss
            pass
    wf, digests = _validated(raw)  # a miss only: a hit stays torch-free (see the module doc)
    if path is not None and (create or directory.parent.is_dir()):  # only inside a Snakemake working dir
        atomic_write_bytes(path, pickle.dumps((wf, digests)))
        old = sorted(directory.glob("parse-*.pickle"), key=lambda p: p.stat().st_mtime)[:-KEEP]
        for p in old:
            p.unlink(missing_ok=True)
    return wf, digests
