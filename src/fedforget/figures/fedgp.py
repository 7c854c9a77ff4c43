"""FedGP figures drawn from an experiment's runs.

- ``buffer_tasks`` (FedGP Fig. 4): the rows of each task in the clients' replay buffers
  (FedGP's diagnostic ``buffer_task<t>``: the mean over the round's clients) in one round
  (default each run's last), one bar per method (e.g. the buffer policies of Table 9), mean
  ± std over seeds, one panel per dataset x setting. Writes a .csv beside it."""

from __future__ import annotations

import re
from pathlib import Path

from ..plots import _plt, _save, setting_label
from ..utils import FedForgetError
from . import FIGURES, FigureInput


@FIGURES.register("buffer_tasks")
def buffer_tasks(inp: FigureInput, out: Path, prefix: str = "fedgp", round: int | None = None) -> list[Path]:
    pat = re.compile(rf"^{re.escape(prefix)}_buffer_task(\d+)$")
    cols = sorted((c for c in inp.metrics.columns if pat.match(c)), key=lambda c: int(pat.match(c).group(1)))
    if not cols:
        inp.require_columns("buffer_tasks", [f"{prefix}_buffer_task0"],
                            " (FedGP records its buffer's rows per task in task streams)")  # fmt: skip
    keys = ["dataset", "setting", "method", "seed"]
    m = inp.metrics[inp.metrics[cols].notna().any(axis=1)]
    if round is None:
        m = m[m["round"] == m.groupby(keys)["round"].transform("max")]
    else:
        m = m[m["round"] == int(round)]
    if m.empty:
        raise FedForgetError(f"figure 'buffer_tasks': no run has {prefix}_buffer_task* in round {round}")
    long = m.melt(id_vars=keys, value_vars=cols, var_name="task", value_name="rows")
    long["task"] = long["task"].map(lambda c: int(pat.match(c).group(1)))
    table = long.groupby(["dataset", "setting", "method", "task"], sort=False)["rows"].agg(["mean", "std", "count"]).reset_index()
    out = Path(out)
    table.to_csv(out.with_suffix(".csv"), index=False)
    plt = _plt()
    panels = list(dict.fromkeys(zip(table["dataset"], table["setting"])))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.6), squeeze=False)
    for ax, (ds, st) in zip(axes[0], panels):
        sub = table[(table["dataset"] == ds) & (table["setting"] == st)]
        methods = list(dict.fromkeys(sub["method"]))
        width = 0.8 / len(methods)
        for i, meth in enumerate(methods):
            s = sub[sub["method"] == meth]
            ax.bar(s["task"] + (i - (len(methods) - 1) / 2) * width, s["mean"], width, yerr=s["std"].fillna(0),
                   capsize=2, label=meth)  # fmt: skip
        tasks = sorted(set(sub["task"]))
        ax.set_xticks(tasks)
        ax.set_xticklabels([str(t + 1) for t in tasks])
        ax.set_xlabel("task")
        ax.set_ylabel("buffer rows of the task\n(mean over clients)")
        ax.set_title(f"{ds}, {setting_label(st)}", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    which = "the last round" if round is None else f"round {round}"
    fig.suptitle(f"Rows per task in the replay buffers, {which} (FedGP Fig. 4), mean ± std over seeds", fontsize=10)
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
    return [out, out.with_suffix(".csv")]



