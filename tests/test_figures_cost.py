"""FedProTIP Fig. 6 (figure run_cost): each run records its peak memory in run.json, and the
figure's table is the seed mean of each method's training time (timings.csv's elapsed_s at
the last round) and peak memory."""

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
                  "optimizer": {"name": "sgd", "lr": 0.05}},
        "figures": [{"name": "run_cost", "label": "fig6"}],
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
