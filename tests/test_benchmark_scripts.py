"""Every script in benchmarks/ still loads against the package as it is now: a refactor that
renames or moves a name a benchmark imports fails here, not months later when the benchmark is
rerun for the docs' numbers (target_rules.py imported COLLAPSE_SHARE from a module that no
longer held it). Loading runs a script's imports and definitions, not its ``main``; the shell
scripts are parsed by ``bash -n``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_every_python_benchmark_loads(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts import their siblings (fingerprints)
    failed = {}
    scripts = sorted(BENCH.glob("*.py"))
    assert len(scripts) > 30
    for f in scripts:
        name = f"_bench_{f.stem}"
        spec = importlib.util.spec_from_file_location(name, f)
        mod = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, mod)  # dataclasses look their module up
        try:
            spec.loader.exec_module(mod)
        except Exception as e:  # noqa: BLE001 - collect every script's failure
            failed[f.name] = repr(e)
    assert failed == {}


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.sh")))
def test_shell_benchmark_parses(script):
    r = subprocess.run(["bash", "-n", str(BENCH / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
