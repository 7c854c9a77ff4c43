"""Figures: learning curves with seed bands (seaborn), partition heatmaps and, for
experiments with continual runs, the accuracy matrices, the accuracy after each task and
the per-task accuracy over rounds (CONTINUAL_FIGURES)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from .utils import FedForgetError, atomic_write

# the learning curves every experiment draws (figures/<column>.png), with their names in words
# (figure titles, and the figures' labels in the Snakemake report)
CURVES = {
    "global_model_test_acc": "Global model test accuracy",
    "local_models_global_test_acc_mean": "Local models' test accuracy after local training (mean over sampled clients)",
    "sampled_clients_local_train_loss_mean": "Local training loss (mean over sampled clients)",
}

# the figures of experiments with continual runs (figures/continual/<name>.png, from the
# summary files tasks.parquet and accuracy_matrix.csv of ``aggregate``), with their names in
# words. A folder of their own: no experiment figure label (no '/') can name the same file
# [D]. Tasks are numbered from 1 in the figures, as in the papers (from 0 in the files) [D].
CONTINUAL_DIR = "continual"
CONTINUAL_FIGURES = {
    "accuracy_matrix": "Accuracy matrix: accuracy on each task after training each task",
    "acc_after_task": "Average accuracy over the tasks learned so far, after each task",
    "task_accuracy": "Global model accuracy on each task over rounds",
}

# y-axis labels in words (the unit is added: "(%)" for accuracy columns)
AXIS_LABELS = {
    "global_model_test_acc": "Global model test accuracy",
    "global_model_test_loss": "Global model test loss",
    "local_models_global_test_acc_mean": "Local models' test accuracy",
    "local_models_global_test_acc_min": "Worst local model's test accuracy",
    "sampled_clients_local_train_loss_mean": "Local training loss",
}
_WORDS = {"acc": "accuracy", "dist": "distance", "kl": "KL", "fedsol": "FedSOL", "fedproj": "FedProj",
          "fedavg": "FedAvg", "prox": "proximal", "cos": "cosine"}  # fmt: skip


def is_accuracy(column: str) -> bool:
    """Accuracy columns (fractions in metrics.csv) are plotted in %, like the tables."""
    return column.endswith(("acc", "acc_mean", "acc_min")) or "_acc" in column


def axis_label(column: str) -> str:
    """'global_model_test_acc' -> 'Global model test accuracy (%)'; unknown columns in words."""
    text = AXIS_LABELS.get(column)
    if text is None:
        m = re.fullmatch(r"global_model_test_acc_class(\d+)", column)
        if m:
            text = f"Global model test accuracy on class {m.group(1)}"
        else:
            words = [_WORDS.get(w, w) for w in column.split("_") if w]
            text = " ".join(words) or column
            text = text[:1].upper() + text[1:]
    return f"{text} (%)" if is_accuracy(column) else text


def setting_label(setting: str) -> str:
    """Partition setting in words: 'dirichlet-0.5' -> 'Dirichlet α = 0.5'."""
    scheme, _, arg = str(setting).partition("-")
    if scheme == "iid":
        return "IID"
    if scheme == "dirichlet" and arg:
        return f"Dirichlet α = {arg}"
    if scheme == "shards" and arg:
        return f"{arg} shards per client"
    if scheme == "classes" and arg:
        return f"class fractions {arg}"
    return str(setting)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    atomic_write(
        path,
        lambda tmp: fig.savefig(tmp, format=path.suffix.lstrip("."), dpi=120, bbox_inches="tight"),
    )


def learning_curves(
    metrics: pd.DataFrame, column: str, path: str | Path, title: str | None = None
) -> Path:
    """One panel per dataset x setting, one line per method, band = ±1 std over seeds.
    Accuracy columns are drawn in % (0-100); axes are labelled in words."""
    import seaborn as sns
    from matplotlib.ticker import MaxNLocator

    plt = _plt()
    path = Path(path)
    df = metrics.dropna(subset=[column]) if column in metrics else metrics.iloc[0:0]
    acc = is_accuracy(column)
    if acc and len(df):
        df = df.assign(**{column: df[column].astype(float) * 100})
    panels = list(dict.fromkeys(zip(df["dataset"], df["setting"]))) or [("", "")]
    ncol = min(3, len(panels))
    nrow = int(np.ceil(len(panels) / ncol))
    fig, axes = plt.subplots(
        nrow, ncol, figsize=(4.6 * ncol, 3.4 * nrow), squeeze=False, sharey=acc
    )
    ylabel = axis_label(column)
    for i, (ax, (ds, setting)) in enumerate(zip(axes.flat, panels)):
        sub = df[(df["dataset"] == ds) & (df["setting"] == setting)]
        if len(sub):
            sns.lineplot(
                data=sub,
                x="round",
                y=column,
                hue="method",
                errorbar="sd",
                ax=ax,
                legend=i == 0,
            )
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{ds}, {setting_label(setting)}" if ds else "")
        ax.set_xlabel("Round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel if i % ncol == 0 else "")
        if acc:
            ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    _method_legend(fig, axes)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    heading = title or CURVES.get(column) or axis_label(column).removesuffix(" (%)")
    heading = textwrap.fill(heading, width=50 * ncol)
    fig.suptitle(f"{heading}\nmean over seeds, band ±1 std")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def partition_heatmap(
    counts: np.ndarray, path: str | Path, title: str, class_names: list[str] | None = None
) -> Path:
    """Clients x classes sample counts."""
    import seaborn as sns

    plt = _plt()
    path = Path(path)
    k, c = counts.shape
    fig, ax = plt.subplots(figsize=(min(1.0 + 0.45 * c, 12), min(1.5 + 0.28 * k, 14)))
    sns.heatmap(counts, ax=ax, cmap="viridis", annot=k * c <= 400, fmt="d", cbar_kws={"label": "samples"},
                xticklabels=class_names or list(range(c)), yticklabels=list(range(k)))  # fmt: skip
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    ax.set_title(title)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


RUN_KEYS = ["dataset", "setting", "clients", "partition_seed", "method", "seed"]


def _completed(frame: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``frame`` (with run keys) whose run completed: the figures average over
    the seeds the tables average over."""
    done = runs.loc[runs["status"] == "completed", RUN_KEYS]
    return frame.merge(done, on=RUN_KEYS, how="inner")


def _panels(frame: pd.DataFrame, keys: list[str]) -> list[tuple]:
    return list(dict.fromkeys(zip(*(frame[k] for k in keys)))) or [("",) * len(keys)]


def _grid(plt, n: int, ncol: int, w: float, h: float, **kw):
    ncol = max(1, min(ncol, n))
    nrow = int(np.ceil(n / ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(w * ncol, h * nrow), squeeze=False, **kw)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, axes, ncol


def _finish(fig, plt, path: Path, heading: str, ncol: int, tight: bool = True) -> Path:
    fig.suptitle("\n".join(textwrap.fill(line, width=50 * ncol) for line in heading.split("\n")))
    if tight:
        fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


# more methods than this: the legend goes beside the panels, where it covers no curve and no
# title (13 FedSOL variants drawn inside one panel covered both) [D]
MAX_INLINE_LEGEND = 6


def _method_legend(fig, axes) -> None:
    """The first panel's legend (one entry per method), titled "Method"; past
    ``MAX_INLINE_LEGEND`` entries it moves to the right of the figure."""
    legend = axes.flat[0].get_legend()
    if legend is None:
        return
    if len(legend.get_texts()) <= MAX_INLINE_LEGEND:
        legend.set_title("Method")
        return
    labels = [t.get_text() for t in legend.get_texts()]
    handles = legend.legend_handles
    legend.remove()
    fig.legend(handles, labels, title="Method", loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)


def _no_data(ax, text: str = "no completed seed") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


def _task_ticks(n: int) -> list[int]:
    step = max(1, int(np.ceil(n / 10)))
    return list(range(1, n + 1, step))


def accuracy_matrix_heatmaps(matrices: pd.DataFrame, runs: pd.DataFrame, path: str | Path) -> Path:
    """One heatmap per dataset x setting x method: a[t][i] (%), mean over completed seeds,
    rows = after training task t, columns = task i evaluated, values annotated (up to 12
    tasks)."""
    import seaborn as sns
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    plt = _plt()
    path = Path(path)
    ok = _completed(matrices, runs)
    panels = _panels(matrices, ["dataset", "setting", "method"])
    n_methods = matrices["method"].nunique() if len(matrices) else 1
    tasks = int(matrices["task"].max()) + 1 if len(matrices) else 1
    size = max(3.2, 0.45 * tasks + 1.2)
    fig, axes, ncol = _grid(plt, len(panels), min(4, n_methods), size, size * 0.9, layout="constrained")
    for ax, (ds, setting, method) in zip(axes.flat, panels):
        sub = ok[(ok["dataset"] == ds) & (ok["setting"] == setting) & (ok["method"] == method)]
        seeds = sub["seed"].nunique()
        if len(sub):
            m = sub.groupby(["after_task", "task"])["accuracy"].mean().unstack("task") * 100
            labels = [str(t + 1) for t in m.columns]
            sns.heatmap(m.to_numpy(dtype=float), ax=ax, cmap="viridis", vmin=0, vmax=100, cbar=False,
                        annot=len(m.columns) <= 12, fmt=".1f", annot_kws={"size": 7}, square=True,
                        xticklabels=labels, yticklabels=[str(t + 1) for t in m.index])  # fmt: skip
        else:
            _no_data(ax)
        ax.set_title(f"{ds}, {setting_label(setting)}\n{method} ({seeds} seed{'s' if seeds != 1 else ''})" if ds else "")
        ax.set_xlabel("Task evaluated")
        ax.set_ylabel("After training task")
    fig.colorbar(ScalarMappable(Normalize(0, 100), "viridis"), ax=list(axes.flat[: len(panels)]),
                 label="Accuracy (%)", shrink=0.8)  # fmt: skip
    heading = f"{CONTINUAL_FIGURES['accuracy_matrix']} (%)\nmean over seeds"
    return _finish(fig, plt, path, heading, ncol, tight=False)  # constrained layout: room for the colour bar


def acc_after_task_curves(matrices: pd.DataFrame, runs: pd.DataFrame, path: str | Path) -> Path:
    """Acc_t = mean_{i <= t} a[t][i] (%) against the number of tasks learned, one panel per
    dataset x setting, one line per method, band = ±1 std over completed seeds."""
    import seaborn as sns

    from .continual import acc_after_each_task

    plt = _plt()
    path = Path(path)
    rows = []
    for key, g in _completed(matrices, runs).groupby(RUN_KEYS, sort=False):
        a = g.pivot(index="after_task", columns="task", values="accuracy").sort_index().sort_index(axis=1)
        for t, v in enumerate(acc_after_each_task(a.to_numpy(dtype=float))):
            rows.append({**dict(zip(RUN_KEYS, key)), "tasks_learned": t + 1, "acc": v * 100})
    df = pd.DataFrame(rows, columns=[*RUN_KEYS, "tasks_learned", "acc"])
    panels = _panels(matrices, ["dataset", "setting"])
    fig, axes, ncol = _grid(plt, len(panels), 3, 4.6, 3.4, sharey=True)
    for i, (ax, (ds, setting)) in enumerate(zip(axes.flat, panels)):
        sub = df[(df["dataset"] == ds) & (df["setting"] == setting)]
        if len(sub):
            sns.lineplot(data=sub, x="tasks_learned", y="acc", hue="method", errorbar="sd", marker="o", ax=ax,
                         legend=i == 0)  # fmt: skip
            ax.set_xticks(_task_ticks(int(sub["tasks_learned"].max())))
        else:
            _no_data(ax)
        ax.set_title(f"{ds}, {setting_label(setting)}" if ds else "")
        ax.set_xlabel("Tasks learned")
        ax.set_ylabel("Average accuracy over learned tasks (%)" if i % ncol == 0 else "")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    _method_legend(fig, axes)
    heading = f"{CONTINUAL_FIGURES['acc_after_task']} (Acc_t)\nmean over seeds, band ±1 std"
    return _finish(fig, plt, path, heading, ncol)


def task_accuracy_curves(tasks: pd.DataFrame, runs: pd.DataFrame, path: str | Path) -> Path:
    """The global model's accuracy on each task (%) per round, mean over completed seeds,
    one line per task, one panel per dataset x setting x method; dashed lines at the task
    boundaries t*R (the last round of each task but the last)."""
    from matplotlib.ticker import MaxNLocator

    plt = _plt()
    path = Path(path)
    ok = _completed(tasks, runs)
    panels = _panels(tasks, ["dataset", "setting", "method"])
    n_methods = tasks["method"].nunique() if len(tasks) else 1
    n_tasks = int(tasks["task"].max()) + 1 if len(tasks) else 1
    colours = plt.get_cmap("viridis")(np.linspace(0, 0.9, n_tasks))
    fig, axes, ncol = _grid(plt, len(panels), min(4, n_methods), 4.6, 3.4, sharey=True)
    for i, (ax, (ds, setting, method)) in enumerate(zip(axes.flat, panels)):
        sel = (ok["dataset"] == ds) & (ok["setting"] == setting) & (ok["method"] == method)
        sub = ok[sel].groupby(["task", "round"])["accuracy"].mean() * 100
        for t in sub.index.get_level_values("task").unique():
            curve = sub.loc[t]
            ax.plot(curve.index, curve.to_numpy(), color=colours[int(t)], label=f"{int(t) + 1}", lw=1.4)
        r = runs[(runs["dataset"] == ds) & (runs["setting"] == setting) & (runs["method"] == method)]
        if len(r) and "rounds_per_task" in r:
            rpt, n = int(r["rounds_per_task"].iloc[0]), int(r["tasks"].iloc[0])
            for b in range(1, n):
                ax.axvline(b * rpt, color="0.4", ls="--", lw=0.8)
        if not len(sub):
            _no_data(ax)
        ax.set_title(f"{ds}, {setting_label(setting)}\n{method}" if ds else "")
        ax.set_xlabel("Round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("Global model test accuracy (%)" if i % ncol == 0 else "")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        axes.flat[0].legend(handles, labels, title="Task", fontsize=7, ncol=2 if n_tasks > 5 else 1)
    heading = f"{CONTINUAL_FIGURES['task_accuracy']}\nmean over seeds, dashed: task boundaries"
    return _finish(fig, plt, path, heading, ncol)


def plot_continual(summary_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """CONTINUAL_FIGURES from an experiment's summary (runs.csv, tasks.parquet,
    accuracy_matrix.csv, written by ``aggregate`` for experiments with continual runs)."""
    d, out = Path(summary_dir), Path(out_dir)
    files = [d / "runs.csv", d / "tasks.parquet", d / "accuracy_matrix.csv"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FedForgetError(f"continual summary file(s) {missing} not found; run `fedforget aggregate` first")
    runs, tasks, matrices = pd.read_csv(files[0]), pd.read_parquet(files[1]), pd.read_csv(files[2])
    runs = runs[runs["tasks"] > 1]
    return [
        accuracy_matrix_heatmaps(matrices, runs, out / "accuracy_matrix.png"),
        acc_after_task_curves(matrices, runs, out / "acc_after_task.png"),
        task_accuracy_curves(tasks, runs, out / "task_accuracy.png"),
    ]  # CONTINUAL_FIGURES' order


def plot_experiment(summary_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """The learning curves (CURVES) and, where the experiment has continual runs (its
    summary has tasks.parquet), the CONTINUAL_FIGURES in ``out_dir``/CONTINUAL_DIR."""
    path = Path(summary_dir) / "metrics.parquet"
    if not path.is_file():
        raise FedForgetError(f"summary {path} not found; run `fedforget aggregate` first")
    metrics = pd.read_parquet(path)
    out = Path(out_dir)
    paths = [learning_curves(metrics, col, out / f"{col}.png") for col in CURVES]
    if (Path(summary_dir) / "tasks.parquet").is_file():
        paths += plot_continual(summary_dir, out / CONTINUAL_DIR)
    return paths
