"""FedProj figures: the Figure-1 decision boundaries drawn from snapshots of a tiny pilot-like
experiment (iris PCA-2D, classes partition, FedAvg + FedProj), the parameter sweep's table
equals the runs' accuracies, and clear errors (missing round, non-2-D data, unknown param)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from fedforget.figures import figure_options, make_figure
from fedforget.utils import FedForgetError

from .conftest import run_experiment

PILOT = [[0.8, 0.1, 0.1], [0.1, 0.8, 0.1], [0.1, 0.1, 0.8]]


@pytest.fixture(scope="module")
def pilot(data_root, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fedproj_fig")
    shutil.copytree(data_root / "iris-pca2", tmp / "data" / "iris-pca2")
    experiment = {
        "name": "pilot_tiny",
        "datasets": [{"name": "iris", "options": {"pca": 2}, "model": {"name": "mlp", "options": {"hidden": [8, 8]}},
                      "public": {"source": "holdout", "fraction": 0.2, "seed": 0}}],
        "partitions": [{"scheme": "classes", "clients": 3, "class_fractions": PILOT}],
        "methods": [
            {"name": "fedavg"},
            {"name": "fedproj", "label": "fedproj-a0", "params": {"alpha": 0.0}},
            {"name": "fedproj", "label": "fedproj-a05", "params": {"alpha": 0.5}},
        ],
        "seeds": [0, 1],
        "train": {"rounds": 2, "local_epochs": 1, "batch_size": 16, "sample_rate": 1.0,
                  "optimizer": {"name": "sgd", "lr": 0.05}, "threads": 1, "save_client_models": [1, 2]},
        "figures": [{"name": "decision_boundaries", "label": "boundaries",
                     "options": {"rounds": [1, 2], "seed": 1, "resolution": 40}}],
    }  # fmt: skip
    return run_experiment(experiment, tmp / "data", tmp)


def test_options():
    assert figure_options("decision_boundaries") == {"rounds", "seed", "methods", "setting", "resolution"}
    assert figure_options("param_sweep") == {"param", "one_minus", "xlabel", "metric", "methods"}


def test_decision_boundaries_drawn_by_the_pipeline(pilot, tmp_path):
    png = pilot / "figures" / "boundaries.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000
    out = make_figure("decision_boundaries", pilot / "summary", "pilot_tiny", tmp_path / "b.png",
                      {"rounds": [2], "methods": ["fedproj-a0", "fedavg"], "resolution": 30})  # fmt: skip
    assert out[0].read_bytes()[:4] == b"\x89PNG"


def test_missing_round_and_method_are_named(pilot, tmp_path):
    with pytest.raises(FedForgetError, match=r"no snapshot of round 3 .*save_client_models"):
        make_figure("decision_boundaries", pilot / "summary", "pilot_tiny", tmp_path / "b.png", {"rounds": [3]})
    with pytest.raises(FedForgetError, match=r"no run of method\(s\) \['feddf'\]"):
        make_figure("decision_boundaries", pilot / "summary", "pilot_tiny", tmp_path / "b.png", {"methods": ["feddf"]})


def test_param_sweep_table_is_mean_of_the_runs(pilot, tmp_path):
    out = make_figure("param_sweep", pilot / "summary", "pilot_tiny", tmp_path / "alpha.png", {"param": "alpha"})
    table = pd.read_csv(out[1])
    runs = pd.read_csv(pilot / "summary" / "runs.csv")
    assert sorted(table["x"]) == [0.0, 0.5]  # fedavg has no alpha: left out
    for x, label in ((0.0, "fedproj-a0"), (0.5, "fedproj-a05")):
        accs = 100 * runs.loc[runs["method"] == label, "final_global_model_test_acc"]
        row = table[table["x"] == x].iloc[0]
        assert row["mean"] == pytest.approx(accs.mean()) and row["count"] == 2
    flipped = make_figure("param_sweep", pilot / "summary", "pilot_tiny", tmp_path / "r.png",
                          {"param": "alpha", "one_minus": True})  # fmt: skip
    assert sorted(pd.read_csv(flipped[1])["x"]) == [0.5, 1.0]
    with pytest.raises(FedForgetError, match=r"no completed run has method parameter 'rho'"):
        make_figure("param_sweep", pilot / "summary", "pilot_tiny", tmp_path / "x.png", {"param": "rho"})


def test_non_2d_data_is_refused(pilot, tmp_path):
    summary = tmp_path / "summary"
    shutil.copytree(pilot / "summary", summary)
    runs = pd.read_csv(summary / "runs.csv")
    run_dir = Path(runs.loc[runs["seed"] == 0, "run_dir"].iloc[0])
    fake = tmp_path / "run"
    shutil.copytree(run_dir, fake)
    rec = json.loads((fake / "run.json").read_text())
    rec["config"]["dataset"]["options"] = {"pca": 0}  # iris with 4 features
    rec["config"]["data_dir"] = str(pilot.parent.parent / "data4")
    (fake / "run.json").write_text(json.dumps(rec))
    from fedforget.data import prepare_dataset

    prepare_dataset("iris", {}, pilot.parent.parent / "data4")
    runs["run_dir"] = str(fake)
    runs.to_csv(summary / "runs.csv", index=False)
    with pytest.raises(FedForgetError, match=r"needs 2-D inputs"):
        make_figure("decision_boundaries", summary, "pilot_tiny", tmp_path / "b.png", {"seed": 0})
