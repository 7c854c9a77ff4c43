"""Provenance: the source digest of a training job (fedforget.provenance), what run.json
records, `fedforget stale`, byte-identical artefacts, file modes and progress lines."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from fedforget import provenance
from fedforget.runner import run_training
from fedforget.utils import atomic_write_text


@pytest.fixture
def source_copy(tmp_path, monkeypatch):
    """A copy of the package source that provenance reads instead of the real one."""
    root = tmp_path / "fedforget"
    shutil.copytree(provenance.ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(provenance, "ROOT", root)
    provenance.clear_caches()
    yield root
    provenance.clear_caches()


def edit(path, old: str, new: str, count: int = 1) -> None:
    """Replace ``old`` by ``new`` in the file (it must occur), and forget every hash."""
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, count))
    provenance.clear_caches()


def test_file_facts_are_kept_by_bytes_and_equal_a_fresh_parse(source_copy, monkeypatch):
    """[D] Each file's imports and canonical hash are kept in ``__pycache__``
    (provenance.facts_file): a new process's digests come from them without parsing and
    equal a fresh parse's; an edited file alone is parsed again; where nothing can be
    written every file is parsed and no digest changes."""
    import ast

    real_parse, parsed = ast.parse, []

    def counting(source, filename="<unknown>", *args, **kwargs):
        parsed.append(Path(filename).relative_to(source_copy).as_posix())
        return real_parse(source, filename, *args, **kwargs)

    cold = provenance.training_code("fedsol", {"base": "fedprox"})  # the copy has no __pycache__
    kept = json.loads(provenance.facts_file().read_text())
    assert set(cold.files) <= set(kept) and provenance.facts_file().parent == source_copy / "__pycache__"
    provenance.clear_caches()  # a new process: only the kept file is left
    with monkeypatch.context() as m:
        m.setattr(ast, "parse", counting)
        assert provenance.training_code("fedsol", {"base": "fedprox"}) == cold and parsed == []
        fedprox = source_copy / "methods" / "fedprox.py"
        fedprox.write_text(fedprox.read_text() + "\nEDITED = 1\n")
        provenance.clear_caches()
        edited = provenance.training_code("fedsol", {"base": "fedprox"})
    assert parsed == ["methods/fedprox.py"]
    assert edited.changed(cold.files) == ["methods/fedprox.py"]
    # not writable: __pycache__ is a file here
    shutil.rmtree(source_copy / "__pycache__")
    (source_copy / "__pycache__").write_text("")
    provenance.clear_caches()
    assert provenance.training_code("fedsol", {"base": "fedprox"}) == edited
    assert provenance.training_code("fedavg", form="bytes").form == "bytes"


def test_training_closure_is_the_training_side():
    mods = provenance.closure(provenance.TRAINING_ROOTS, provenance.OUTPUT_SIDE)
    assert {"fedforget.engine", "fedforget.vectorized", "fedforget.models", "fedforget.data.base",
            "fedforget.methods.base", "fedforget.partition", "fedforget.metrics"} <= set(mods)  # fmt: skip
    # no method module (they are loaded by the registry), nothing output-side
    assert not [m for m in mods if m.startswith("fedforget.methods.") and m not in (
        "fedforget.methods.base", "fedforget.methods.registry")]  # fmt: skip
    assert not set(mods) & provenance.OUTPUT_SIDE
    files = provenance.training_code("fedproj").files
    assert {"methods/fedproj.py", "methods/feddf.py", "methods/distill.py"} <= set(files)  # imports followed
    assert "methods/fedprox.py" not in files
    assert "methods/fedprox.py" in provenance.training_code("fedsol", {"base": "fedprox"}).files


def test_editing_a_method_changes_only_its_digests(source_copy):
    methods = ("fedavg", "fedprox", "fedsol", "moon")
    before = {m: provenance.training_code(m) for m in methods}
    combined = provenance.training_code("fedsol", {"base": "fedprox"})
    fedprox = source_copy / "methods" / "fedprox.py"
    edit(fedprox, "    name = ", "    EDITED = 1\n    name = ")
    after = {m: provenance.training_code(m) for m in methods}
    assert [m for m in methods if after[m].digest != before[m].digest] == ["fedprox"]
    assert after["fedprox"].changed(before["fedprox"].files) == ["methods/fedprox.py"]
    assert provenance.training_code("fedsol", {"base": "fedprox"}).digest != combined.digest

    engine = source_copy / "engine.py"
    edit(engine, "\nimport ", "\nEDITED = 1\nimport ")
    assert all(provenance.training_code(m).digest != after[m].digest for m in methods)
    # a figure or table module is not training code
    current = {m: provenance.training_code(m).digest for m in methods}
    edit(source_copy / "plots.py", "\nimport ", "\nEDITED = 1\nimport ")
    assert {m: provenance.training_code(m).digest for m in methods} == current


def test_the_other_rules_digests_ignore_comments_too(source_copy):
    """Issue 34, 5: the digests of preparation, partitioning, tables and figures
    (module_code) are canonical as well; their bytes form sees every edit."""
    roots = [("fedforget.partition",), ("fedforget.aggregate",), ("fedforget.data.sources.table", "fedforget.data.base")]
    before = {r: provenance.module_code(*r).digest for r in roots}
    legacy = {r: provenance.module_code(*r, form=provenance.BYTES).digest for r in roots}
    for name in ("partition.py", "aggregate.py", "data/base.py"):
        edit(source_copy / name, "\nimport ", "\n# a comment\nimport ")
    assert {r: provenance.module_code(*r).digest for r in roots} == before
    assert all(provenance.module_code(*r, form=provenance.BYTES).digest != legacy[r] for r in roots)
    edit(source_copy / "partition.py", "\nimport ", "\nEDITED = 1\nimport ")
    after = {r: provenance.module_code(*r).digest for r in roots}
    # the table code imports the partitioner (PartitionSpec), a dataset's source does not
    assert [r for r in roots if after[r] != before[r]] == roots[:2]


def test_comments_docstrings_and_layout_change_no_digest(source_copy):
    """Issue 34, 5: the digest is of each file's canonical form (provenance: ast-v1), so
    an edit of comments, docstrings or layout reruns nothing; one token of behaviour reruns
    exactly the jobs whose code holds the file."""
    methods = ("fedavg", "fedprox", "fedsol", "moon")
    before = {m: provenance.training_code(m).digest for m in methods}
    combined = provenance.training_code("fedsol", {"base": "fedprox"}).digest
    bytes_before = provenance.training_code("fedprox", form=provenance.BYTES)
    fedprox = source_copy / "methods" / "fedprox.py"
    source = fedprox.read_bytes()

    def digests():
        return {m: provenance.training_code(m).digest for m in methods}

    # comments: edited, added, and a whole-line one
    edit(fedprox, "# proximal weight;", "# the proximal weight (an edited comment);")
    edit(fedprox, "    def client_begin", "    # a new comment\n    def client_begin")
    assert digests() == before
    # docstrings: the module's, a method's (edited), and one added to a class
    edit(fedprox, '"""FedProx (Li,', '"""FedProx, the method of (Li,')
    edit(fedprox, "The proximal term, per client of the stack:", "Per client of the stack, the proximal term")
    edit(fedprox, "class FedProx(FedAvg):\n", 'class FedProx(FedAvg):\n    """A new docstring."""\n\n')
    assert digests() == before
    # layout: a call and a tuple split over lines (with a formatter's trailing commas and
    # parentheses), other quotes, blank lines, a line joined
    edit(fedprox, "number(1.0, minimum=0)", "number(\n            1.0,\n            minimum=0,\n        )")
    edit(fedprox, "return 0.5 * mu * sq, None, None", "return (\n                0.5 * mu * sq,\n                None,\n                None,\n            )")
    edit(fedprox, 'ctx.stats["dist_to_global"]', "ctx.stats['dist_to_global']")
    edit(fedprox, "\n\n\n@METHODS", "\n\n\n\n\n@METHODS")
    assert fedprox.read_bytes() != source
    assert digests() == before
    assert provenance.training_code("fedsol", {"base": "fedprox"}).digest == combined
    # the bytes form (of runs recorded before the canonical one) sees every edit
    assert provenance.training_code("fedprox", form=provenance.BYTES).changed(bytes_before.files) == [
        "methods/fedprox.py"
    ]

    # one token of behaviour: that method's digests only
    edit(fedprox, "0.5 * mu * sq", "0.25 * mu * sq")
    after = digests()
    assert [m for m in methods if after[m] != before[m]] == ["fedprox"]
    assert provenance.training_code("fedsol", {"base": "fedprox"}).digest != combined
    assert provenance.training_code("fedprox").changed(provenance.training_code("fedavg").files) == [
        "methods/fedprox.py"
    ]


@pytest.mark.parametrize(
    "a,b,same",
    [
        ("x = 1  # c\n", "x = 1\n", True),
        ('def f():\n    """a"""\n    return 1\n', "def f():\n    return 1\n", True),
        ('def f(): """d"""\nx = 1\n', "def f(): x = 1\n", False),  # not the same body
        ('x = 1\n"""not a docstring"""\n', 'x = 1\n"""another"""\n', False),
        ("f(a, b)\n", "f(\n    a,\n    b,\n)\n", True),
        ("x = a + b\n", "x = (\n    a\n    + b\n)\n", True),
        ("x = (a,)\n", "x = (a)\n", False),  # a tuple is no parenthesised name
        ("x = y[a,]\n", "x = y[a]\n", False),
        ("x = (a + b) * c\n", "x = a + b * c\n", False),
        ("x = 'a'\n", 'x = "a"\n', True),
        ("x = 1_000\n", "x = 1000\n", True),
        ("x = 1000\n", "x = 1000.0\n", False),
        ("x = True\n", "x = 1\n", False),
        ("if x:\n    a\nb\n", "if x:\n    a\n    b\n", False),
        ('x = f"{a!r:>{w}}"\n', 'x = f"{a!s:>{w}}"\n', False),
        ('x = b"a"\n', 'x = "a"\n', False),
    ],
)
def test_the_canonical_form_keeps_behaviour_only(a, b, same):
    assert (provenance.canonical_source(a.encode()) == provenance.canonical_source(b.encode())) is same


def test_run_json_records_code_and_stale_lists_changed_runs(make_run_config, tmp_path, source_copy):
    rc = make_run_config(method="fedprox", rounds=1)
    rec = run_training(rc, rc.run_dir, progress=False)
    assert rec["code_digest"] == provenance.training_code("fedprox").digest
    assert rec["code_files"]["methods/fedprox.py"] and "git" in rec
    assert provenance.recorded_form(rec) == provenance.FORM
    on_disk = json.loads((rc.run_dir / "run.json").read_text())
    assert on_disk["code_digest"] == rec["code_digest"]
    assert provenance.stale_reasons(rc) == []
    edit(source_copy / "methods" / "fedprox.py", "\n@METHODS", "\n# a comment\n@METHODS")
    assert provenance.stale_reasons(rc) == []

    (source_copy / "methods" / "fedprox.py").write_text("# changed\n")
    provenance.clear_caches()
    assert provenance.stale_reasons(rc) == ["code changed: methods/fedprox.py"]
    (rc.run_dir / "model.pt").unlink()
    assert "model.pt missing" in provenance.stale_reasons(rc)
    shutil.rmtree(rc.run_dir)
    assert provenance.stale_reasons(rc) == ["no run.json (never run, or deleted)"]


def test_runs_recorded_before_the_canonical_form_keep_their_identity(make_run_config, source_copy):
    """Issue 34, 5, migration: a finished run whose run.json holds a digest of its files'
    bytes (the form before the canonical one, no code_digest_form) keeps that digest as its
    identity, and is current, while those files are byte-identical; once one changes, even
    by a comment, it is stale and gets the canonical digest (workflow: run_identity)."""
    rc = make_run_config(method="fedprox", rounds=1)
    run_training(rc, rc.run_dir, progress=False)
    path = rc.run_dir / "run.json"
    old = provenance.training_code("fedprox", form=provenance.BYTES)
    rec = json.loads(path.read_text())
    rec.update(code_digest=old.digest, code_files=old.files)  # as the version before wrote it
    rec.pop("code_digest_form", None)
    path.write_text(json.dumps(rec))
    assert provenance.recorded_form(rec) == provenance.BYTES
    assert old.digest != provenance.training_code("fedprox").digest  # no form's digest is another's

    def current_bytes():
        return provenance.training_code("fedprox", form=provenance.BYTES).digest

    assert provenance.kept_digest(rec, current_bytes())
    assert provenance.stale_reasons(rc) == []
    # another method's file: not this run's code
    edit(source_copy / "methods" / "moon.py", "\nimport ", "\nEDITED = 1\nimport ")
    assert provenance.kept_digest(rec, current_bytes()) and provenance.stale_reasons(rc) == []
    # an unfinished run keeps nothing (it runs again anyway)
    assert not provenance.kept_digest({**rec, "status": "running"}, current_bytes())
    # a record in the canonical form is not kept: its digest is the current one, or stale
    new = provenance.training_code("fedprox")
    assert not provenance.kept_digest({**rec, "code_digest": new.digest, "code_files": new.files}, current_bytes())

    # one of its files changed, by a comment: its bytes differ, so it is stale (reruns once)
    edit(source_copy / "methods" / "fedprox.py", "\n@METHODS", "\n# a comment\n@METHODS")
    assert not provenance.kept_digest(rec, current_bytes())
    assert provenance.stale_reasons(rc) == ["code changed: methods/fedprox.py"]
    # a form this version does not know: stale, never taken as current
    path.write_text(json.dumps({**rec, "code_digest_form": "future-v9"}))
    assert provenance.stale_reasons(rc) == ["code changed: recorded in a form this version cannot check ('future-v9')"]


def test_identical_runs_write_identical_model_bytes(make_run_config, tmp_path):
    rc = make_run_config(rounds=2, checkpoint_every=1)
    a, b = tmp_path / "a", tmp_path / "b"
    run_training(rc, a, progress=False)
    run_training(rc, b, progress=False)
    assert (a / "model.pt").read_bytes() == (b / "model.pt").read_bytes()
    assert (a / "metrics.csv").read_bytes() == (b / "metrics.csv").read_bytes()


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_written_files_respect_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "x.txt", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "x.txt").stat().st_mode & 0o777 == mode


def test_training_outputs_are_readable_by_the_group(make_run_config, tmp_path):
    old = os.umask(0o022)
    try:
        out = tmp_path / "run"
        run_training(make_run_config(rounds=1), out, progress=False)
    finally:
        os.umask(old)
    for f in out.iterdir():
        assert f.stat().st_mode & 0o777 == 0o644, f


def test_progress_lines_without_a_terminal(make_run_config, tmp_path, caplog):
    """progress=None and no terminal (pytest captures stderr): one line per log_every
    rounds and the last, with round, global accuracy, loss and elapsed time."""
    caplog.set_level(logging.INFO, logger="fedforget.progress")
    run_training(make_run_config(rounds=5, log_every=2), tmp_path / "r", progress=None)
    lines = [r.getMessage() for r in caplog.records if r.name == "fedforget.progress"]
    assert [ln.split(" round ")[1].split(":")[0] for ln in lines] == ["2/5", "4/5", "5/5"]
    assert "global-model test acc" in lines[0] and "%" in lines[0] and "elapsed" in lines[0]
    caplog.clear()
    run_training(make_run_config(rounds=2), tmp_path / "q", progress=False)
    assert not [r for r in caplog.records if r.name == "fedforget.progress"]


def test_threads_differ_for_cpu_runs_only():
    """--touch adoption (workflow/rules/common.smk, check_adopted_results): a CPU run made on
    another torch thread count is named with both counts; a GPU run, a record without the
    count and an unknown job count are not compared."""
    cpu = {"device": "cpu", "torch_threads": 4}
    assert provenance.threads_differ(cpu, 4) is None
    assert provenance.threads_differ(cpu, 1) == "torch threads 4 on the CPU (this invocation's train jobs: 1)"
    assert provenance.threads_differ({"device": "cuda:0", "torch_threads": 4}, 1) is None
    assert provenance.threads_differ({"device": "cpu"}, 1) is None
    assert provenance.threads_differ(cpu, None) is None
    # clients trained (or replying) at once share the threads (train.concurrent_clients): the
    # per-client count is compared too
    lanes = {"device": "cpu", "torch_threads": 4, "client_threads": 2}
    assert provenance.threads_differ(lanes, 4, 2) is None
    assert provenance.threads_differ(lanes, 4, 1) == (
        "2 torch threads per client on the CPU (this invocation's train jobs: 4, train.concurrent_clients: 1)"
    )
    assert provenance.threads_differ({**lanes, "client_threads": 4}, 4, 1) is None  # recorded before lanes
