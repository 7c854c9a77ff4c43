"""The ``sweep`` figure (FedSOL Fig. 3: a statistic against a swept setting, one line per
method): the values come from each run's config, the table is the per-run statistic's mean
and std over seeds, and bad options name themselves."""

from __future__ import annotations

import pandas as pd
import pytest

from fedforget.figures import figure_options, make_figure
from fedforget.utils import FedForgetError

from .conftest import run_experiment


@pytest.fixture(scope="module")
def swept(data_root, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    methods = [{"name": name, "label": f"{name}-q{q}", "train": {"sample_rate": q}}
               for name in ("fedavg", "fedprox") for q in (0.5, 1.0)]  # fmt: skip
    experiment = {
        "name": "swept",
        "datasets": [{"name": "iris", "model": "mlp"}],
        "partitions": [{"scheme": "iid", "clients": 4, "seed": 0}],
        "methods": methods,
        "seeds": [0, 1],
        "train": {"rounds": 2, "local_epochs": 1, "batch_size": 16, "threads": 1, "eval_local_models": False,
                  "optimizer": {"name": "sgd", "lr": 0.1}},
        "figures": [{"name": "sweep", "label": "fig3a", "options": {"key": "train.sample_rate", "log_x": True}}],
    }  # fmt: skip
    return run_experiment(experiment, data_root, tmp)


def test_options():
    assert figure_options("sweep") == {"key", "column", "stat", "group", "log_x", "title"}


def test_the_table_is_the_final_accuracy_per_method_and_swept_value(swept):
    png = swept / "figures" / "fig3a.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    table = pd.read_csv(swept / "figures" / "fig3a.csv")
    assert sorted(zip(table["group"], table["x"])) == [("fedavg", 0.5), ("fedavg", 1.0), ("fedprox", 0.5), ("fedprox", 1.0)]
    metrics = pd.read_parquet(swept / "summary" / "metrics.parquet")
    final = metrics[(metrics["method"] == "fedprox-q0.5") & (metrics["round"] == 2)]["global_model_test_acc"]
    row = table[(table["group"] == "fedprox") & (table["x"] == 0.5)].iloc[0]
    assert row["count"] == 2 and row["mean"] == pytest.approx(final.mean()) and row["std"] == pytest.approx(final.std(ddof=1))


def test_bad_options_name_themselves(swept, tmp_path):
    with pytest.raises(FedForgetError, match="no config value 'train.no_such_key'"):
        make_figure("sweep", swept / "summary", "swept", tmp_path / "x.png", {"key": "train.no_such_key"})
    with pytest.raises(FedForgetError, match="a number is needed"):
        make_figure("sweep", swept / "summary", "swept", tmp_path / "x.png", {"key": "method.name"})
    with pytest.raises(FedForgetError, match="stat='last'; allowed: final, best, mean"):
        make_figure("sweep", swept / "summary", "swept", tmp_path / "x.png", {"stat": "last"})


def test_a_partition_value_is_swept_over_the_partitions_in_one_panel(data_root, tmp_path):
    """key partition.alpha: each partition is a value of the x axis, all in one panel per
    dataset (FedProTIP Fig. 5), not one panel per partition with a single point."""
    experiment = {
        "name": "alphas",
        "datasets": [{"name": "iris", "model": "mlp"}],
        "partitions": [{"scheme": "dirichlet", "alpha": a, "clients": 3, "min_size": 5, "seed": 0} for a in (0.5, 2.0)],
        "methods": [{"name": "fedavg"}],
        "seeds": [0],
        "train": {"rounds": 1, "local_epochs": 1, "batch_size": 16, "threads": 1, "eval_local_models": False},
        "figures": [{"name": "sweep", "label": "alpha", "options": {"key": "partition.alpha", "group": "method.label", "log_x": True}}],
    }  # fmt: skip
    done = run_experiment(experiment, data_root, tmp_path)
    table = pd.read_csv(done / "figures" / "alpha.csv")
    assert "setting" not in table and list(zip(table["group"], table["x"])) == [("fedavg", 0.5), ("fedavg", 2.0)]
