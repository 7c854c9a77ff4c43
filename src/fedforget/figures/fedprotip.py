"""FedProTIP's figures: its theory's quantities (fedprotip.md Sec. 5, Fig. 2) and its task
identification (Fig. 4a).

- ``projection_geometry`` (Fig. 2): from the engine diagnostic ``projection_geometry``
  (``metrics.projection_geometry``: at each round's broadcast weights, rho_t = ||P g_t||^2 /
  ||g_t||^2 of the current task and beta = ||P g_tau|| / ||g_tau|| of each older one), one
  row of three panels per dataset x setting: (a) rho_t per task, one line per method (the
  paper: per threshold eps), mean over the task's rounds, then mean ± std over seeds; (b)
  beta_tau->t as a heatmap (current task t x older task tau) of one method (``method``,
  default the first; the paper: eps 0.7), mean over the rounds of task t and the seeds; (c)
  rho (mean over tasks) and beta (mean over the pairs tau < t) per method, in the methods'
  order, ± std over seeds. The first task is left out of (a) and (c) [D]: with no old
  bases its rho is 1 by construction. Writes a .csv of each panel's table beside it.
- ``task_identity`` (Fig. 4a, Table 14's numbers): after each task t, the share of the test
  rows of the tasks seen that TIP routes to their own task (runs.csv's
  ``avg_acc_after_task_<t>_task_id_<mode>``, ``mode`` batch [C: the authors' code predicts
  one task per test batch] or sample), one panel per dataset x setting, one line per method,
  mean ± std over completed seeds. Writes the plotted table as a .csv beside it.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from ..continual import ACC_AFTER_TASK
from ..plots import (
    PANEL_TITLE_SIZE,
    _finish,
    _grid,
    _matrix_panel,
    _method_legend,
    _no_data,
    _panels,
    _plt,
    _save,
    _task_ticks,
    mean_sd_lines,
    method_colors,
    setting_label,
)  # fmt: skip
from ..utils import FedForgetError
from . import FIGURES, FigureInput

RUN = ["dataset", "setting", "method", "seed"]
PARTS = ("rho_per_task", "beta_heatmap", "means")  # the tables written beside the figure
NEEDS = " (train.diagnostics: [projection_geometry], a method with a shared projection: fedprotip)"


def _geometry(inp: FigureInput) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(rho per run and task t >= 1, beta per run, task t and older task tau), each the mean
    over the task's rounds."""
    inp.require_columns("projection_geometry", ["projection_task", "projection_rho"], NEEDS)
    m = inp.metrics[(inp.metrics["round"] >= 1) & inp.metrics["projection_task"].notna()].copy()
    m["task"] = m["projection_task"].round().astype(int)
    rho = m[m["task"] >= 1].groupby([*RUN, "task"], sort=False)["projection_rho"].mean().rename("rho").reset_index()
    betas = sorted((c for c in m.columns if re.fullmatch(r"projection_beta_task\d+", c)), key=lambda c: int(c[20:]))
    long = m.melt(id_vars=[*RUN, "task"], value_vars=betas, var_name="old", value_name="beta").dropna(subset=["beta"])
    long["old"] = long["old"].str[len("projection_beta_task"):].astype(int)
    beta = long.groupby([*RUN, "task", "old"], sort=False)["beta"].mean().reset_index()
    return rho, beta


def _over_seeds(df: pd.DataFrame, keys: list[str], value: str) -> pd.DataFrame:
    return df.groupby(keys, sort=False)[value].agg(["mean", "std", "count"]).reset_index()


@FIGURES.register("projection_geometry")
def projection_geometry(inp: FigureInput, out: Path, method: str | None = None) -> list[Path]:
    rho, beta = _geometry(inp)
    if rho.empty:
        raise FedForgetError("figure 'projection_geometry': no run has a round after its first task")
    methods = list(dict.fromkeys(inp.runs.loc[inp.runs["status"] == "completed", "method"]))
    methods = [m for m in methods if m in set(rho["method"])]
    shown = method or methods[0]
    if shown not in methods:
        raise FedForgetError(f"figure 'projection_geometry': method '{shown}' has no projection_geometry; have {methods}")
    a = _over_seeds(rho, ["dataset", "setting", "method", "task"], "rho")
    b = _over_seeds(beta[beta["method"] == shown], ["dataset", "setting", "task", "old"], "beta")
    per_run = rho.groupby(RUN, sort=False)["rho"].mean().reset_index().merge(
        beta.groupby(RUN, sort=False)["beta"].mean().reset_index(), on=RUN, how="left")  # fmt: skip
    c = per_run.melt(id_vars=RUN, value_vars=["rho", "beta"], var_name="quantity", value_name="value")
    c = _over_seeds(c.dropna(subset=["value"]), ["dataset", "setting", "quantity", "method"], "value")
    out = Path(out)
    for table, part in zip((a, b, c), PARTS):
        table.to_csv(out.with_name(f"{out.stem}_{part}.csv"), index=False)

    plt = _plt()
    panels = list(dict.fromkeys(zip(a["dataset"], a["setting"])))
    colors = method_colors(pd.Series(methods))
    fig, axes = plt.subplots(len(panels), 3, figsize=(15.5, 4.2 * len(panels)), squeeze=False)
    for row, (ds, st) in zip(axes, panels):
        where = f"{ds}, {setting_label(st)}"
        ax = row[0]  # (a) rho_t per task and method
        sub = a[(a["dataset"] == ds) & (a["setting"] == st)]
        for meth in methods:
            s = sub[sub["method"] == meth].sort_values("task")
            ax.errorbar(s["task"] + 1, s["mean"], yerr=s["std"].fillna(0), marker="o", ms=3, capsize=2,
                        color=colors[meth], label=meth)  # fmt: skip
        ax.set_xticks(sorted(set(sub["task"] + 1)))
        ax.set_xlabel("task")
        ax.set_ylabel("projected-gradient adequacy ρ̂_t")
        ax.set_title(f"(a) ρ̂_t per task\n{where}", fontsize=9)
        ax.legend(fontsize=7, title="method", title_fontsize=7)
        ax = row[1]  # (b) beta heatmap of one method
        sub = b[(b["dataset"] == ds) & (b["setting"] == st)]
        n = int(max(sub["task"].max(), 0)) + 1 if len(sub) else 1
        grid = np.full((n, n), np.nan)
        for _, r in sub.iterrows():
            grid[int(r["task"]), int(r["old"])] = r["mean"]
        # rows: current tasks from the second, columns: older tasks up to the last but one;
        # values in the cells where they fit
        image = _matrix_panel(ax, grid[1:, :-1] if n > 1 else grid, n <= 11, vmax=1, fmt=".2f", first_row=1 if n > 1 else 0)
        fig.colorbar(image, ax=ax, label="interference β̂")
        ax.set_xlabel("old task τ")
        ax.set_ylabel("current task t")
        ax.set_title(f"(b) β̂_τ→t, {shown}\n{where}", fontsize=9)
        ax = row[2]  # (c) the means per method
        sub = c[(c["dataset"] == ds) & (c["setting"] == st)]
        for quantity, label, mark in (("rho", "ρ̂ (mean over tasks)", "o"), ("beta", "β̂ (mean over τ < t)", "s")):
            s = sub[sub["quantity"] == quantity].set_index("method").reindex(methods)
            ax.errorbar(range(len(methods)), s["mean"], yerr=s["std"].fillna(0), marker=mark, capsize=2, label=label)
        ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right", fontsize=7)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"(c) ρ̂ and β̂ per method\n{where}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("FedProTIP Fig. 2: projected-gradient adequacy and interference")
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
    return [out]


TIP_MODES = ("batch", "sample")


@FIGURES.register("task_identity")
def task_identity(inp: FigureInput, out: Path, mode: str = "batch") -> list[Path]:
    if mode not in TIP_MODES:
        raise FedForgetError(f"figure 'task_identity': option mode={mode!r}; allowed: {', '.join(TIP_MODES)}")
    pattern = re.compile(rf"{ACC_AFTER_TASK}(\d+)_task_id_{mode}")
    task_of = {c: int(m.group(1)) for c in inp.runs.columns if (m := pattern.fullmatch(c))}
    done = inp.runs[inp.runs["status"] == "completed"]
    long = done.melt(id_vars=RUN, value_vars=list(task_of), var_name="column", value_name="value").dropna(subset=["value"])
    if long.empty:
        raise FedForgetError(
            f"figure 'task_identity': no completed run records its task-identity accuracy (runs.csv "
            f"{ACC_AFTER_TASK}<t>_task_id_{mode}: FedProTIP with TIP on a stream with per-task heads)"
        )
    long = long.assign(tasks_learned=long["column"].map(task_of), value=long["value"] * 100)
    table = _over_seeds(long, ["dataset", "setting", "method", "tasks_learned"], "value")
    out = Path(out)
    table.sort_values(["dataset", "setting", "method", "tasks_learned"]).to_csv(out.with_suffix(".csv"), index=False)

    plt = _plt()
    panels = _panels(inp.runs, ["dataset", "setting"])
    titles = [f"{ds}, {setting_label(st)}" for ds, st in panels]
    fig, axes, ncol, titles = _grid(plt, titles, 3, 4.6, 3.4, sharey=True)
    colors = method_colors(long["method"])
    for i, (ax, (ds, st), title) in enumerate(zip(axes.flat, panels, titles)):
        sub = long[(long["dataset"] == ds) & (long["setting"] == st)]
        if len(sub):
            mean_sd_lines(ax, sub, "tasks_learned", "value", colors, marker="o", legend=i == 0)
            ax.set_xticks(_task_ticks(int(sub["tasks_learned"].max())))
        else:
            _no_data(ax, "not recorded by these runs")
        ax.set_title(title, fontsize=PANEL_TITLE_SIZE)
        ax.set_xlabel("Tasks learned")
        ax.set_ylabel("Task-identity accuracy (%)" if i % ncol == 0 else "")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    _method_legend(fig, axes)
    heading = f"FedProTIP Fig. 4a: task-identity accuracy over the tasks learned, per-{mode} routing\nmean over seeds, band ±1 std"
    return [_finish(fig, plt, out, heading)]
