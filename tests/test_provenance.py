"""Provenance: the source digest of a training job (fedforget.provenance), what run.json
records, `fedforget stale`, byte-identical artefacts, file modes and progress lines."""

from __future__ import annotations

import json
import logging
import os
import shutil

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
    for fn in (provenance.imports_of, provenance.file_sha256, provenance._training_digest):
        fn.cache_clear()
    yield root
    for fn in (provenance.imports_of, provenance.file_sha256, provenance._training_digest):
        fn.cache_clear()


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
    (source_copy / "methods" / "fedprox.py").write_text(
        (source_copy / "methods" / "fedprox.py").read_text() + "\n# an edit\n"
    )
    provenance.file_sha256.cache_clear()
    provenance._training_digest.cache_clear()
    after = {m: provenance.training_code(m) for m in methods}
    assert [m for m in methods if after[m].digest != before[m].digest] == ["fedprox"]
    assert after["fedprox"].changed(before["fedprox"].files) == ["methods/fedprox.py"]
    assert provenance.training_code("fedsol", {"base": "fedprox"}).digest != combined.digest

    (source_copy / "engine.py").write_text((source_copy / "engine.py").read_text() + "\n# an edit\n")
    provenance.file_sha256.cache_clear()
    provenance._training_digest.cache_clear()
    assert all(provenance.training_code(m).digest != after[m].digest for m in methods)
    # a figure or table module is not training code
    current = {m: provenance.training_code(m).digest for m in methods}
    (source_copy / "plots.py").write_text((source_copy / "plots.py").read_text() + "\n# an edit\n")
    provenance.file_sha256.cache_clear()
    provenance._training_digest.cache_clear()
    assert {m: provenance.training_code(m).digest for m in methods} == current


def test_run_json_records_code_and_stale_lists_changed_runs(make_run_config, tmp_path, source_copy):
    rc = make_run_config(method="fedprox", rounds=1)
    rec = run_training(rc, rc.run_dir, progress=False)
    assert rec["code_digest"] == provenance.training_code("fedprox").digest
    assert rec["code_files"]["methods/fedprox.py"] and "git" in rec
    on_disk = json.loads((rc.run_dir / "run.json").read_text())
    assert on_disk["code_digest"] == rec["code_digest"]
    assert provenance.stale_reasons(rc) == []

    (source_copy / "methods" / "fedprox.py").write_text("# changed\n")
    provenance.file_sha256.cache_clear()
    provenance._training_digest.cache_clear()
    assert provenance.stale_reasons(rc) == ["code changed: methods/fedprox.py"]
    (rc.run_dir / "model.pt").unlink()
    assert "model.pt missing" in provenance.stale_reasons(rc)
    shutil.rmtree(rc.run_dir)
    assert provenance.stale_reasons(rc) == ["no run.json (never run, or deleted)"]


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
