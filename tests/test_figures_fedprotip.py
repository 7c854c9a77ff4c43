"""FedProTIP's Fig. 2 figure (figures/fedprotip.py): its tables are the means over a task's
rounds, then over seeds, of the diagnostic projection_geometry's columns."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from fedforget.figures import FigureInput
from fedforget.figures.fedprotip import projection_geometry
from fedforget.utils import FedForgetError


def geometry_input() -> FigureInput:
    """Two methods x two seeds, three tasks of two rounds each (rounds 1-6): rho and beta
    values chosen so that every mean is known."""
    rows, runs = [], []
    for method, base in (("eps0.7", 0.8), ("eps0.9", 0.4)):
        for seed in (0, 1):
            runs.append({"dataset": "d", "setting": "iid", "method": method, "seed": seed, "status": "completed",
                         "run_dir": f"{method}/{seed}"})  # fmt: skip
            for rnd in range(1, 7):
                task = (rnd - 1) // 2
                row = {"dataset": "d", "setting": "iid", "method": method, "seed": seed, "round": rnd,
                       "projection_task": float(task), "projection_rho": 1.0 if task == 0 else base + 0.1 * seed + 0.01 * rnd}  # fmt: skip
                for tau in range(task):
                    row[f"projection_beta_task{tau}"] = base / 4 + 0.1 * tau + 0.02 * seed
                rows.append(row)
            rows.append({"dataset": "d", "setting": "iid", "method": method, "seed": seed, "round": 0})
    return FigureInput("x", None, pd.DataFrame(runs), pd.DataFrame(rows))


def test_tables_are_the_means_over_rounds_then_seeds(tmp_path):
    out = tmp_path / "fig2.png"
    assert projection_geometry(geometry_input(), out, method="eps0.9") == [out] and out.is_file()
    a = pd.read_csv(tmp_path / "fig2_rho_per_task.csv")
    # task 0 is left out; eps0.7, task 1 (rounds 3, 4): seeds 0.8 + 0.035 and 0.9 + 0.035
    r = a[(a["method"] == "eps0.7") & (a["task"] == 1)].iloc[0]
    assert r["mean"] == pytest.approx(0.885) and r["std"] == pytest.approx(math.sqrt(0.005)) and r["count"] == 2
    assert set(a["task"]) == {1, 2}
    b = pd.read_csv(tmp_path / "fig2_beta_heatmap.csv")  # eps0.9 only: 0.1 + 0.1 tau + 0.01 (seed mean)
    assert len(b) == 3 and b["mean"].tolist() == pytest.approx([0.11, 0.11, 0.21])
    c = pd.read_csv(tmp_path / "fig2_means.csv").set_index(["quantity", "method"])
    assert c.loc[("rho", "eps0.9"), "mean"] == pytest.approx(0.4 + 0.05 + 0.045)  # rounds 3-6, seeds 0 and 1
    assert c.loc[("beta", "eps0.9"), "mean"] == pytest.approx((0.11 + 0.11 + 0.21) / 3)  # each run: the mean over its pairs


def test_without_the_diagnostic_or_the_method_it_says_what_is_missing(tmp_path):
    inp = geometry_input()
    with pytest.raises(FedForgetError, match="method 'eps0.5' has no projection_geometry"):
        projection_geometry(inp, tmp_path / "f.png", method="eps0.5")
    inp.metrics = inp.metrics.drop(columns=["projection_rho"])
    with pytest.raises(FedForgetError, match=r"projection_rho.*train.diagnostics: \[projection_geometry\]"):
        projection_geometry(inp, tmp_path / "f.png")


def test_task_identity_figure_draws_runs_csv_acc_t_of_the_routing(tmp_path):
    """Fig. 4a from runs.csv's avg_acc_after_task_<t>_task_id_<mode>: per dataset x setting x
    method and tasks learned, the mean ± std over the completed seeds, in %; a run without
    the columns (FOT) and a failed run are left out; no run with them, or a mode other than
    batch / sample, is an error naming the figure."""
    from fedforget.figures.fedprotip import task_identity

    runs = []
    for seed, status in ((0, "completed"), (1, "completed"), (2, "failed")):
        runs.append({"dataset": "d", "setting": "iid", "method": "FedProTIP", "seed": seed, "status": status,
                     "avg_acc_after_task_1_task_id_batch": 1.0, "avg_acc_after_task_2_task_id_batch": 0.8 + 0.1 * seed,
                     "avg_acc_after_task_1_task_id_sample": 1.0, "avg_acc_after_task_2_task_id_sample": 0.5})  # fmt: skip
    runs.append({"dataset": "d", "setting": "iid", "method": "FOT", "seed": 0, "status": "completed"})
    inp = FigureInput("x", None, pd.DataFrame(runs), pd.DataFrame())
    out = tmp_path / "fig4a.png"
    assert task_identity(inp, out) == [out] and out.exists()
    table = pd.read_csv(out.with_suffix(".csv"))
    assert table[["method", "tasks_learned", "count"]].values.tolist() == [["FedProTIP", 1, 2], ["FedProTIP", 2, 2]]
    assert table["mean"].tolist() == pytest.approx([100.0, 85.0])
    assert table["std"].iloc[1] == pytest.approx(math.sqrt(50.0))  # 80 and 90
    task_identity(inp, out, mode="sample")
    assert pd.read_csv(out.with_suffix(".csv"))["mean"].tolist() == pytest.approx([100.0, 50.0])
    with pytest.raises(FedForgetError, match="mode='agnostic'; allowed: batch, sample"):
        task_identity(inp, out, mode="agnostic")
    with pytest.raises(FedForgetError, match="task_identity': no completed run records"):
        task_identity(FigureInput("x", None, pd.DataFrame(runs[-1:]), pd.DataFrame()), out)
