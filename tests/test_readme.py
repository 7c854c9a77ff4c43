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
    assert n == len(METHODS.names())
    flat = README.lower().replace("-", "")
    missing = [m for m in METHODS.names() if m not in flat]
    assert not missing, missing


def test_every_method_has_a_row_in_the_methods_table():
    """docs/methods.md's table names every registered method's module (FedAvgM had none)."""
    import importlib

    table = (ROOT / "docs" / "methods.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    missing = [m for m in METHODS.names()
               if not any(f"`{importlib.import_module(METHODS.get(m).__module__).__file__.rsplit('/', 1)[-1]}`" in r
                          for r in rows)]  # fmt: skip
    assert not missing, missing


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
