"""Which source code made a result: a digest of the package files a training job runs.

A job's results are a function of its config (``RunConfig.hash``), its data (the prepared
files) and the code that computes them. The code part is the static import closure, within
this package, of the training side (``runner``: engine, data loading, models, partitions,
the method hook API) plus the job's own method module and what it imports. Method modules
are loaded by the methods package through ``pkgutil`` (a registry, no static import), so
one method's file enters only the digests of its own jobs, and of jobs of methods that
name it in their hyperparameters (FedSOL's combined mode ``base: fedprox``). Editing
``methods/fedprox.py`` therefore changes only FedProx's (and FedProx-based) digests;
editing the engine changes every digest.

The workflow passes the digest to each training job as a rerun trigger, the job records it
in run.json (with every file's own hash and the git commit when there is one), and
``fedforget stale`` compares finished runs with the current code.
"""

from __future__ import annotations

import ast
import hashlib
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

PACKAGE = "fedforget"
ROOT = Path(__file__).resolve().parent

# the training side: run.json's code digest covers these and everything they import
TRAINING_ROOTS = ("fedforget.runner",)
# modules that never compute a job's results: they draw, tabulate, dispatch or check a
# config's form (the config module imports plots and figures only to check figure labels,
# validation for its error messages; methods.params declares and checks hyperparameters,
# whose values reach a job through its config hash)
OUTPUT_SIDE = frozenset({
    "fedforget.plots", "fedforget.figures", "fedforget.aggregate", "fedforget.cli",
    "fedforget.pipeline", "fedforget.__main__", "fedforget.provenance", "fedforget.validation",
    "fedforget.methods.params", "fedforget.reference",
})  # fmt: skip


def module_file(name: str) -> Path | None:
    """The source file of package module ``name`` (None if there is none)."""
    rel = Path(*name.split(".")[1:])
    for path in (ROOT / rel / "__init__.py", (ROOT / rel).with_suffix(".py")):
        if path.is_file():
            return path
    return None


@cache
def imports_of(name: str) -> frozenset[str]:
    """Package modules that module ``name`` imports anywhere in its source (also inside
    functions and ``TYPE_CHECKING`` blocks: over-inclusion reruns a job, omission would
    leave a stale result)."""
    path = module_file(name)
    if path is None:
        return frozenset()
    is_pkg = path.name == "__init__.py"
    parts = name.split(".") if is_pkg else name.split(".")[:-1]  # the importing package
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != PACKAGE:
                continue
            out.add(mod)
            # `from . import x` / `from .pkg import sub` may name submodules
            out.update(f"{mod}.{a.name}" for a in node.names if module_file(f"{mod}.{a.name}"))
    return frozenset(m for m in out if module_file(m) is not None)


def closure(roots: Iterable[str], exclude: frozenset[str] = frozenset()) -> list[str]:
    """``roots`` and every package module they import, transitively, less ``exclude``."""
    seen: set[str] = set()
    todo = [r for r in roots if r not in exclude]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(d for d in imports_of(m) if d not in seen and d not in exclude)
    return sorted(seen)


def method_modules(method: str, params: Mapping[str, Any] | None = None) -> list[str]:
    """The modules of method ``method`` (its class and base classes in this package) and of
    every registered method its hyperparameters name (a combined mode's ``base``)."""
    from .methods import METHODS

    names = {method} | {v for v in _strings(params or {}) if v in METHODS.names()}
    mods = {c.__module__ for n in names for c in METHODS.get(n).__mro__}
    return sorted(m for m in mods if m.split(".")[0] == PACKAGE)


def _strings(obj: Any) -> Iterable[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _strings(v)


@cache
def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class CodeDigest:
    digest: str  # over the files below, in order
    files: dict[str, str]  # path relative to the package -> sha256 (first 16 hex digits)

    def changed(self, recorded: Mapping[str, str] | None) -> list[str]:
        """Files whose hash differs from ``recorded`` (added and removed files included)."""
        recorded = recorded or {}
        return sorted(f for f in set(self.files) | set(recorded) if self.files.get(f) != recorded.get(f))


def digest_of(modules: Iterable[str]) -> CodeDigest:
    files = {}
    for m in sorted(set(modules)):
        path = module_file(m)
        files[path.relative_to(ROOT).as_posix()] = file_sha256(path)[:16]  # type: ignore[union-attr]
    h = hashlib.sha256("".join(f"{k}\0{v}\n" for k, v in sorted(files.items())).encode())
    return CodeDigest(h.hexdigest()[:16], files)


@cache
def _training_digest(modules: tuple[str, ...]) -> CodeDigest:
    return digest_of(closure(TRAINING_ROOTS + modules, OUTPUT_SIDE))


def training_code(method: str, params: Mapping[str, Any] | None = None) -> CodeDigest:
    """The digest of the code a training job of ``method`` with ``params`` runs."""
    return _training_digest(tuple(method_modules(method, params)))


def module_code(*roots: str) -> CodeDigest:
    """The digest of ``roots`` and everything they import (a dataset's source for its
    preparation, the table and figure modules for those steps)."""
    return digest_of(closure(roots))


@cache
def git_commit() -> dict[str, Any] | None:
    """{"commit", "dirty"} of the git work tree the package source lives in, or None (an
    installed wheel, or no git)."""
    try:
        run = lambda *a: subprocess.run(  # noqa: E731
            ["git", "-C", str(ROOT), *a], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        commit = run("rev-parse", "HEAD")
        dirty = bool(run("status", "--porcelain", "--untracked-files=no", "--", "."))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def stale_reasons(rc: Any, run_dir: str | Path | None = None) -> list[str]:
    """Why the finished run of ``rc`` (a RunConfig) in ``run_dir`` (default its run_dir)
    does not stand for the current config and code; [] if it does. A run that diverged is
    finished (its status is a result)."""
    import json

    path = Path(run_dir or rc.run_dir) / "run.json"
    if not path.is_file():
        return ["no run.json (never run, or deleted)"]
    try:
        rec = json.loads(path.read_text())
    except json.JSONDecodeError:
        return [f"{path} is not valid JSON"]
    reasons = []
    if rec.get("status") not in ("completed", "diverged"):
        reasons.append(f"status {rec.get('status')!r}")
    for name in ("metrics.csv", "model.pt") if rec.get("status") == "completed" else ("metrics.csv",):
        if not (path.parent / name).is_file():
            reasons.append(f"{name} missing")
    if rec.get("config_hash") != rc.hash:
        reasons.append(f"config changed ({str(rec.get('config_hash'))[:12]} -> {rc.hash})")
    code = training_code(rc.method.name, rc.method.params)
    if rec.get("code_digest") != code.digest:
        changed = code.changed(rec.get("code_files")) if rec.get("code_files") else ["no code digest recorded"]
        reasons.append("code changed: " + ", ".join(changed))
    return reasons
