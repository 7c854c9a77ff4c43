"""FedProTIP Figs. 6 and 7 (figures run_cost, phase_memory): each run records its peak memory
in run.json, overall and per phase of a round, and the figures' tables are the seed means of
each method's training time (timings.csv's elapsed_s at the last round), peak memory and
peak memory per phase; a phase's peak is its own, not the run's so far."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from .conftest import run_experiment


@pytest.fixture(scope="module")
def costly(data_root, tmp_path_factory):
    experiment = {
        "name": "cost",
        "datasets": [{"name": "iris", "model": "mlp"}],
        "partitions": [{"scheme": "iid", "clients": 3, "seed": 0}],
        "methods": [{"name": "fedavg"}, {"name": "fedprox", "params": {"mu": 0.01}}],
        "seeds": [0, 1],
        "train": {"rounds": 2, "local_epochs": 1, "batch_size": 16, "threads": 1, "eval_local_models": False,
                  "optimizer": {"name": "sgd", "lr": 0.05}, "phase_memory": True},
        "figures": [{"name": "run_cost", "label": "fig6"}, {"name": "phase_memory", "label": "fig7"}],
    }  # fmt: skip
    return run_experiment(experiment, data_root, tmp_path_factory.mktemp("cost"))


def test_the_table_is_each_methods_seed_mean_of_its_runs(costly):
    runs = pd.read_csv(costly / "summary" / "runs.csv")
    table = pd.read_csv(costly / "figures" / "fig6.csv")
    assert (costly / "figures" / "fig6.png").read_bytes()[:4] == b"\x89PNG"
    for method in ("fedavg", "fedprox"):
        hours, mem = [], []
        for run_dir in map(Path, runs.loc[runs["method"] == method, "run_dir"]):
            record = json.loads((run_dir / "run.json").read_text())
            assert record["peak_rss_mb"] > 0 and "peak_gpu_memory_mb" not in record  # a CPU run
            timings = pd.read_csv(run_dir / "timings.csv")
            hours.append(timings["elapsed_s"].iloc[-1] / 3600)
            mem.append(record["peak_rss_mb"] / 1024)
        got = table[table["method"] == method].set_index("measure")
        assert got.loc["hours", "mean"] == pytest.approx(sum(hours) / 2)
        assert got.loc["memory_gb", "mean"] == pytest.approx(sum(mem) / 2)
        assert (got["count"] == 2).all()


def test_phase_memory_is_each_phases_own_peak_and_its_seed_mean(costly):
    runs = pd.read_csv(costly / "summary" / "runs.csv")
    table = pd.read_csv(costly / "figures" / "fig7.csv")
    assert (costly / "figures" / "fig7.png").read_bytes()[:4] == b"\x89PNG"
    for method in ("fedavg", "fedprox"):
        peaks = []
        for run_dir in map(Path, runs.loc[runs["method"] == method, "run_dir"]):
            record = json.loads((run_dir / "run.json").read_text())
            by_phase = record["peak_memory_by_phase_mb"]
            assert {"train", "aggregate", "evaluate"} <= set(by_phase) and all(v > 0 for v in by_phase.values())
            assert "task_end" not in by_phase  # no task-end exchange, no such phase
            assert record["peak_rss_mb"] >= max(by_phase.values())  # the run's peak covers every phase's
            peaks.append(by_phase)
        got = table[table["method"] == method].set_index("phase")
        for phase in ("train", "aggregate", "evaluate"):
            assert got.loc[phase, "mean"] == pytest.approx(sum(p[phase] for p in peaks) / 2 / 1024)
            assert got.loc[phase, "count"] == 2


def test_phase_memory_is_off_by_default_and_then_resets_nothing(make_run_config, tmp_path):
    """Without train.phase_memory a run records no phases (a benchmark reading torch's or the
    process's peak after a run reads the run's)."""
    from fedforget.runner import run_training

    record = run_training(make_run_config(rounds=1), tmp_path / "run", progress=False)
    assert "peak_memory_by_phase_mb" not in record and record["peak_rss_mb"] > 0


def test_a_phase_records_its_own_peak_not_the_runs_so_far():
    """A phase that allocates 200 MB peaks above the one after it: the peak is reset per phase
    (on a CPU: VmHWM through /proc/self/clear_refs), not the process's peak so far."""
    import torch

    from fedforget.memory import PhaseMemory

    mem = PhaseMemory(torch.device("cpu"))
    if not mem.cpu_ok:
        pytest.skip("this system cannot reset the peak resident memory (/proc/self/clear_refs)")
    with mem.phase("big"):
        x = torch.ones(50_000_000)  # 200 MB, resident
        x += 1
    del x
    with mem.phase("small"):
        torch.ones(1000)
    assert mem.peaks["big"] - mem.peaks["small"] > 150
    assert mem.run_peak_mb() == mem.peaks["big"]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux's /proc: VmHWM")
def test_a_process_s_peak_is_its_own_not_the_one_of_the_process_that_started_it(tmp_path):
    """run.json's peak_rss_mb (fedforget.memory.process_peak_mb) of a process started by a large
    one is the started process's own peak; getrusage's ru_maxrss there reads the starter's (Linux
    carries it across exec), which before 2026-12-08 overstated jobs started by a large process."""
    import subprocess
    import sys

    child = ("import resource; from fedforget.memory import process_peak_mb; "
             "print(process_peak_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    starter = ("import subprocess, sys; big = b'x' * (1536 * 2**20); "  # 1.5 GiB written: resident
               f"sys.stdout.write(subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True, check=True).stdout)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    own, inherited = map(float, done.stdout.split())
    assert inherited >= 1536  # what ru_maxrss says: at least the starter's 1.5 GiB
    assert 10 < own < 1024, (own, inherited)  # the child's own: an interpreter and torch
