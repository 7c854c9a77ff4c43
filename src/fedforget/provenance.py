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

A file's hash is of its canonical form (``ast-v1``, :func:`canonical_source`), so an edit
of comments, docstrings or layout reruns nothing, while any other edit, one token suffices,
reruns exactly the jobs whose code contains the file.

[D] The canonical form is the file's syntax tree, written by this module, not ``ast.dump``
and not ``tokenize``'s token stream. ast.dump's text changes between Python minor versions
(measured: ``engine.py`` dumps to three different texts on 3.11, 3.12 and 3.13), and a digest
that changes on a Python upgrade would rerun every job. The token stream (less COMMENT and
NL, INDENT and DEDENT as markers, docstrings located by ``ast``) was tried first: it is the
same on 3.10 to 3.13 once 3.12's split f-string tokens are joined, but it keeps what a
formatter adds or removes without changing behaviour, redundant parentheses and magic
trailing commas, which only a parser tells apart from meaningful ones (``(a,)`` is no
``(a)``, ``x[a,]`` no ``x[a]``): ``ruff format`` at another line length changed the token
form of 80 of the 93 package files it rewrote, and the tree form of none. The tree is what
the compiler runs: ``_write`` writes each node as its class name and its fields, sorted by
name, leaving out fields that are None or empty (the fields new versions add, such as
3.12's ``type_params``, are empty for code that does not use them), the positions
(``lineno``...: not fields), a string constant's ``u`` prefix and type comments; constants
as type-tagged values in a text fixed here (``'a'`` is ``"a"``, ``1_000`` is ``1000`` but
not ``1000.0``); and drops the docstrings, the first statement of a module, class or
function body when it is a string literal (as ``python -OO`` does; code that reads
``__doc__`` would miss an edit: none on the training side does). One version difference
is taken out: Python 3.12.1 (the 3.12 checked) puts an empty string part into an
f-string's format spec after a nested field. Checked: the form of each of the 410 files of this package, its
tests, benchmarks and a reformatted copy, and of an f-string torture file, is the same on
Python 3.10, 3.11, 3.12 and 3.13. A file that does not parse hashes as its bytes.

Runs recorded before the canonical form (run.json without ``code_digest_form``, whose digest
is of the files' bytes: form ``bytes``, :func:`recorded_form`) keep their identity while
their files are byte-identical (:func:`kept_digest`): the workflow's train rule gives such a
run its recorded digest as its rerun trigger, so Snakemake sees no change of params
(workflow/rules/common.smk: ``run_identity``, and ``train_identity`` for a run that ran
again for another reason under that digest), and ``fedforget stale`` compares it in its own
form; upgrading reruns only the runs whose files have changed since, which then get the
canonical digest. The digests of the other rules (data preparation, partitioning, tables,
figures: :func:`module_code`) are canonical too, with the same migration: a job that
Snakemake last ran under the ``bytes``-form digest of files that are still byte-identical
keeps that digest as its params value (workflow/rules/common.smk: ``kept_code``, which reads
Snakemake's metadata, as there is no run.json), so the upgrade prepares no data again
(whose new files would retrain every run by their mtimes); the first edit of such a file,
of any kind, reruns its jobs once, in the canonical form.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from .train_spec import client_threads

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
def syntax_tree(path: Path) -> ast.Module:
    """The file's syntax tree (read once: the imports and the canonical form use it)."""
    return ast.parse(path.read_bytes(), str(path))


def import_statements(tree: ast.Module) -> list[list[Any]]:
    """Every import statement of ``tree``, anywhere in it, in walk order: ``[0, None, names]``
    for ``import names``, ``[level, module, names]`` for ``from ... import names``."""
    out: list[list[Any]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.append([0, None, [a.name for a in node.names]])
        elif isinstance(node, ast.ImportFrom):
            out.append([node.level, node.module, [a.name for a in node.names]])
    return out


# [D] What the digests need of each file (its import statements and the sha256 of its
# canonical form) is kept, by the sha256 of the file's bytes, in one JSON file beside the
# package's bytecode: parsing the ~50 files of a training job's import closure was about
# 1.3 s of every job's and every uncached Snakemake parse's start (2 cores), a hit costs a
# sha256 of the bytes. An entry is used only for the bytes it was made from; the file's name
# holds the form, the Python version (whose parser made the tree) and a hash of this module
# (whose code writes the form), so no entry outlives the code that made it. Where the
# directory is not writable nothing is kept and every start parses, as before.
@cache
def facts_file() -> Path:
    """Where file facts are kept: ``__pycache__`` of the package source read (``ROOT``)."""
    own = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    return ROOT / "__pycache__" / f"provenance.{FORM}.py{sys.version_info[0]}{sys.version_info[1]}.{own}.json"


@cache
def _kept_facts() -> dict[str, dict[str, Any]]:
    try:
        kept = json.loads(facts_file().read_text())
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) else {}


def _keep_facts(key: str, facts: dict[str, Any]) -> None:
    kept = _kept_facts()
    kept[key] = facts
    path = facts_file()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        try:  # another process's entries made since this one read the file stay
            kept.update({k: v for k, v in json.loads(path.read_text()).items() if k not in kept})
        except (OSError, ValueError, AttributeError):
            pass
        path.parent.mkdir(exist_ok=True)
        tmp.write_text(json.dumps(kept, sort_keys=True))
        os.replace(tmp, path)
    except OSError:  # not writable: nothing is kept
        with contextlib.suppress(OSError):
            tmp.unlink()


@cache
def file_facts(path: Path) -> dict[str, Any] | None:
    """``{"sha256", "imports", "canonical"}`` of source file ``path`` as its bytes are now:
    the sha256 of the bytes, its :func:`import_statements` and the sha256 of its canonical
    form (``ast-v1``); None when it does not parse. Kept across processes (``facts_file``)."""
    data = path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    key = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()
    kept = _kept_facts().get(key)
    if isinstance(kept, dict) and kept.get("sha256") == sha:
        return kept
    try:
        tree = ast.parse(data, str(path))
        canonical = hashlib.sha256(canonical_source(tree).encode("utf-8", "surrogatepass")).hexdigest()
    except (SyntaxError, ValueError, RecursionError):
        return None
    facts = {"sha256": sha, "imports": import_statements(tree), "canonical": canonical}
    _keep_facts(key, facts)
    return facts


ENDED = ("completed", "diverged")  # run.json statuses of a run that ended (a diverged run's is a result)
# run.json's versions (utils.package_versions) whose change can change a result's bytes; not the
# platform string (a cluster node's kernel), nor the packages that only run the workflow
NUMERIC = ("python", "torch", "torchvision", "numpy", "scikit-learn", "mnist1d")


def versions_differ(had: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """The NUMERIC packages whose versions in ``had`` and ``now`` (``package_versions``'s
    form) differ, each as "name had (now now)"; what a kept copy (``finished``) and a
    checkpoint (``runner.check_resume_host``) are held to."""
    return [f"{k} {had.get(k)} (now {now.get(k)})" for k in NUMERIC if had.get(k) != now.get(k)]


def inputs_of(rc: Any) -> dict[str, str | None]:
    """The sha256 of each file run ``rc`` reads (None where absent): its dataset's meta.json
    (the sha256 of every array), its public set's (a held-out slice's own, or another
    dataset's) and its partition's assignment.npy (drawn in memory without the workflow).
    What a finished run's kept copy (``finished``) and a checkpoint (``runner.resume_host``)
    were computed from."""
    from .data import public_dir  # here: this module is imported before any job, without torch

    ds, data = rc.dataset, Path(rc.data_dir)
    files = [data / ds.id / "meta.json", Path(rc.partition_dir) / "assignment.npy"]
    if ds.public:
        files.append(public_dir(ds.public, ds.id, data) / "meta.json")
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else None for f in files}


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
    facts = file_facts(path)
    # a file that does not parse raises its SyntaxError here
    statements = facts["imports"] if facts is not None else import_statements(syntax_tree(path))
    out: set[str] = set()
    for level, module, names in statements:
        if module is None and not level:  # import a, b.c
            out.update(n for n in names if n.split(".")[0] == PACKAGE)
            continue
        if level:
            base = parts[: len(parts) - level + 1]
            mod = ".".join(base + ([module] if module else []))
        else:
            mod = module or ""
        if mod.split(".")[0] != PACKAGE:
            continue
        out.add(mod)
        # `from . import x` / `from .pkg import sub` may name submodules
        out.update(f"{mod}.{n}" for n in names if module_file(f"{mod}.{n}"))
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

    names = {method} | {v for v in strings_in(params or {}) if v in METHODS.names()}
    mods = {c.__module__ for n in names for c in METHODS.get(n).__mro__}
    return sorted(m for m in mods if m.split(".")[0] == PACKAGE)


def strings_in(obj: Any) -> Iterable[str]:
    """Every string in ``obj`` (nested mappings' values, lists and tuples), depth first."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from strings_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from strings_in(v)


# the form of the digests that training_code computes, and the form before it
FORM = "ast-v1"
BYTES = "bytes"
FORMS = (BYTES, FORM)

_BODIES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_NO_BEHAVIOUR = frozenset({"kind", "type_comment"})  # Constant's u prefix; a type comment


def _constant(value: Any) -> str:
    """A constant's value, type-tagged, in a text fixed here (ASCII escapes: no Unicode
    table of the running version decides what is printable)."""
    if isinstance(value, str):
        return "s" + json.dumps(value)
    if isinstance(value, bytes):
        return "b" + value.hex()
    if isinstance(value, (int, float, complex)) and not isinstance(value, bool):
        return f"{type(value).__name__}:{value!r}"
    return repr(value)  # None, True, False, Ellipsis


_FIELDS: dict[type, tuple[str, ...]] = {}  # per node class: its fields that are behaviour, sorted


def _write(node: Any, out: list[str]) -> None:
    if isinstance(node, ast.AST):
        cls = type(node)
        fields = _FIELDS.get(cls)
        if fields is None:
            fields = _FIELDS[cls] = tuple(sorted(set(cls._fields) - _NO_BEHAVIOUR))
        out.append(cls.__name__ + "(")
        for name in fields:
            value = getattr(node, name, None)
            if value is None or value == []:
                continue
            if name == "body" and isinstance(node, _BODIES) and _docstring(node):
                value = value[1:]
            elif name == "values" and cls is ast.JoinedStr:
                # Python 3.12.1 leaves an empty part after a nested field (module docstring)
                value = [v for v in value if not (type(v) is ast.Constant and v.value == "")]
            out.append(name + "=")
            if cls is ast.Constant and name == "value":
                out.append(_constant(value))
            else:
                _write(value, out)
            out.append(",")
        out.append(")")
    elif isinstance(node, list):
        out.append("[")
        for item in node:
            _write(item, out)
            out.append(",")
        out.append("]")
    elif isinstance(node, str):  # an identifier (no quote in it), a dotted module name, "*"
        out.append("'" + node + "'")
    else:  # an int field (a conversion, an import's level), or None in a list
        out.append(_constant(node))


def _docstring(node: ast.AST) -> bool:
    body = getattr(node, "body", None)
    first = body[0] if body else None
    return isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)


def canonical_source(source: bytes | ast.Module) -> str:
    """The canonical form (``ast-v1``, module docstring) of Python source ``source`` (or
    of its syntax tree): its syntax tree without docstrings, positions, parentheses and
    layout, as text. Raises SyntaxError (ValueError for a null byte) when it does not
    parse."""
    out: list[str] = []
    _write(source if isinstance(source, ast.Module) else ast.parse(source), out)
    return "".join(out)


@cache
def file_sha256(path: Path) -> str:
    """sha256 of the file's bytes (the ``bytes`` form): a source file's facts have it."""
    facts = file_facts(path) if path.suffix == ".py" else None
    return facts["sha256"] if facts is not None else hashlib.sha256(path.read_bytes()).hexdigest()


@cache
def canonical_sha256(path: Path) -> str:
    """sha256 of the file's canonical form (``ast-v1``); of its bytes, tagged, when it does
    not parse."""
    facts = file_facts(path)
    if facts is None:
        return hashlib.sha256(b"unparsed\0" + path.read_bytes()).hexdigest()
    return facts["canonical"]


def file_hash(path: Path, form: str = FORM) -> str:
    return {BYTES: file_sha256, FORM: canonical_sha256}[form](path)


def combined(files: Mapping[str, str], form: str = FORM) -> str:
    """The digest of per-file hashes ``files`` in ``form``: the ``bytes`` form's as it always
    was, a later form's with the form's name in it (so no digest of one form is another's)."""
    text = "".join(f"{k}\0{v}\n" for k, v in sorted(files.items()))
    return hashlib.sha256(((f"{form}\n" if form != BYTES else "") + text).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CodeDigest:
    digest: str  # over the files below, in order
    files: dict[str, str]  # path relative to the package -> its hash in ``form`` (first 16 hex digits)
    form: str = FORM

    def changed(self, recorded: Mapping[str, str] | None) -> list[str]:
        """Files whose hash differs from ``recorded`` (added and removed files included)."""
        recorded = recorded or {}
        return sorted(f for f in set(self.files) | set(recorded) if self.files.get(f) != recorded.get(f))


def digest_of(modules: Iterable[str], form: str = FORM) -> CodeDigest:
    files = {}
    for m in sorted(set(modules)):
        path = module_file(m)
        files[path.relative_to(ROOT).as_posix()] = file_hash(path, form)[:16]  # type: ignore[arg-type,union-attr]
    return CodeDigest(combined(files, form), files, form)


@cache
def _training_digest(modules: tuple[str, ...], form: str) -> CodeDigest:
    return digest_of(closure(TRAINING_ROOTS + modules, OUTPUT_SIDE), form)


def training_code(method: str, params: Mapping[str, Any] | None = None, form: str = FORM) -> CodeDigest:
    """The digest of the code a training job of ``method`` with ``params`` runs (in
    ``form``: ``bytes`` for runs recorded before the canonical form)."""
    return _training_digest(tuple(method_modules(method, params)), form)


def module_code(*roots: str, form: str = FORM) -> CodeDigest:
    """The digest of ``roots`` and everything they import (a dataset's source for its
    preparation, the table and figure modules for those steps), in ``form`` (``bytes`` for
    the jobs Snakemake ran before the canonical form: the module docstring)."""
    return digest_of(closure(roots), form)


def clear_caches() -> None:
    """Forget every file's hashes and imports (after the source changed under this process)."""
    for fn in (
        syntax_tree, facts_file, _kept_facts, file_facts, imports_of, file_sha256, canonical_sha256,
        _training_digest,
    ):  # fmt: skip
        fn.cache_clear()


def recorded_form(rec: Mapping[str, Any]) -> str | None:
    """The form of the code digest that run record ``rec`` (run.json) holds: its
    ``code_digest_form``, or for a record without one the form whose digest of its
    ``code_files`` is its ``code_digest`` (``bytes`` for the runs recorded before the
    canonical form); None if neither (no digest, or one this version cannot check)."""
    form = rec.get("code_digest_form")
    if form is not None:
        return form if form in FORMS else None
    files, digest = rec.get("code_files"), rec.get("code_digest")
    if not isinstance(files, Mapping) or not isinstance(digest, str):
        return None
    return next((f for f in FORMS if combined(files, f) == digest), None)


def threads_differ(rec: Mapping[str, Any], threads: int | None, lanes: int = 1) -> str | None:
    """Why finished run record ``rec`` (run.json) is not what a train job on ``threads``
    torch threads would write, or None: on a CPU the bytes of a result depend on the thread
    count (float summation order: in a digits CNN round, oneDNN's convolution weight gradient,
    and with oneDNN off a small GEMM, is the first op whose bytes differ between 1 and 2
    threads, ``benchmarks/thread_ops.py``, results/cpu-2026-11-28/thread_ops.txt), so a CPU run
    adopted by ``snakemake --touch`` must have been made on the count this invocation's train
    jobs get [D, issue 34]. A run on a GPU (``device`` not cpu) is not compared: its math runs
    on the GPU. None too when either count is unknown (a record without ``torch_threads``, a
    thread count that is not a number). The threads each client trained on count too
    (``client_threads``: fewer where ``lanes`` clients trained or replied at once,
    ``train.concurrent_clients``)."""
    had = rec.get("torch_threads")
    if not isinstance(threads, int) or not isinstance(had, int) or not str(rec.get("device", "")).startswith("cpu"):
        return None
    if had != threads:
        return f"torch threads {had} on the CPU (this invocation's train jobs: {threads})"
    per = rec.get("client_threads", had)
    want = client_threads(threads, lanes)
    if isinstance(per, int) and per != want:
        return f"{per} torch threads per client on the CPU (this invocation's train jobs: {want}, train.concurrent_clients: {lanes})"
    return None


def kept_digest(rec: Mapping[str, Any] | None, current_bytes: str) -> bool:
    """Whether finished run record ``rec`` keeps its recorded code digest as its identity
    (the migration to the canonical form): it holds a ``bytes``-form digest (recorded before
    the canonical form), equal to ``current_bytes``, the ``bytes``-form digest of the same
    job's current code, i.e. its files are byte-identical to those it ran. Any other run's
    identity has the canonical digest."""
    return (
        isinstance(rec, Mapping)
        and rec.get("status") in ENDED
        and rec.get("code_digest") == current_bytes
        and recorded_form(rec) == BYTES
    )


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
    path = Path(run_dir or rc.run_dir) / "run.json"
    if not path.is_file():
        return ["no run.json (never run, or deleted)"]
    try:
        rec = json.loads(path.read_text())
    except json.JSONDecodeError:
        return [f"{path} is not valid JSON"]
    reasons = []
    if rec.get("status") not in ENDED:
        reasons.append(f"status {rec.get('status')!r}")
    for name in ("metrics.csv", "model.pt") if rec.get("status") == "completed" else ("metrics.csv",):
        if not (path.parent / name).is_file():
            reasons.append(f"{name} missing")
    if rec.get("config_hash") != rc.hash:
        reasons.append(f"config changed ({str(rec.get('config_hash'))[:12]} -> {rc.hash})")
    # compared in the form it was recorded in: a run recorded before the canonical form is
    # current while its files are byte-identical (kept_digest)
    form = recorded_form(rec) if rec.get("code_files") else None
    code = training_code(rc.method.name, rc.method.params, form or FORM)
    if rec.get("code_digest") != code.digest:
        if not rec.get("code_files"):
            changed = ["no code digest recorded"]
        elif form is None:
            changed = [f"recorded in a form this version cannot check ({rec.get('code_digest_form')!r})"]
        else:
            changed = code.changed(rec.get("code_files"))
        reasons.append("code changed: " + ", ".join(changed))
    return reasons
