"""Experiment-specific figures: registry, config validation, drawing."""

from __future__ import annotations

import pytest

from fedforget.cli import main
from fedforget.figures import FIGURES, check_figure, figure_options
from fedforget.parse import parse_config
from fedforget.pipeline import run_all
from fedforget.utils import FedForgetError


def _with_figures(cfg, figures, **train):
    cfg["experiments"][0]["figures"] = figures
    cfg["experiments"][0]["train"] = {**cfg["experiments"][0].get("train", {}), **train}
    return cfg


def test_curves_registered_with_its_options():
    assert "curves" in FIGURES
    assert figure_options("curves") == {"column", "title"}


@pytest.mark.parametrize(
    "figures,match",
    [
        ([{"name": "nope"}], r"figures\[0\]\.name: unknown figure 'nope'"),
        ([{"name": "curves", "options": {"colour": "red"}}], r"unknown option\(s\) \['colour'\] for figure 'curves'"),
        ([{"name": "curves"}, {"name": "curves"}], r"duplicate figure label 'curves'"),
        ([{"name": "curves", "label": "global_model_test_acc"}], r"duplicate figure label 'global_model_test_acc'"),
        # a value of another type than the figure function's annotation: refused before training
        ([{"name": "layer_lambda", "options": {"round": 2.0}}],
         r"figures\[0\]\.options\.round=2\.0 for figure 'layer_lambda'; allowed: null or an integer"),
        ([{"name": "curves", "options": {"title": 5}}], r"options\.title=5 for figure 'curves'; allowed: null or a string"),
        ([{"name": "decision_boundaries", "options": {"rounds": [1, "10"]}}],
         r"options\.rounds=\[1, '10'\] for figure 'decision_boundaries'; allowed: a list of items, each an integer"),
        ([{"name": "fedsol_classwise", "options": {"methods": "fedavg"}}],
         r"options\.methods='fedavg' for figure 'fedsol_classwise'; allowed: null or a list of items, each a string"),
        ([{"name": "sweep", "options": {"log_x": "yes"}}], r"options\.log_x='yes' for figure 'sweep'; allowed: true \| false"),
        ([{"name": "fedsol_landscape", "options": {"tol": True}}], r"options\.tol=True for figure 'fedsol_landscape'; allowed: a finite number"),
    ],
)
def test_bad_figure_configs_rejected(minimal_config, figures, match):
    with pytest.raises(FedForgetError, match=match):
        parse_config(_with_figures(minimal_config, figures))


def test_every_figure_option_annotation_is_checked_and_its_default_passes():
    """check_figure reads every registered figure's annotations (an annotation it cannot
    read is a TypeError for the figure's author), and every default passes its own check."""
    import inspect

    for name in FIGURES.names():
        params = inspect.signature(FIGURES.get(name)).parameters
        defaults = {o: params[o].default for o in figure_options(name)}
        check_figure(name, {o: list(v) if isinstance(v, tuple) else v for o, v in defaults.items()})


def test_figures_drawn_by_pipeline_and_cli(minimal_config, data_root, tmp_path):
    cfg = _with_figures(
        minimal_config,
        [{"name": "curves", "label": "div", "options": {"column": "local_models_dist_to_global_mean"}}],
        rounds=2, diagnostics=["weight_divergence"],
    )
    cfg["data_dir"], cfg["results_dir"] = str(data_root), str(tmp_path / "results")
    wf = parse_config(cfg)
    run_all(wf, progress=False)
    exp = wf.experiments[0].name
    png = tmp_path / "results" / exp / "figures" / "div.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    summary = tmp_path / "results" / exp / "summary"
    out = tmp_path / "cli.png"
    assert main(["figure", "--summary", str(summary), "--experiment", exp, "--name", "curves",
                 "--options", '{"column": "global_model_test_loss"}', "--out", str(out)]) == 0  # fmt: skip
    assert out.read_bytes()[:4] == b"\x89PNG"
    # a column no run has: one clear error naming it
    assert main(["figure", "--summary", str(summary), "--experiment", exp, "--name", "curves",
                 "--options", '{"column": "no_such"}', "--out", str(out)]) == 2  # fmt: skip


def test_continual_figures_only_for_experiments_with_continual_runs(tmp_path):
    """Synthesized run directories (tests/test_aggregation.py): a continual experiment gets
    the learning curves and the continual figures (CONTINUAL_FIGURES) in figures/continual/; a one-task
    experiment the curves only."""
    from fedforget.aggregate import aggregate
    from fedforget.plots import CONTINUAL_DIR, CONTINUAL_FIGURES, CURVES, plot_experiment

    from .test_aggregation import write_continual_experiment, write_run

    aggregate(write_continual_experiment(tmp_path / "runs"), tmp_path / "summary", "e")
    paths = plot_experiment(tmp_path / "summary", tmp_path / "figures")
    curves = [tmp_path / "figures" / f"{c}.png" for c in CURVES]
    assert paths == curves + [tmp_path / "figures" / CONTINUAL_DIR / f"{f}.png" for f in CONTINUAL_FIGURES]
    for p in paths:
        assert p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size > 1000, p

    aggregate([write_run(tmp_path / "one", "fedavg", 0)], tmp_path / "summary1", "e")
    paths = plot_experiment(tmp_path / "summary1", tmp_path / "figures1")
    assert paths == [tmp_path / "figures1" / f"{c}.png" for c in CURVES]
    assert not (tmp_path / "figures1" / CONTINUAL_DIR).exists()


def test_after_task_values_and_task_aware_matrices():
    """What the after-each-task figures draw: Acc_t, Fgt_t (FedGP Fig. 5), a[t][t] (FedGP
    Fig. 6) of a run's matrix; and the task-aware matrices (FedProTIP Fig. 3b) from
    tasks.csv's task_aware column, or a task-IL run's own accuracy; a class-IL run without
    the column draws none."""
    import numpy as np
    import pandas as pd

    from fedforget.continual import acc_after_each_task, fgt_after_each_task
    from fedforget.plots import RUN_KEYS, after_task_values, task_aware_matrices

    a = np.array([[0.9, 0.1], [0.6, 0.8]])
    np.testing.assert_array_equal(after_task_values(a, "acc_after_task"), acc_after_each_task(a))
    np.testing.assert_array_equal(after_task_values(a, "fgt_after_task")[1:], fgt_after_each_task(a)[1:])
    np.testing.assert_array_equal(after_task_values(a, "current_task_acc"), [0.9, 0.8])

    key = dict(dataset="d", setting="s", clients=2, partition_seed=0, seed=0)
    runs = pd.DataFrame([{**key, "method": m, "status": "completed", "tasks": 2, "rounds_per_task": 1,
                          "incremental": inc} for m, inc in (("aware", "class"), ("til", "task"), ("plain", "class"))])  # fmt: skip
    rows = []
    for m in ("aware", "til", "plain"):
        for rnd in (0, 1, 2):
            for t in (0, 1):
                row = {**key, "method": m, "round": rnd, "current_task": max(rnd - 1, 0), "task": t,
                       "accuracy": 0.1 * rnd + 0.01 * t}  # fmt: skip
                if m == "aware":
                    row["task_aware"] = 0.5 + 0.1 * rnd + 0.01 * t
                rows.append(row)
    got = task_aware_matrices(pd.DataFrame(rows), runs)
    assert list(got.columns) == [*RUN_KEYS, "after_task", "task", "accuracy"]
    assert set(got["method"]) == {"aware", "til"}
    mat = got[got["method"] == "aware"].sort_values(["after_task", "task"])["accuracy"].tolist()
    assert mat == pytest.approx([0.6, 0.61, 0.7, 0.71])  # rounds 1 and 2: the last of tasks 0 and 1
    mat = got[got["method"] == "til"].sort_values(["after_task", "task"])["accuracy"].tolist()
    assert mat == pytest.approx([0.1, 0.11, 0.2, 0.21])


def _metrics(local):
    """Two runs' metrics rows; the local models' accuracy ``local`` (a value or NaN)."""
    import numpy as np
    import pandas as pd

    rows = [{"dataset": "digits", "setting": "iid", "method": m, "seed": 0, "round": r,
             "global_model_test_acc": 0.5, "local_models_global_test_acc_mean": local if r else np.nan}
            for m in ("fedavg", "fedprox") for r in range(3)]  # fmt: skip
    return pd.DataFrame(rows)


def test_a_curve_no_run_measured_is_a_notice_not_empty_axes(monkeypatch, tmp_path):
    """train.eval_local_models: false leaves the local models' accuracy NaN in every row (or
    the column absent): its figure says that it was not measured and what measures it,
    with no axes; a measured column draws its panels."""
    import numpy as np

    from fedforget import plots

    drawn = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.update({path.name: fig}))
    column = "local_models_global_test_acc_mean"
    for name, metrics in (("nan.png", _metrics(np.nan)), ("absent.png", _metrics(np.nan).drop(columns=[column]))):
        assert not plots.measured(metrics, column)
        plots.learning_curves(metrics, column, tmp_path / name)
        fig = drawn[name]
        assert not fig.axes
        text = " ".join(t.get_text().replace("\n", " ") for t in fig.texts)
        assert "Not measured in this experiment" in text and "train.eval_local_models: true" in text, text
    assert plots.measured(_metrics(0.7), column)
    plots.learning_curves(_metrics(0.7), column, tmp_path / "measured.png")
    assert [ax.get_title() for ax in drawn["measured.png"].axes if ax.get_visible()] == ["digits, IID"]


def test_an_experiment_draws_the_curves_its_runs_measure():
    """The local models' curve only where some run sets train.eval_local_models."""
    from fedforget.plots import CURVES, experiment_curves
    from fedforget.train_spec import TrainSpec

    local = "local_models_global_test_acc_mean"
    off, on = TrainSpec(eval_local_models=False), TrainSpec(eval_local_models=True)
    assert experiment_curves([off, off]) == [c for c in CURVES if c != local]
    assert experiment_curves([off, on]) == list(CURVES)


def test_experiment_figure_of_a_column_no_run_measured_is_refused(tmp_path):
    """A configured figure of a column that is NaN in every run (fedsol_knowledge's local
    models' accuracy without train.eval_local_models) is one error naming the column,
    not an empty figure."""
    import numpy as np
    import pandas as pd

    from fedforget.figures import FigureInput

    inp = FigureInput("e", tmp_path, pd.DataFrame(), _metrics(np.nan))
    for name in ("fedsol_knowledge", "curves"):
        options = {"column": "local_models_global_test_acc_mean"} if name == "curves" else {}
        with pytest.raises(FedForgetError, match=r"\['local_models_global_test_acc_mean'\] have a value in no run"):
            FIGURES.get(name)(inp, tmp_path / f"{name}.png", **options)


def test_a_task_aware_panel_without_the_column_says_so(monkeypatch, tmp_path):
    """Completed runs without task_aware (made before the column existed): the panel of the
    experiment's dataset x setting says they do not record it, not that no seed completed."""
    import pandas as pd

    from fedforget import plots
    from fedforget.plots import RUN_KEYS, after_task_curves

    said = []
    monkeypatch.setattr(plots, "_no_data", lambda ax, text="no completed seed": said.append(text))
    key = dict(dataset="d", setting="s", clients=2, partition_seed=0, method="fedavg", seed=0)
    runs = pd.DataFrame([{**key, "status": "completed", "tasks": 2, "rounds_per_task": 1, "incremental": "class"}])
    matrices = pd.DataFrame([{**key, "after_task": a, "task": i, "accuracy": 0.5} for a in (0, 1) for i in (0, 1)])
    empty = pd.DataFrame(columns=[*RUN_KEYS, "after_task", "task", "accuracy"])
    after_task_curves(empty, runs, tmp_path / "a.png", "acc_after_task_aware", matrices)
    assert said == ["not recorded by these runs"]
    after_task_curves(matrices, runs.assign(status="failed"), tmp_path / "b.png", "acc_after_task")
    assert said[1:] == ["no completed seed"]
