"""FedSOL figures: drawn by the pipeline from a tiny experiment (iris, FedAvg + FedSOL at two
rho and two perturbation targets, weight-divergence and class-wise diagnostics); the
``fedsol_vs_rho`` table equals the per-run means of the metrics; clear errors."""

from __future__ import annotations

import pandas as pd
import pytest

from fedforget.figures import figure_options, make_figure
from fedforget.utils import FedForgetError

from .conftest import run_experiment


@pytest.fixture(scope="module")
def tiny(data_root, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fedsol_fig")
    experiment = {
        "name": "fedsol_tiny",
        "datasets": [{"name": "iris", "model": "mlp"}],
        "partitions": [{"scheme": "dirichlet", "alpha": 0.5, "clients": 4, "min_size": 5, "seed": 0}],
        "methods": [
            {"name": "fedavg"},
            {"name": "fedsol", "label": "all-r0.5", "params": {"rho": 0.5, "perturb": "all"}},
            {"name": "fedsol", "label": "all-r1", "params": {"rho": 1.0, "perturb": "all"}},
            {"name": "fedsol", "label": "head-r1", "params": {"rho": 1.0, "perturb": "head"}},
        ],
        "seeds": [0, 1],
        "train": {"rounds": 3, "local_epochs": 1, "batch_size": 16, "sample_rate": 1.0, "threads": 1,
                  "optimizer": {"name": "sgd", "lr": 0.1},
                  "diagnostics": ["weight_divergence", "classwise_accuracy", "layer_lambda"]},
        "figures": [{"name": "fedsol_vs_rho", "label": "fig2"},
                    {"name": "fedsol_divergence", "label": "fig5"},
                    {"name": "fedsol_knowledge", "label": "fig6a"},
                    {"name": "fedsol_classwise", "label": "fig6b"},
                    {"name": "layer_lambda", "label": "fig4b", "options": {"round": 2}},
                    {"name": "fedsol_landscape", "label": "fig7",
                     "options": {"methods": ["fedavg", "head-r1"], "rows": 60, "points": 5, "iters": 500, "tol": 1e-9}}],
    }  # fmt: skip
    return run_experiment(experiment, data_root, tmp)


def test_options():
    assert figure_options("fedsol_vs_rho") == {"columns", "group", "stat"}
    assert figure_options("fedsol_divergence") == set()
    assert figure_options("fedsol_classwise") == {"methods"}
    assert figure_options("layer_lambda") == {"round"}
    assert figure_options("fedsol_landscape") == {"methods", "seed", "setting", "rows", "top", "iters", "tol",
                                                  "radius", "points", "batch", "device"}  # fmt: skip


def test_all_figures_drawn_by_the_pipeline(tiny):
    for label in ("fig2", "fig4b", "fig5", "fig6a", "fig6b", "fig7"):
        png = tiny / "figures" / f"{label}.png"
        assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5_000, label


def test_vs_rho_table_is_the_per_run_mean_of_the_metrics(tiny, tmp_path):
    out = make_figure("fedsol_vs_rho", tiny / "summary", "fedsol_tiny", tmp_path / "v.png",
                      {"columns": ["fedsol_prox_loss", "global_model_test_acc"], "stat": "mean"})  # fmt: skip
    table = pd.read_csv(out[1])
    metrics = pd.read_parquet(tiny / "summary" / "metrics.parquet")
    m = metrics[(metrics["round"] >= 1) & (metrics["method"] == "all-r1")]
    per_seed = m.groupby("seed")["fedsol_prox_loss"].mean()
    row = table[(table["variant"] == "perturb=all") & (table["rho"] == 1.0)].iloc[0]
    assert row["fedsol_prox_loss_mean"] == pytest.approx(per_seed.mean())
    assert row["fedsol_prox_loss_std"] == pytest.approx(per_seed.std(ddof=1))
    assert row["fedsol_prox_loss_count"] == 2
    assert set(table["variant"]) == {"perturb=all", "perturb=head", "fedavg"}
    # final-round statistic: the last row's accuracy, FedAvg's a reference row without rho
    out = make_figure("fedsol_vs_rho", tiny / "summary", "fedsol_tiny", tmp_path / "f.png",
                      {"columns": ["global_model_test_acc"], "stat": "final"})  # fmt: skip
    table = pd.read_csv(out[1])
    fa = metrics[(metrics["method"] == "fedavg") & (metrics["round"] == 3)]["global_model_test_acc"].mean()
    ref = table[table["variant"] == "fedavg"].iloc[0]
    assert pd.isna(ref["rho"]) and ref["global_model_test_acc_mean"] == pytest.approx(fa)


def test_layer_lambda_table_is_the_seed_mean_of_the_round_in_the_models_order(tiny):
    table = pd.read_csv(tiny / "figures" / "fig4b.csv")
    metrics = pd.read_parquet(tiny / "summary" / "metrics.parquet")
    cols = [c for c in metrics.columns if c.startswith("layer_lambda:")]
    assert cols and set(table["method"]) == {"fedavg", "all-r0.5", "all-r1", "head-r1"}
    one = table[table["method"] == "all-r1"]
    model_order = ["body.1.weight", "body.1.bias", "body.3.weight", "body.3.bias", "head.weight", "head.bias"]
    assert one["parameter"].tolist() == model_order  # iris's MLP, as registered
    m = metrics[(metrics["method"] == "all-r1") & (metrics["round"] == 2)]
    assert one["mean"].tolist() == pytest.approx(m[[f"layer_lambda:{n}" for n in model_order]].mean().tolist())
    assert (one["count"] == 2).all() and (one["mean"] > 0).all()


def test_classwise_csv_has_the_final_class_accuracies(tiny):
    table = pd.read_csv(tiny / "figures" / "fig6b.csv")
    metrics = pd.read_parquet(tiny / "summary" / "metrics.parquet")
    last = metrics[(metrics["method"] == "head-r1") & (metrics["round"] == 3)]
    row = table[table["method"] == "head-r1"].iloc[0]
    for k in range(3):
        assert row[f"class{k}"] == pytest.approx(100 * last[f"global_model_test_acc_class{k}"].mean())


def test_errors(tiny, tmp_path):
    with pytest.raises(FedForgetError, match="stat='last'"):
        make_figure("fedsol_vs_rho", tiny / "summary", "fedsol_tiny", tmp_path / "x.png", {"stat": "last"})
    with pytest.raises(FedForgetError, match=r"no_such"):
        make_figure("fedsol_vs_rho", tiny / "summary", "fedsol_tiny", tmp_path / "x.png", {"columns": ["no_such"]})
    with pytest.raises(FedForgetError, match="no run of methods"):
        make_figure("fedsol_classwise", tiny / "summary", "fedsol_tiny", tmp_path / "x.png", {"methods": ["nope"]})


def test_landscape_eigenvalues_and_grid_of_the_final_models(tiny):
    """Fig. 7's tables: each method's top-5 eigenvalues, ordered by magnitude, and its loss
    grid, whose centre is the final global model's loss on the figure's rows."""
    import torch

    from fedforget.figures import run_config
    from fedforget.figures.fedsol import _landscape_rows
    from fedforget.landscape import mean_loss
    from fedforget.models import build_model

    eig = pd.read_csv(tiny / "figures" / "fig7.csv")
    assert list(eig["method"]) == ["fedavg", "head-r1"] and (eig["rows"] == 60).all()
    lam = eig[[f"lambda_{k}" for k in range(1, 6)]].abs().to_numpy()
    assert (lam[:, :-1] >= lam[:, 1:] * (1 - 1e-2)).all()
    assert eig["lambda_1_over_lambda_top"].tolist() == pytest.approx((eig["lambda_1"] / eig["lambda_5"]).tolist())
    grid = pd.read_csv(tiny / "figures" / "fig7_grid.csv")
    assert len(grid) == 2 * 25
    runs = pd.read_csv(tiny / "summary" / "runs.csv")
    run_dir = runs[(runs["method"] == "fedavg") & (runs["seed"] == 0)].iloc[0]["run_dir"]
    rc = run_config(run_dir)
    x, y, shape, classes = _landscape_rows(rc, 60, 0)
    model = build_model(rc.dataset.model, shape, classes, rc.dataset.model_options).eval()
    model.load_state_dict(torch.load(f"{run_dir}/model.pt", weights_only=True))
    centre = grid[(grid["method"] == "fedavg") & (grid["a"] == 0) & (grid["b"] == 0)]["loss"].item()
    assert centre == pytest.approx(mean_loss(model, x, y), rel=1e-5)
