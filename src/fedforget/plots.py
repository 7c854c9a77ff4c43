"""Figures: learning curves with seed bands, partition heatmaps and, for
experiments with continual runs, the accuracy matrices, the accuracy after each task and
the per-task accuracy over rounds (CONTINUAL_FIGURES)."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from . import continual
from .continual import TASK_AWARE, accuracy_matrix_rows
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
    "acc_after_task_aware": "Average task-aware accuracy (the true task given), after each task",
    "fgt_after_task": "Average forgetting of the tasks learned before, after each task",
    "fgt_after_task_aware": "Average task-aware forgetting (the true task given), after each task",
    "current_task_acc": "Accuracy on the task just learned, after each task",
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


# the learning curves that some runs do not measure, and the train setting that measures
# them: an experiment draws such a curve only where one of its runs has that setting
# (``experiment_curves``; the workflow's rule plot_<curve>), so no figure of a column the
# config never measures is published [D]. Asked for anyway (``fedforget plot --curves``), a
# curve no run measured is a notice that says so and why, not empty axes.
CURVE_NEEDS = {"local_models_global_test_acc_mean": "eval_local_models"}


def experiment_curves(trains: Iterable[Any]) -> list[str]:
    """The learning curves (CURVES) an experiment whose runs train with ``trains``
    (``TrainSpec``s) measures: every curve but those whose CURVE_NEEDS setting no run has."""
    trains = list(trains)
    return [c for c in CURVES if c not in CURVE_NEEDS or any(getattr(t, CURVE_NEEDS[c]) for t in trains)]


def measured(metrics: pd.DataFrame, column: str) -> bool:
    """Whether some run measured ``column``: it is in the summary and not all NaN (a column
    that only some runs write, e.g. with ``train.eval_local_models: false`` in the others, is
    NaN in their rows)."""
    return column in metrics and bool(metrics[column].notna().any())


def _not_measured(column: str, path: Path, heading: str) -> Path:
    """The figure of a curve that no run measured: its heading and why it has no data."""
    plt = _plt()
    need = CURVE_NEEDS.get(column)
    text = (f"Not measured in this experiment: no run has a value in the metrics column '{column}'"
            + (f" (it needs train.{need}: true)." if need else "."))  # fmt: skip
    fig = plt.figure(figsize=(6.4, 1.6), layout="constrained")
    fig.suptitle(_wrap(heading, 6.2, SUPTITLE_SIZE))
    fig.text(0.5, 0.4, _wrap(text, 6.0, 10), ha="center", va="center", fontsize=10)
    _save(fig, path)
    plt.close(fig)
    return path


def learning_curves(
    metrics: pd.DataFrame, column: str, path: str | Path, title: str | None = None
) -> Path:
    """One panel per dataset x setting (those with a value in ``column``), one line per
    method, band = ±1 std over seeds. Accuracy columns are drawn in % (0-100); axes are
    labelled in words. A column that no run measured: a notice saying so (``_not_measured``)."""
    from matplotlib.ticker import MaxNLocator

    path = Path(path)
    heading = title or CURVES.get(column) or axis_label(column).removesuffix(" (%)")
    if not measured(metrics, column):
        return _not_measured(column, path, heading)
    plt = _plt()
    df = metrics.dropna(subset=[column])
    acc = is_accuracy(column)
    if acc:
        df = df.assign(**{column: df[column].astype(float) * 100})
    panels = _panels(df, ["dataset", "setting"])
    titles = [f"{ds}, {setting_label(setting)}" for ds, setting in panels]
    fig, axes, ncol, titles = _grid(plt, titles, 3, 4.6, 3.4, sharey=acc)
    ylabel = axis_label(column)
    colors = method_colors(df["method"])
    for i, (ax, (ds, setting), title_) in enumerate(zip(axes.flat, panels, titles)):
        sub = df[(df["dataset"] == ds) & (df["setting"] == setting)]
        mean_sd_lines(ax, sub, "round", column, colors, legend=i == 0)
        ax.set_title(title_, fontsize=PANEL_TITLE_SIZE)
        ax.set_xlabel("Round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel if i % ncol == 0 else "")
        if acc:
            ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    _method_legend(fig, axes)
    return _finish(fig, plt, path, f"{heading}\nmean over seeds, band ±1 std")


def partition_heatmap(
    counts: np.ndarray,
    path: str | Path,
    title: str,
    class_names: list[str] | None = None,
    task_counts: np.ndarray | None = None,
) -> Path:
    """Clients x classes sample counts, annotated up to 400 cells, each cell as wide as its
    largest count (two classes of SST-2 over 15 clients, 0.45 inches a cell, overlapped
    their four-digit counts) [D]; past the tick labels that fit, every n-th client and class
    is labelled (``_thin_ticks``). A per-task partition adds ``task_counts`` (clients x
    tasks) in a second panel, so a client without rows of a task shows as a 0. Drawn with
    matplotlib (``_count_panel``), not seaborn, whose import (scipy.stats) was half of a
    partition job's time [D]."""
    plt = _plt()
    path = Path(path)
    panels = [(counts, "class", class_names)] + ([] if task_counts is None else [(task_counts, "task", None)])
    sizes = []
    for m, _, _ in panels:
        k, c = m.shape
        annot = k * c <= 400
        cell = max(0.45, _text_width(str(int(m.max(initial=0))), 10) + 0.15) if annot else 0.45
        sizes.append((annot, min(2.0 + cell * c, 12)))  # + y labels (0.6 in) and colour bar (1.4)
    k = counts.shape[0]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(sum(w for _, w in sizes), min(1.5 + 0.28 * k, 14)), squeeze=False,
        gridspec_kw={"width_ratios": [w for _, w in sizes]},
    )  # fmt: skip
    for ax, (m, what, names), (annot, _) in zip(axes[0], panels, sizes):
        _count_panel(fig, ax, m, annot, names or list(range(m.shape[1])))
        ax.set_xlabel(what)
        ax.set_ylabel("client")
    axes[0][0].set_title(title)
    if task_counts is not None:
        axes[0][1].set_title("per task")
    fig.tight_layout()
    for ax in axes[0]:
        _thin_ticks(fig, ax)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def _count_panel(fig, ax, m: np.ndarray, annotate: bool, xlabels: list) -> None:
    """Clients x columns counts as cells (viridis, a colour bar "samples"), a label per row
    and column at the cell's centre, each cell's count written where ``annotate``
    (``_text_on``)."""
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    cmap, m = colormaps["viridis"], np.asarray(m)
    norm = Normalize(vmin=0.0, vmax=float(max(m.max(initial=0), 1)))  # counts: 0 at the bottom
    image = ax.pcolormesh(m, cmap=cmap, norm=norm)
    ax.set_xlim(0, m.shape[1])
    ax.set_ylim(m.shape[0], 0)  # client 0 on top
    ax.set_xticks(np.arange(m.shape[1]) + 0.5, labels=[str(x) for x in xlabels], rotation=90)
    ax.set_yticks(np.arange(m.shape[0]) + 0.5, labels=[str(i) for i in range(m.shape[0])], rotation=0)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    fig.colorbar(image, ax=ax, label="samples")
    if annotate:
        for (r, c), v in np.ndenumerate(m):
            ax.text(c + 0.5, r + 0.5, f"{int(v)}", ha="center", va="center", color=_text_on(cmap(norm(v))))


def _text_on(rgba: tuple) -> str:
    """The colour of a cell's text on a cell of colour ``rgba``: dark on light cells, white
    on dark ones (seaborn's heatmap rule, relative luminance > 0.408)."""
    red, green, blue, _ = rgba
    return "0.15" if 0.2126 * red + 0.7152 * green + 0.0722 * blue > 0.408 else "white"


def _thin_ticks(fig, ax) -> None:
    """Label every n-th tick of each axis, the smallest n at which neighbouring labels keep
    apart: the cells of 100 clients in 14 inches are narrower than a label (FedSOL's and
    FedProj's 100- and 200-client partitions, CIFAR-100's 100 classes overlapped) [D]."""
    renderer = fig.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    for axis, length in ((ax.xaxis, box.width), (ax.yaxis, box.height)):
        ticks, labels = axis.get_ticklocs(), axis.get_ticklabels()
        if len(ticks) < 2:
            continue
        extents = [t.get_window_extent(renderer) for t in labels]
        along = [e.width if axis is ax.xaxis else e.height for e in extents]
        step = max(1, int(np.ceil(1.2 * max(along) / (length / len(ticks)))))
        if step > 1:
            texts = [t.get_text() if i % step == 0 else "" for i, t in enumerate(labels)]
            axis.set_ticks(ticks, texts, rotation=labels[0].get_rotation())


RUN_KEYS = ["dataset", "setting", "clients", "partition_seed", "method", "seed"]


def _completed(frame: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``frame`` (with run keys) whose run completed: the figures average over
    the seeds the tables average over."""
    done = runs.loc[runs["status"] == "completed", RUN_KEYS]
    return frame.merge(done, on=RUN_KEYS, how="inner")


def _panels(frame: pd.DataFrame, keys: list[str]) -> list[tuple]:
    return list(dict.fromkeys(zip(*(frame[k] for k in keys)))) or [("",) * len(keys)]


# font sizes (points) of the panel titles and the figure's heading. Panel titles at
# matplotlib's default (12) overlapped in a row of four 3.45-inch heatmaps (5 tasks) [D].
PANEL_TITLE_SIZE = 10
SUPTITLE_SIZE = 12
# room (inches) beside a panel's axes for its y tick labels and y label: a panel title may be
# as wide as the panel less this and overlap no neighbour [D]
Y_MARGIN = 0.8


@functools.lru_cache(maxsize=4096)
def _text_width(text: str, size: float) -> float:
    """Width in inches of the widest line of ``text`` drawn at ``size`` points, measured with
    the renderer the figures are drawn with (Agg, 72 dpi: pixels = points)."""
    from matplotlib.backends.backend_agg import RendererAgg
    from matplotlib.font_manager import FontProperties

    renderer, font = RendererAgg(1, 1, 72), FontProperties(size=size)
    lines = text.split("\n")
    return max(renderer.get_text_width_height_descent(line, font, ismath=False)[0] for line in lines) / 72


def _wrap(text: str, width: float, size: float) -> str:
    """``text`` with each line broken so that it fits ``width`` inches at ``size`` points:
    after a comma where it can ("digits-class-il," / "Dirichlet α = 0.5"), else between
    words; a word wider than ``width`` stays whole."""
    out = []
    for line in text.split("\n"):
        current = ""
        for part in re.split(r"(?<=,) ", line):
            for piece in [part] if _text_width(part, size) <= width else part.split(" "):
                joined = f"{current} {piece}" if current else piece
                if current and _text_width(joined, size) > width:
                    out.append(current)
                    current = piece
                else:
                    current = joined
        out.append(current)
    return "\n".join(out)


def _grid(plt, titles: list[str], ncol: int, w: float, h: float, cap: float = 1.4, **kw):
    """A figure with one panel per title, ``ncol`` columns at most, in constrained layout
    (room for the heading, the titles, the colour bar and a legend beside the panels).
    Panels are ``w`` x ``h`` inches, widened (up to ``cap`` x ``w``) for the longest title
    (``_text_width``) and the titles wrapped to that width (``_wrap``): long dataset and
    method labels overlap no neighbour [D]. Returns (fig, axes, ncol, wrapped titles)."""
    n = len(titles)
    ncol = max(1, min(ncol, n))
    nrow = int(np.ceil(n / ncol))
    longest = max((_text_width(t, PANEL_TITLE_SIZE) for t in titles), default=0.0)
    w = min(max(w, longest + Y_MARGIN), cap * w)
    titles = [_wrap(t, w - Y_MARGIN, PANEL_TITLE_SIZE) for t in titles]
    lines = max((t.count("\n") + 1 for t in titles), default=1)
    h += 0.18 * max(0, lines - 2)  # a title of more lines than the two most have: its height
    fig, axes = plt.subplots(nrow, ncol, figsize=(w * ncol, h * nrow), squeeze=False, layout="constrained", **kw)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, axes, ncol, titles


def _finish(fig, plt, path: Path, heading: str) -> Path:
    """The heading (each line wrapped to the figure's width), saved, closed."""
    width = fig.get_figwidth() - 0.2
    fig.suptitle("\n".join(_wrap(line, width, SUPTITLE_SIZE) for line in heading.split("\n")), fontsize=SUPTITLE_SIZE)
    _save(fig, path)
    plt.close(fig)
    return path


# more methods than this: the legend goes beside the panels, where it covers no curve and no
# title (13 FedSOL variants drawn inside one panel covered both) [D]
MAX_INLINE_LEGEND = 6


def method_colors(methods: pd.Series) -> dict[str, Any]:
    """One colour per method, in order of appearance, from matplotlib's colour cycle (the
    same in every panel of a figure)."""
    import matplotlib as mpl

    cycle = mpl.rcParams["axes.prop_cycle"].by_key()["color"]
    return {m: cycle[i % len(cycle)] for i, m in enumerate(dict.fromkeys(methods))}


def mean_sd_lines(ax, data: pd.DataFrame, x: str, y: str, colors: dict[str, Any], marker: str | None = None,
                  legend: bool = False) -> None:  # fmt: skip
    """One line per method of ``data``: the mean of ``y`` over its rows (seeds) at each ``x``,
    a band of ±1 sample standard deviation where there are two or more (seaborn's
    ``lineplot(errorbar="sd")``, drawn with matplotlib: seaborn's import, scipy.stats
    included, took a third of a plot job) [D]; the legend (title "method") where ``legend``."""
    for method, g in data.groupby("method", sort=False):
        stats = g.groupby(x)[y].agg(["mean", "std"]).sort_index()
        ax.plot(stats.index, stats["mean"], color=colors[method], marker=marker, label=str(method))
        band = stats.dropna(subset=["std"])
        if len(band):
            ax.fill_between(band.index, band["mean"] - band["std"], band["mean"] + band["std"],
                            color=colors[method], alpha=0.2, linewidth=0)  # fmt: skip
    if legend:
        ax.legend(title="method")


def _method_legend(fig, axes) -> None:
    """The first panel's legend (one entry per method), titled "Method"; past
    ``MAX_INLINE_LEGEND`` entries it moves to the right of the figure (constrained layout
    makes room for it; the figure widens by its width), in as many columns as keep it within
    the figure's height (16 FedSOL variants in one column, 0.2 inches each, reached up into
    the heading of a one-row figure) [D]."""
    legend = axes.flat[0].get_legend()
    if legend is None:
        return
    if len(legend.get_texts()) <= MAX_INLINE_LEGEND:
        legend.set_title("Method")
        return
    labels = [t.get_text() for t in legend.get_texts()]
    handles = legend.legend_handles
    legend.remove()
    rows = max(1, int((fig.get_figheight() - 1.0) / 0.2))  # less the heading and the legend's title
    legend = fig.legend(handles, labels, title="Method", loc="outside right center", fontsize=8,
                        ncol=-(-len(labels) // rows))  # fmt: skip
    # the figure widens by the legend's width: the panels keep theirs
    width = legend.get_window_extent(fig.canvas.get_renderer()).width / fig.dpi
    fig.set_figwidth(fig.get_figwidth() + width + 0.1)


def _no_data(ax, text: str = "no completed seed") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


def _task_ticks(n: int) -> list[int]:
    step = max(1, int(np.ceil(n / 10)))
    return list(range(1, n + 1, step))


def _matrix_panel(ax, values: np.ndarray, annotate: bool, vmax: float = 100, fmt: str = ".1f", first_row: int = 0):
    """One task x task matrix as an image (an accuracy matrix, %: rows = after training task
    t, columns = task i), tasks numbered from 1 (the rows from ``first_row`` + 1), cells
    annotated with their values (``fmt``) where ``annotate``, the colour scale 0..``vmax``;
    returns the image. Drawn with matplotlib, not seaborn's heatmap: that draws the whole
    figure once per annotated panel (to pick the text colours), quadratic in the panels: 30
    panels of 10 tasks (FedGP's Table 1, CIFAR-100) took 225 s [D]."""
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    n_rows, n_cols = values.shape
    image = ax.imshow(values, cmap=cmap, vmin=0, vmax=vmax, aspect="equal", interpolation="nearest")
    ax.set_xticks(range(n_cols), labels=[str(i + 1) for i in range(n_cols)])
    ax.set_yticks(range(n_rows), labels=[str(t + first_row + 1) for t in range(n_rows)])
    ax.tick_params(length=0)
    if annotate:
        for (r, c), v in np.ndenumerate(values):
            if np.isfinite(v):
                ax.text(c, r, f"{v:{fmt}}", ha="center", va="center", fontsize=7, color=_text_on(cmap(v / vmax)),
                        in_layout=False)  # inside the axes: nothing for the layout to make room for
    return image


def accuracy_matrix_heatmaps(matrices: pd.DataFrame, runs: pd.DataFrame, path: str | Path) -> Path:
    """One heatmap per dataset x setting x method: a[t][i] (%), mean over completed seeds,
    rows = after training task t, columns = task i evaluated, values annotated (up to 12
    tasks)."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    plt = _plt()
    path = Path(path)
    ok = _completed(matrices, runs)
    panels = _panels(matrices, ["dataset", "setting", "method"])
    n_methods = matrices["method"].nunique() if len(matrices) else 1
    tasks = int(matrices["task"].max()) + 1 if len(matrices) else 1
    annotate = tasks <= 12
    size = max(3.2, (0.45 if annotate else 0.25) * tasks + 1.2)
    seeds = ok.groupby(["dataset", "setting", "method"])["seed"].nunique()
    titles = []
    for ds, setting, method in panels:
        n = int(seeds.get((ds, setting, method), 0))
        titles.append(f"{ds}, {setting_label(setting)}\n{method} ({n} seed{'s' if n != 1 else ''})" if ds else "")
    fig, axes, _, titles = _grid(plt, titles, min(4, n_methods), size, size * 0.9)
    for ax, (ds, setting, method), title in zip(axes.flat, panels, titles):
        sub = ok[(ok["dataset"] == ds) & (ok["setting"] == setting) & (ok["method"] == method)]
        if len(sub):
            m = sub.groupby(["after_task", "task"])["accuracy"].mean().unstack("task") * 100
            m = m.reindex(index=range(int(m.index.max()) + 1), columns=range(int(m.columns.max()) + 1))
            _matrix_panel(ax, m.to_numpy(dtype=float), annotate)
        else:
            _no_data(ax)
        ax.set_title(title, fontsize=PANEL_TITLE_SIZE)
        ax.set_xlabel("Task evaluated")
        ax.set_ylabel("After training task")
    fig.colorbar(ScalarMappable(Normalize(0, 100), "viridis"), ax=list(axes.flat[: len(panels)]),
                 label="Accuracy (%)", shrink=0.8)  # fmt: skip
    heading = f"{CONTINUAL_FIGURES['accuracy_matrix']} (%)\nmean over seeds"
    return _finish(fig, plt, path, heading)


# the after-each-task figures: the per-task value of a run's accuracy matrix
# (``fedforget.continual``), its name on the y axis, its symbol in the heading
AFTER_TASK = {
    "acc_after_task": ("acc_after_each_task", "Average accuracy over learned tasks (%)", "Acc_t"),
    "acc_after_task_aware": ("acc_after_each_task", "Average task-aware accuracy (%)", "Acc_t"),
    "fgt_after_task": ("fgt_after_each_task", "Average forgetting (%)", "Fgt_t"),
    "fgt_after_task_aware": ("fgt_after_each_task", "Average task-aware forgetting (%)", "Fgt_t"),
    "current_task_acc": ("diagonal", "Accuracy on the newest task (%)", "a_t,t"),
}  # fmt: skip


def after_task_values(a: np.ndarray, kind: str) -> np.ndarray:
    """[T] of ``AFTER_TASK[kind]`` for the accuracy matrix ``a`` (fractions)."""
    fn = AFTER_TASK[kind][0]
    return np.diag(a).copy() if fn == "diagonal" else getattr(continual, fn)(a)


def task_aware_matrices(tasks: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """accuracy_matrix.csv's rows of the task-aware accuracy: each run's matrix of its
    tasks.csv column ``task_aware`` (``continual.TASK_AWARE``: a stream evaluated without the
    task id), or of its accuracy where the stream is evaluated with it (task-incremental)."""
    out = []
    shape = {tuple(r[k] for k in RUN_KEYS): (r["tasks"], r["rounds_per_task"], r["incremental"]) for _, r in runs.iterrows()}
    for key, g in _completed(tasks, runs).groupby(RUN_KEYS, sort=False):
        n, r, incremental = shape[key]
        col = TASK_AWARE if TASK_AWARE in g and g[TASK_AWARE].notna().any() else None
        if col is None and incremental == "task":
            col = "accuracy"
        if col is None:
            continue
        rows = accuracy_matrix_rows(g[["round", "task", col]].rename(columns={col: "accuracy"}), int(n), int(r))
        out += [{**dict(zip(RUN_KEYS, key)), **row} for row in rows]
    return pd.DataFrame(out, columns=[*RUN_KEYS, "after_task", "task", "accuracy"])


def after_task_curves(
    matrices: pd.DataFrame, runs: pd.DataFrame, path: str | Path, kind: str = "acc_after_task",
    panel_frame: pd.DataFrame | None = None,
) -> Path:
    """A value of the accuracy matrix after each task (``AFTER_TASK[kind]``, %) against the
    number of tasks learned: Acc_t = mean_{i <= t} a[t][i] (``acc_after_task``; of the
    task-aware matrices, ``task_aware_matrices``, for ``acc_after_task_aware``: FedProTIP's
    Fig. 3b), Fgt_t (``fgt_after_task``, from the second task: FedGP's Fig. 5; of the
    task-aware matrices for ``fgt_after_task_aware``: Fig. 5's task-IL panels, which the
    FedGP configs draw from their class-IL runs) or a[t][t],
    the accuracy on the task just learned (``current_task_acc``: FedGP's Fig. 6 [D: its
    x axis is not in the text; after each task]). One panel per dataset x setting, one line
    per method, band = ±1 std over completed seeds. The panels are ``panel_frame``'s
    dataset x setting pairs (default ``matrices``'); a panel with no value says whether its
    runs did not complete or do not record it (runs from before the task-aware column)."""
    plt = _plt()
    path = Path(path)
    _, ylabel, symbol = AFTER_TASK[kind]
    rows = []
    for key, g in _completed(matrices, runs).groupby(RUN_KEYS, sort=False):
        a = g.pivot(index="after_task", columns="task", values="accuracy").sort_index().sort_index(axis=1)
        for t, v in enumerate(after_task_values(a.to_numpy(dtype=float), kind)):
            if np.isfinite(v):
                rows.append({**dict(zip(RUN_KEYS, key)), "tasks_learned": t + 1, "value": v * 100})
    df = pd.DataFrame(rows, columns=[*RUN_KEYS, "tasks_learned", "value"])
    panels = _panels(matrices if panel_frame is None else panel_frame, ["dataset", "setting"])
    titles = [f"{ds}, {setting_label(setting)}" if ds else "" for ds, setting in panels]
    fig, axes, ncol, titles = _grid(plt, titles, 3, 4.6, 3.4, sharey=True)
    colors = method_colors(df["method"])
    done = runs.loc[runs["status"] == "completed", ["dataset", "setting"]]
    # forgetting may be negative: the lowest value 5 points above the axis, its marker whole
    low = min(0.0, float(df["value"].min())) if len(df) else 0.0
    low = low - 5 if low < 0 else low
    for i, (ax, (ds, setting), title) in enumerate(zip(axes.flat, panels, titles)):
        sub = df[(df["dataset"] == ds) & (df["setting"] == setting)]
        if len(sub):
            mean_sd_lines(ax, sub, "tasks_learned", "value", colors, marker="o", legend=i == 0)
            ax.set_xticks(_task_ticks(int(sub["tasks_learned"].max())))
        elif ((done["dataset"] == ds) & (done["setting"] == setting)).any():
            _no_data(ax, "not recorded by these runs")
        else:
            _no_data(ax)
        ax.set_title(title, fontsize=PANEL_TITLE_SIZE)
        ax.set_xlabel("Tasks learned")
        ax.set_ylabel(ylabel if i % ncol == 0 else "")
        ax.set_ylim(low, 100)
        ax.grid(alpha=0.3)
    _method_legend(fig, axes)
    heading = f"{CONTINUAL_FIGURES[kind]} ({symbol})\nmean over seeds, band ±1 std"
    return _finish(fig, plt, path, heading)


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
    titles = [f"{ds}, {setting_label(setting)}\n{method}" if ds else "" for ds, setting, method in panels]
    fig, axes, ncol, titles = _grid(plt, titles, min(4, n_methods), 4.6, 3.4, sharey=True)
    for i, (ax, (ds, setting, method), title) in enumerate(zip(axes.flat, panels, titles)):
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
        ax.set_title(title, fontsize=PANEL_TITLE_SIZE)
        ax.set_xlabel("Round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("Global model test accuracy (%)" if i % ncol == 0 else "")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        axes.flat[0].legend(handles, labels, title="Task", fontsize=7, ncol=2 if n_tasks > 5 else 1)
    heading = f"{CONTINUAL_FIGURES['task_accuracy']}\nmean over seeds, dashed: task boundaries"
    return _finish(fig, plt, path, heading)


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
    aware = task_aware_matrices(tasks, runs)
    return [
        accuracy_matrix_heatmaps(matrices, runs, out / "accuracy_matrix.png"),
        after_task_curves(matrices, runs, out / "acc_after_task.png", "acc_after_task"),
        after_task_curves(aware, runs, out / "acc_after_task_aware.png", "acc_after_task_aware", matrices),
        after_task_curves(matrices, runs, out / "fgt_after_task.png", "fgt_after_task"),
        after_task_curves(aware, runs, out / "fgt_after_task_aware.png", "fgt_after_task_aware", matrices),
        after_task_curves(matrices, runs, out / "current_task_acc.png", "current_task_acc"),
        task_accuracy_curves(tasks, runs, out / "task_accuracy.png"),
    ]  # CONTINUAL_FIGURES' order


def plot_experiment(
    summary_dir: str | Path, out_dir: str | Path, curves: Sequence[str] | None = None, continual: bool = True
) -> list[Path]:
    """The learning curves ``curves`` (default: CURVES) and, with ``continual`` where the
    experiment has continual runs (its summary has tasks.parquet), the CONTINUAL_FIGURES in
    ``out_dir``/CONTINUAL_DIR."""
    path = Path(summary_dir) / "metrics.parquet"
    if not path.is_file():
        raise FedForgetError(f"summary {path} not found; run `fedforget aggregate` first")
    curves = list(CURVES) if curves is None else list(curves)
    unknown = [c for c in curves if c not in CURVES]
    if unknown:
        raise FedForgetError(f"learning curve {unknown[0]!r}; allowed: {', '.join(CURVES)}")
    metrics = pd.read_parquet(path)
    out = Path(out_dir)
    paths = [learning_curves(metrics, col, out / f"{col}.png") for col in curves]
    if continual and (Path(summary_dir) / "tasks.parquet").is_file():
        paths += plot_continual(summary_dir, out / CONTINUAL_DIR)
    return paths
