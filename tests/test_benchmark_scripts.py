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


FLAKY = """
from pathlib import Path
import os
import pytest

@pytest.mark.parametrize("p", ["a", "b"])
def test_f(p):
    log = Path(os.environ["REPEAT_LOG"] + "-" + p)
    calls = log.read_text().count("x") if log.exists() else 0
    log.write_text("x" * (calls + 1))
    assert calls % 2 == 0, "every second call fails"
"""


def test_repeat_test_counts_each_copy_of_one_test(tmp_path):
    """benchmarks/repeat_test.py runs only the named test's copies (not [a]), with --env's
    variables, and counts the failures of the copies that fail (every second call here)."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_flaky.py").write_text(FLAKY)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(BENCH / "repeat_test.py"), "tests/test_flaky.py::test_f[b]", "--source", str(tmp_path),
           "--times", "4", "--batches", "2", "--workers", "0", "--load", "0",
           "--env", f"REPEAT_LOG={tmp_path / 'calls'}", "--out", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert (tmp_path / "calls-b").read_text() == "x" * 8 and not (tmp_path / "calls-a").exists()  # 4 of [b] a batch
    assert [(b["runs"], b["passed"], b["failed"]) for b in res["batches"]] == [(4, 2, 2), (4, 2, 2)]
    assert res["total"] == {"runs": 8, "failed": 4, "failed_by_test": {"test_f[b]": 4}}
    assert all(len(b["failed_copies"]) == 2 and all("-b]" in c or "[b-" in c for c in b["failed_copies"])
               for b in res["batches"])  # fmt: skip
    every = [c if c != "tests/test_flaky.py::test_f[b]" else "tests/test_flaky.py::test_f" for c in cmd]
    r = subprocess.run([c if c != "2" else "1" for c in every], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())  # a node id without parameters: each parameter's copies, one batch
    assert (tmp_path / "calls-a").read_text() == "x" * 4 and (tmp_path / "calls-b").read_text() == "x" * 12
    assert res["total"] == {"runs": 8, "failed": 4, "failed_by_test": {"test_f[a]": 2, "test_f[b]": 2}}
    whole = [c if c != "tests/test_flaky.py::test_f" else "tests/test_flaky.py" for c in every]
    r = subprocess.run([c if c not in ("2", "4") else "1" for c in whole], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and json.loads(out.read_text())["total"]["runs"] == 2  # a file: its every test
    folder = [c if c != "tests/test_flaky.py" else "tests" for c in whole]
    r = subprocess.run([c if c not in ("2", "4") else "1" for c in folder], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and json.loads(out.read_text())["total"]["runs"] == 2  # a folder: its every test
    missing = [sys.executable, str(BENCH / "repeat_test.py"), "tests/test_flaky.py::test_f[c]", "--source",
               str(tmp_path), "--times", "1", "--workers", "0", "--load", "0"]  # fmt: skip
    r = subprocess.run(missing, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "'tests/test_flaky.py::test_f[c]': no test of that node id" in r.stderr


def test_size_probe_covers_every_unbounded_integer_and_names_a_crash_site():
    """benchmarks/size_probe.py's cases: every method's integer hyperparameters without a
    maximum and every such integer of the config schema (a new one is probed by itself, or
    the probe names it), the run's own sizes; a traceback's site is its exception and last
    src/fedforget frame."""
    from .conftest import benchmark_script

    with benchmark_script("size_probe") as probe:
        names = {c["name"] for c in probe.cases()}
        trace = ('Traceback (most recent call last):\n  File "/x/src/fedforget/cli.py", line 440, in main\n'
                 '  File "/x/src/fedforget/methods/replay.py", line 200, in rows_for\n'
                 '  File "/x/.venv/lib/torch/x.py", line 3\nRuntimeError: [enforce fail] cannot allocate\n')  # fmt: skip
        assert probe.crash_site(trace) == "RuntimeError fedforget/methods/replay.py:200"
    assert {"train.batch_size", "seeds", "der.buffer_size", "der.memory_batch_size", "l2p.pool_size", "scr.proj_dim",
            "train.concurrent_clients", "partition.shards_per_client", "scenario.boundaries.window_rounds",
            "augment.pad", "smoke.rows"} <= names  # fmt: skip
    assert "train.threads" not in names  # (at most 1024)
    assert "fedprox.mu" not in names and len(names) > 60


def test_checkpoint_cadence_runs_each_cadence_to_the_same_results(tmp_path):
    """benchmarks/checkpoint_cadence.py at a tiny size: no checkpoint, one after every round
    but the last, and auto (at least the first round's); the script itself stops when a
    cadence's metrics.csv or model.pt differ from the run without checkpoints."""
    out = tmp_path / "cadence.json"
    args = ["--methods", "scaffold", "--clients", "4", "--sample-rate", "0.5", "--hidden", "8", "--rounds", "3",
            "--dir", str(tmp_path), "--json", str(out)]  # fmt: skip
    done = subprocess.run([sys.executable, str(BENCH / "checkpoint_cadence.py"), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    m = json.loads(out.read_text())["methods"]["scaffold"]
    written = {k: c["checkpoints_written"] for k, c in m["cadences"].items()}
    assert m["results_identical"] and written["never"] == 0 and written["every"] == 2 and 1 <= written["auto"] <= 2
    assert list(tmp_path.iterdir()) == [out]  # its runs are removed


def test_process_memory_measures_a_training_job_s_own_process(tmp_path):
    """benchmarks/process_memory.py runs `fedforget train` on the embedded digits preset (FedAvg,
    1 round), at the config's evaluation batch and at one given, and writes each process's peak
    beside the import-only one: larger than it, and all of it the process's own (FedAvg keeps
    no per-client state), with the data it held; its run directories removed."""
    out = tmp_path / "pm.json"
    done = subprocess.run([sys.executable, str(BENCH / "process_memory.py"), "--presets", "digits", "--rounds", "1",
                           "--eval-batch-sizes", "0", "32", "--data", str(tmp_path / "data"), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["preset"], r["method"], r.get("eval_batch_size")) for r in rows] == [
        (None, "import_only", None), ("digits", "fedavg", 1024), ("digits", "fedavg", 32)]  # fmt: skip
    imported, job, small = rows
    for j in (job, small):
        assert j["exit"] == 0 and j["client_state_mb"] == 0 and j["process_mb"] == j["peak_rss_mb"]
        assert 100 < imported["peak_rss_mb"] < j["peak_rss_mb"], rows
    assert json.loads(out.read_text())["process_mb_max"] == max(job["process_mb"], small["process_mb"])
    # the data the process held: scikit-learn's digits, 8x8 float32 features, 1,797 rows in all
    assert (job["input_shape"], job["input_dtype"], job["train_rows"] + job["test_rows"]) == ([1, 8, 8], "float32", 1797)
    assert job["data_mb"] == 1797 * (64 * 4 + 8) / 2**20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "pm.json"]


def test_process_memory_reads_the_job_s_peak_not_its_own(tmp_path):
    """process_memory.py, grown large by the data it prepared, starts each command through a
    small launcher: the peak it reads is the command's (a bare interpreter: tens of MiB), not the
    script's that Linux carries into a started program's ru_maxrss."""
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import process_memory as pm; "
            "big = b'x' * (1024 * 2**20); "  # the script's 1 GiB, written: resident
            "print(pm.peak_of([sys.executable, '-c', 'pass'], Path(sys.argv[2])))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, str(BENCH), str(tmp_path / "cmd.log")], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    peak, _, code = eval(done.stdout.strip().splitlines()[-1])  # (MiB, seconds, exit status)
    assert code == 0 and 1 < peak < 100, peak


def test_client_state_memory_counts_how_many_of_the_largest_jobs_train_at_once(tmp_path):
    """benchmarks/client_state_memory.py on FedProj Table 1/3b (its largest job: FedDyn on the
    CINIC-10 ResNet-18, 100 clients, one copy: 4,469,584,800 bytes, 4,263 MiB as its
    client_state_mb) under profiles with 4 jobs per submission, each process 3,000 MB
    (slurm-packed's default) besides: all 4 at once in 29,052 MB, 2 in the shipped 16,000 (3
    would need 21,789), 1 in 14,525 (2 need 14,526) and in 10 (alone where none fits); with
    slurm-packed-process-mb 0 in the profile, 3 in 16,000."""
    config = BENCH.parent / "config" / "experiments" / "paper" / "fedproj_table1_table3b.yaml"
    seen = {}
    for mem, process in ((29052, None), (16000, None), (14525, None), (10, None), (16000, 0)):
        profile, out = tmp_path / f"profile{mem}.yaml", tmp_path / f"{mem}-{process}.json"
        settings = {"set-resources": {"train": {"mem_mb": mem}}, "group-components": ["train=4"]}
        profile.write_text(json.dumps(settings if process is None else settings | {"slurm-packed-process-mb": process}))
        done = subprocess.run([sys.executable, str(BENCH / "client_state_memory.py"), "--configs", str(config),
                               "--profile", str(profile), "--json", str(out)], capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr
        written = json.loads(out.read_text())
        c = written["configs"]["fedproj_table1_table3b"]
        assert (c["largest"]["method"], c["largest"]["bytes"], c["largest_client_state_mb"]) == ("FedDyn", 4469584800, 4263)
        assert written["profile"]["process_mb"] == (3000 if process is None else process)
        seen[mem, process] = c["largest_at_once"]
    assert seen == {(29052, None): 4, (16000, None): 2, (14525, None): 1, (10, None): 1, (16000, 0): 3}
