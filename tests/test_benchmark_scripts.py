"""Every script in benchmarks/ still loads against the package as it is now: a refactor that
renames or moves a name a benchmark imports fails here, not months later when the benchmark is
rerun for the docs' numbers (target_rules.py imported COLLAPSE_SHARE from a module that no
longer held it). Loading runs a script's imports and definitions, not its ``main``, in a
process of its own (some register benchmark datasets, which the suite's registry must not
see); the shell scripts are parsed by ``bash -n``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

LOAD_ALL = """
import importlib.util, json, sys
from pathlib import Path
bench = Path(sys.argv[1])
sys.path.insert(0, str(bench))  # the scripts import their siblings (fingerprints)
failed = {}
for f in sorted(bench.glob("*.py")):
    name = "_bench_" + f.stem
    spec = importlib.util.spec_from_file_location(name, f)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # every script's failure
        failed[f.name] = repr(e)
print(json.dumps(failed))
"""


def test_every_python_benchmark_loads():
    assert len(list(BENCH.glob("*.py"))) > 30
    r = subprocess.run([sys.executable, "-c", LOAD_ALL, str(BENCH)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {}


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.sh")))
def test_shell_benchmark_parses(script):
    r = subprocess.run(["bash", "-n", str(BENCH / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
