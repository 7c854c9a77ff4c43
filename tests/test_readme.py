"""The README's facts against the code: its method count and list against the registry, its
job counts against the default config, its links against the files, its length (a guide of
at most about 300 lines; reference material lives in docs/)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from fedforget.methods import METHODS
from fedforget.parse import load_config

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_method_count_and_every_method_named():
    n = int(re.search(r"(\d+) methods \(`fedforget methods`\)", README).group(1))
    assert n == len(METHODS.names()), f"README.md says {n} methods, the registry has {len(METHODS.names())}: update README.md"
    flat = README.lower().replace("-", "")
    missing = [m for m in METHODS.names() if m not in flat]
    assert not missing, f"README.md's method list lacks {missing}"


def test_every_method_has_a_row_in_the_methods_table():
    """docs/methods.md's table names every registered method's module (FedAvgM had none)."""
    import importlib

    table = (ROOT / "docs" / "methods.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    missing = [m for m in METHODS.names()
               if not any(f"`{importlib.import_module(METHODS.get(m).__module__).__file__.rsplit('/', 1)[-1]}`" in r
                          for r in rows)]  # fmt: skip
    assert not missing, f"add a row for {missing} to docs/methods.md's table"


def test_the_methods_tables_defaults_are_the_params_defaults():
    """docs/methods.md's defaults column is written by hand: each 'name value' in it that
    names a field of the row's method's Params must be that field's default (Tar+LODE's rho
    had stayed at 0.1 there when its default moved)."""
    import dataclasses
    import importlib

    by_file: dict[str, list[str]] = {}
    for m in METHODS.names():
        by_file.setdefault(importlib.import_module(METHODS.get(m).__module__).__file__.rsplit("/", 1)[-1], []).append(m)
    checked, wrong = 0, []
    for line in (ROOT / "docs" / "methods.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        files = re.findall(r"`(\w+\.py)`", cells[1]) if line.startswith("| ") and len(cells) > 2 else []
        for piece in re.split(r",\s*", cells[2]) if files else ():
            pair = re.fullmatch(r"(\w+) (-?\d+(?:\.\d+)?)", piece)
            for m in by_file.get(files[0], []) if pair else ():
                params = METHODS.get(m).Params
                field = {f.name: f for f in dataclasses.fields(params)}.get(pair[1]) if dataclasses.is_dataclass(params) else None
                if field is not None:
                    checked += 1
                    if float(pair[2]) != float(field.default):
                        wrong.append(f"{m}: {pair[1]} {pair[2]} in docs/methods.md, {field.default} in its Params")
    assert checked >= 20 and not wrong, (checked, wrong)


def test_default_pipeline_training_job_count(monkeypatch):
    monkeypatch.chdir(ROOT)
    train = int(re.search(r"`make run` is \d+ jobs, (\d+) of them training jobs", README).group(1))
    assert train == len(load_config(ROOT / "config" / "config.yaml").runs())


@pytest.mark.e2e
def test_default_pipeline_job_count_is_the_dry_runs(tmp_path):
    """The README's "`make run` is N jobs" is what snakemake plans for the default config."""
    import shutil
    import subprocess

    total = int(re.search(r"`make run` is (\d+) jobs", README).group(1))
    shutil.copytree(ROOT / "config", tmp_path / "config")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run(["snakemake", "-s", str(ROOT / "Snakefile"), "-n", "--quiet", "rules"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    planned = re.search(r"^total\s+(\d+)$", out.stdout + out.stderr, re.M)
    assert planned, out.stdout[-2000:] + out.stderr[-2000:]
    assert int(planned.group(1)) == total


def test_links_resolve_and_the_guide_is_short():
    for target in re.findall(r"\]\(([^)#:]+)\)", README):
        assert (ROOT / target).exists(), target
    for doc in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+)\)", doc.read_text()):
            assert (doc.parent / target).exists(), (doc.name, target)
    assert len(README.splitlines()) <= 300
