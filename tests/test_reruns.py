"""Incremental reruns that never lie, through the real `snakemake`: code changes rerun the
jobs whose code changed (and runtime settings rerun nothing), deleted or failed runs are
redone and never reported, data problems show before any job starts, and a killed
workflow resumes with a plain rerun. The package source is a copy in the test's directory
(PYTHONPATH), so editing it leaves the repository alone."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fedforget import provenance

from .test_workflow import REPO, env, planned_jobs, snakemake, write_config

pytestmark = pytest.mark.e2e

SMALL = {
    "experiments": [{
        "name": "small",
        "datasets": [{"name": "iris", "model": "mlp"}],
        "partitions": [{"scheme": "iid", "clients": 3}],
        "methods": [{"name": "fedavg"}, {"name": "fedprox"}],
        "seeds": [0],
        "train": {"rounds": 2, "local_epochs": 1, "batch_size": 16},
    }]
}  # fmt: skip


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working directory with config/config.yaml (SMALL) and a copy of the package that
    snakemake and its jobs import (PYTHONPATH comes before the editable install)."""
    src = tmp_path / "src"
    shutil.copytree(provenance.ROOT, src / "fedforget", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("PYTHONPATH", str(src))
    work = tmp_path / "work"
    work.mkdir()
    write_config(work, SMALL)
    return work


def edit(path: Path) -> None:
    """A change of behaviour: one statement more."""
    path.write_text(path.read_text() + "\nEDITED_BY_A_TEST = 1\n")


def comment(path: Path) -> None:
    """A change of no behaviour (the code digest is of the source's canonical form)."""
    path.write_text(path.read_text().replace("\nimport ", "\n# a comment\nimport ", 1) + "\n# another\n")


def run_dir(work: Path, method: str) -> Path:
    return work / "results" / "small" / "iris" / "iid_k3_ps0" / method / "seed0"


def stale(work: Path) -> str:
    proc = subprocess.run(["fedforget", "stale", "--config", "config/config.yaml"], cwd=work,
                          env=env(), capture_output=True, text=True, check=True)  # fmt: skip
    return proc.stdout


@pytest.mark.long
def test_reruns_follow_code_runtime_settings_deletions_failures_and_data(workdir):
    """One workflow, changed step by step (each step's set-up is the previous step's end)."""
    snakemake(workdir)
    assert planned_jobs(workdir) == {}
    run = json.loads((run_dir(workdir, "fedprox") / "run.json").read_text())
    assert len(run["code_digest"]) == 16 and "methods/fedprox.py" in run["code_files"]

    # threads, device, checkpoint frequency, logging: the same results, no rerun
    cfg = json.loads(json.dumps(SMALL))
    cfg["experiments"][0]["train"].update(checkpoint_every=5, device="cpu", threads=1, log_every=2,
                                          max_parallel_clients=8)  # fmt: skip
    write_config(workdir, cfg)
    assert planned_jobs(workdir) == {}

    # one method's file: that method's job only
    src = Path(os.environ["PYTHONPATH"]) / "fedforget"
    edit(src / "methods" / "fedprox.py")
    assert stale(workdir).strip().splitlines() == [
        f"{run_dir(workdir, 'fedprox').relative_to(workdir)}\tstale: code changed: methods/fedprox.py"
    ]
    jobs = planned_jobs(workdir)
    assert jobs.get("train") == 1 and "prepare_dataset" not in jobs and "partition" not in jobs
    snakemake(workdir)
    assert stale(workdir) == ""
    # comments (issue 34, 5): nothing
    comment(src / "methods" / "fedprox.py")
    comment(src / "engine.py")
    assert planned_jobs(workdir) == {} and stale(workdir) == ""

    # the engine: every job; the edit undone: none (the digest is of the source's content)
    engine = src / "engine.py"
    original = engine.read_text()
    edit(engine)
    assert planned_jobs(workdir).get("train") == 2
    engine.write_text(original)
    assert planned_jobs(workdir) == {}

    # deleted and failed runs are redone and never reported
    table = workdir / "results" / "small" / "summary" / "table.csv"
    shutil.rmtree(run_dir(workdir, "fedprox"))
    jobs = planned_jobs(workdir)
    assert jobs.get("train") == 1 and jobs.get("aggregate") == 1
    snakemake(workdir)
    assert "fedprox" in table.read_text()

    # a forced rerun of a finished run puts back the outputs it kept (fedforget.finished:
    # the same run, not trained again; a checkpoint left there is not read, and goes)
    fedavg = run_dir(workdir, "fedavg")
    metrics = (fedavg / "metrics.csv").read_bytes()
    (fedavg / "checkpoint.pt").write_bytes(b"not a checkpoint")
    snakemake(workdir, "--forcerun", str((fedavg / "metrics.csv").relative_to(workdir)))
    assert (fedavg / "metrics.csv").read_bytes() == metrics and table.exists()
    assert not (fedavg / "checkpoint.pt").exists()
    # without that copy, a forced rerun that fails (here: a damaged checkpoint) loses the
    # run's outputs; the table that claimed the run goes with them, and the next invocation
    # redoes both
    shutil.rmtree(fedavg / ".finished")
    (fedavg / "checkpoint.pt").write_bytes(b"not a checkpoint")
    proc = snakemake(workdir, "--forcerun", str((fedavg / "metrics.csv").relative_to(workdir)), check=False)
    assert proc.returncode != 0
    assert not (fedavg / "metrics.csv").exists() and not table.exists()
    (fedavg / "checkpoint.pt").unlink()
    jobs = planned_jobs(workdir)
    assert jobs.get("train") == 1 and jobs.get("aggregate") == 1

    # data: a flipped byte stops the workflow before any job, naming the file and the fix
    snakemake(workdir)
    x = workdir / "data" / "iris" / "x_train.npy"
    blob = bytearray(x.read_bytes())
    blob[-1] ^= 0xFF
    x.write_bytes(bytes(blob))
    proc = snakemake(workdir, "-n", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "data/iris/x_train.npy" in out and "dvc pull" in out
    assert "Building DAG" not in out
    # a deleted data file is prepared again
    x.unlink()
    jobs = planned_jobs(workdir)
    assert jobs.get("prepare_dataset") == 1


@pytest.mark.long
def test_results_recorded_before_the_canonical_code_digest_rerun_only_where_code_changed(workdir):
    """Issue 34, 5, migration: runs made by the version whose code digest was of the files'
    bytes (simulated: this package with that form as training_code's default, which is what
    run.json and the train rule's params then hold) are not rerun by the upgrade while their
    files are byte-identical; a run whose files changed since (here by a comment) reruns
    once and then holds the canonical digest; and a run that reruns for another reason with
    byte-identical code (a forced rerun) is not run a second time afterwards."""
    src = Path(os.environ["PYTHONPATH"]) / "fedforget"
    prov = src / "provenance.py"
    new = prov.read_text()
    default = "def training_code(method: str, params: Mapping[str, Any] | None = None, form: str = FORM)"
    assert default in new
    prov.write_text(new.replace(default, default.replace("= FORM)", "= BYTES)")))
    snakemake(workdir)
    for method in ("fedavg", "fedprox"):
        path = run_dir(workdir, method) / "run.json"
        rec = json.loads(path.read_text())
        rec.pop("code_digest_form", None)  # that version recorded none
        path.write_text(json.dumps(rec))
        assert provenance.recorded_form(rec) == provenance.BYTES

    prov.write_text(new)  # the upgrade
    assert planned_jobs(workdir) == {} and stale(workdir) == ""

    comment(src / "methods" / "fedprox.py")  # bytes changed since fedprox's run: once, in the new form
    assert stale(workdir).strip().splitlines() == [
        f"{run_dir(workdir, 'fedprox').relative_to(workdir)}\tstale: code changed: methods/fedprox.py"
    ]
    assert planned_jobs(workdir).get("train") == 1
    snakemake(workdir)
    rec = json.loads((run_dir(workdir, "fedprox") / "run.json").read_text())
    assert provenance.recorded_form(rec) == provenance.FORM
    comment(src / "methods" / "fedprox.py")
    assert planned_jobs(workdir) == {} and stale(workdir) == ""

    # fedavg, still in the bytes form, forced to rerun: under its old digest, which Snakemake
    # records while its new run.json holds the canonical one; no second run for that. (That
    # version kept no copy of a finished run's outputs, fedforget.finished, which a forced
    # rerun would put back instead of training.)
    shutil.rmtree(run_dir(workdir, "fedavg") / ".finished")
    metrics = run_dir(workdir, "fedavg") / "metrics.csv"
    snakemake(workdir, "--forcerun", str(metrics.relative_to(workdir)))
    rec = json.loads((run_dir(workdir, "fedavg") / "run.json").read_text())
    assert provenance.recorded_form(rec) == provenance.FORM
    assert planned_jobs(workdir) == {} and stale(workdir) == ""
    # and a change of its code's behaviour still reruns it (the engine: both runs)
    edit(src / "engine.py")
    assert planned_jobs(workdir).get("train") == 2


@pytest.mark.long
def test_data_partitions_tables_and_figures_made_before_the_canonical_digest_are_kept(workdir):
    """Issue 34, 5, migration of the other rules (data preparation, partitions, tables,
    figures): their jobs, run by the version whose code digests of those rules were of the
    files' bytes (simulated: module_code with that form as its default, which is what the
    rules' params then held and Snakemake recorded), are not redone by the upgrade, which
    would otherwise prepare and partition again and retrain every run by mtime; a job whose
    files changed since (here: a comment in the table code) runs once and then holds the
    canonical digest, which a comment no longer changes; a change of behaviour still reruns."""
    src = Path(os.environ["PYTHONPATH"]) / "fedforget"
    prov = src / "provenance.py"
    new = prov.read_text()
    default = "def module_code(*roots: str, form: str = FORM)"
    assert default in new
    prov.write_text(new.replace(default, default.replace("= FORM)", "= BYTES)")))
    snakemake(workdir)
    prov.write_text(new)  # the upgrade
    assert planned_jobs(workdir) == {}

    comment(src / "aggregate.py")  # bytes changed since the tables were made: once, canonical
    jobs = planned_jobs(workdir)
    assert jobs.get("aggregate") == 1 and not {"train", "partition", "prepare_dataset"} & set(jobs)
    snakemake(workdir)
    comment(src / "aggregate.py")
    assert planned_jobs(workdir) == {}
    edit(src / "partition.py")
    jobs = planned_jobs(workdir)
    assert jobs.get("partition") == 1 and jobs.get("train") == 2


@pytest.mark.long
def test_a_truncated_partition_stops_the_workflow_before_any_job(workdir):
    """Issue 34, 4: a truncated assignment.npy passed a dry run and failed every training
    job on it with no fix; now the parse stops, naming the file and the fix, which works.
    A partition whose meta.json records no sha256 (written before it was recorded) is
    accepted as it is: not drawn again."""
    snakemake(workdir, "--until", "partition")  # the data and the partition, no training
    (assignment,) = (workdir / "results" / "partitions").glob("*/iid_k3_ps0/assignment.npy")
    part = assignment.parent
    whole = assignment.read_bytes()
    assignment.write_bytes(whole[: len(whole) // 2])
    proc = snakemake(workdir, "-n", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert f"partition file {assignment.relative_to(workdir)} does not match the sha256" in out, out[-3000:]
    assert f"delete {part.relative_to(workdir)} and rerun `snakemake`" in out
    assert "Building DAG" not in out
    # the fix: the partition is drawn again, byte for byte
    shutil.rmtree(part)
    assert planned_jobs(workdir).get("partition") == 1
    snakemake(workdir, "--until", "partition")
    assert assignment.read_bytes() == whole
    # an old partition: no hash recorded, accepted unchecked
    meta = json.loads((part / "meta.json").read_text())
    del meta["sha256"]
    (part / "meta.json").write_text(json.dumps(meta))
    assert "partition" not in planned_jobs(workdir)


@pytest.mark.long
def test_a_killed_workflow_resumes_with_a_plain_rerun(workdir):
    cfg = json.loads(json.dumps(SMALL))
    cfg["experiments"][0]["train"]["rounds"] = 100  # long enough to be killed mid-way
    write_config(workdir, cfg)
    proc = subprocess.Popen(
        ["snakemake", "-s", str(REPO / "Snakefile"), "--cores", "2"], cwd=workdir, env=env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 120
        while not list((workdir / "results" / "small").glob("*/*/*/seed0/checkpoint.pt")):
            assert time.time() < deadline and proc.poll() is None, "no training job started"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # snakemake and its jobs, as a lost node would
        proc.wait()
    assert any((workdir / ".snakemake" / "locks").iterdir())
    out = snakemake(workdir)
    assert "removed the locks of a snakemake that was killed" in out.stderr
    runs = [json.loads(p.read_text()) for p in (workdir / "results" / "small").glob("*/*/*/seed0/run.json")]
    assert len(runs) == 2 and all(r["status"] == "completed" for r in runs)
    assert any("resumed_after_round" in r for r in runs)
    assert planned_jobs(workdir) == {}


@pytest.mark.long  # three Snakemake processes, one trains: make smoke
def test_a_killed_run_frees_only_its_own_locks(workdir):
    """Issue 34, 2: run A trains; run B (another config, its own data and results) starts
    and is SIGKILLed; run C (A's config) removes B's locks, and only B's: A's stay, so C
    refuses to start (Snakemake's lock check) instead of training into A's run directories."""
    cfg = json.loads(json.dumps(SMALL))
    cfg["experiments"][0]["train"]["rounds"] = 5000  # A runs for the whole test, then is killed
    write_config(workdir, cfg)
    other = json.loads(json.dumps(SMALL))
    other["experiments"][0]["name"] = "other"
    (workdir / "other.yaml").write_text(json.dumps({**other, "data_dir": "data_b", "results_dir": "results_b"}))

    def start(*args):
        return subprocess.Popen(
            ["snakemake", "-s", str(REPO / "Snakefile"), "--cores", "1", *args], cwd=workdir, env=env(),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip

    def wait_for(cond, proc, what):
        deadline = time.time() + 120
        while not cond():
            assert time.time() < deadline and proc.poll() is None, what
            time.sleep(0.2)

    a = start()
    try:
        wait_for(lambda: list((workdir / "results" / "small").glob("*/*/*/seed0/checkpoint.pt")), a, "A trains")
        a_locks = {p.name: p.read_text() for p in (workdir / ".snakemake" / "locks").iterdir()}
        b = start("--configfile", "other.yaml")
        # B's first job has started (so B is past its start): its data or results appear
        wait_for(lambda: (workdir / "data_b").exists() or (workdir / "results_b").exists(), b, "B runs")
        os.killpg(b.pid, signal.SIGKILL)
        b.wait()
        b_locks = set(p.name for p in (workdir / ".snakemake" / "locks").iterdir()) - set(a_locks)
        assert b_locks  # B held locks of its own when it was killed
        c = subprocess.Popen(
            ["snakemake", "-s", str(REPO / "Snakefile"), "--cores", "1"], cwd=workdir, env=env(),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            out, _ = c.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(c.pid, signal.SIGKILL)
            c.wait()
            raise AssertionError("run C did not refuse: it took A's locks and trains A's runs") from None
        assert c.returncode != 0 and "cannot be locked" in out, out[-2000:]
        assert "removed the locks of a snakemake that was killed" in out
        held = {p.name: p.read_text() for p in (workdir / ".snakemake" / "locks").iterdir()}
        assert held == a_locks  # B's gone, A's untouched
        assert a.poll() is None  # A still trains
    finally:
        os.killpg(a.pid, signal.SIGKILL)
        a.wait()


@pytest.mark.long
def test_a_run_killed_outside_snakemake_after_its_outputs_trains_again(workdir):
    """`fedforget train` by hand, killed after model.pt and before its last run.json, leaves
    every output of rule train with run.json still "running": the next `snakemake` sets that
    run.json aside (run.stopped.json) and trains the run again; the others stay done."""
    snakemake(workdir)
    rec = run_dir(workdir, "fedprox") / "run.json"
    rec.write_text(json.dumps({**json.loads(rec.read_text()), "status": "running"}))
    out = snakemake(workdir, "-n")
    assert "stopped before its end" in out.stderr and planned_jobs(workdir).get("train") == 1
    snakemake(workdir)
    assert json.loads(rec.read_text())["status"] == "completed"
    assert json.loads((rec.parent / "run.stopped.json").read_text())["status"] == "running"
    assert planned_jobs(workdir) == {}
