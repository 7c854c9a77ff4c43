"""FedProj figures: the pilot study's decision boundaries (papers/fedproj.md Figure 1) and
final accuracy against a method hyperparameter (Figure 3a's projection rate, Table 3b's
weight-divergence alpha).

``decision_boundaries``: one row per method, one column per chosen round. Each panel shows,
for one run (seed ``seed``), the *global* model after that round's aggregation as shaded
class regions, each sampled client's *local model after local training* as its decision
boundaries (the zero level of every class margin z_c - max_{j != c} z_j, one line style per
client), and the private training points (colour = class, marker = client). It reads the
snapshots that ``train.save_client_models`` writes (snapshots/round<r>.pt in each run dir,
listed in the summary's runs.csv). Two-dimensional inputs only (the Iris PCA-2D pilot).

``param_sweep``: final (or best) global accuracy, mean +- std over seeds, against a method
hyperparameter read from each run's run.json; ``one_minus`` plots 1 - value (projection
rate = 1 - proj_dropout). Writes the plotted table beside the figure (.csv).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..plots import _plt, _save
from ..utils import FedForgetError
from . import FIGURES, FigureInput, run_config

CLASS_COLOURS = ["#d62728", "#e6b800", "#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf", "#bcbd22"]  # fmt: skip
CLIENT_COLOURS = ["#000000", "#b5179e", "#2a9d8f", "#6c757d", "#f4a261"]
CLIENT_STYLES = [("solid", "o"), ("dashed", "s"), ("dotted", "^"), ("dashdot", "D"), ((0, (5, 1, 1, 1)), "v")]  # fmt: skip


def _snapshot(run_dir: Path, rnd: int) -> dict:
    for name in (f"round{rnd:04d}.pt", f"round{rnd}.pt"):
        path = run_dir / "snapshots" / name
        if path.exists():
            return torch.load(path, map_location="cpu", weights_only=True)
    raise FedForgetError(
        f"figure 'decision_boundaries': no snapshot of round {rnd} in {run_dir / 'snapshots'}; "
        f"list the round in train.save_client_models"
    )


def _run_context(run_dir: Path):
    """(RunConfig, train x, train y, client id per train row) of a finished run."""
    from ..data import load_dataset, load_public
    from ..partition import partition_dataset

    rc = run_config(run_dir)
    data = load_dataset(rc.dataset.id, rc.data_dir)
    if data.x_train.ndim != 2 or data.x_train.shape[1] != 2:
        raise FedForgetError(
            f"figure 'decision_boundaries' needs 2-D inputs; dataset '{rc.dataset.label}' has shape {list(data.x_train.shape[1:])}"
        )
    public = load_public(rc.dataset.public, rc.dataset.id, rc.data_dir, False)
    excluded = public.excluded_train_rows if public is not None else None
    owner = partition_dataset(data, rc.partition, excluded)  # deterministic: the run's partition
    return rc, np.asarray(data.x_train), np.asarray(data.y_train), owner


def _logits(rc, state: dict, grid: torch.Tensor, num_classes: int) -> np.ndarray:
    from ..models import build_model

    model = build_model(rc.dataset.model, (2,), num_classes, rc.dataset.model_options)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return model(grid).numpy()


def _margins(z: np.ndarray) -> np.ndarray:
    """[C, N]: z_c - max_{j != c} z_j (> 0 exactly where class c is predicted)."""
    out = np.empty((z.shape[1], z.shape[0]))
    for c in range(z.shape[1]):
        others = np.delete(z, c, axis=1)
        out[c] = z[:, c] - others.max(1)
    return out


@FIGURES.register("decision_boundaries")
def decision_boundaries(
    inp: FigureInput,
    out: Path,
    rounds: list[int] = (1, 5, 10, 20),
    seed: int = 0,
    methods: list[str] | None = None,
    setting: str | None = None,
    resolution: int = 150,
) -> list[Path]:
    runs, order = inp.runs_of_one_setting("decision_boundaries", seed, setting, methods)
    first = runs.iloc[0]
    rounds = [int(r) for r in rounds]
    rc, x, y, owner = _run_context(Path(runs[runs["method"] == order[0]].iloc[0]["run_dir"]))
    num_classes = int(y.max()) + 1
    pad = 0.15 * (x.max(0) - x.min(0))
    lo, hi = x.min(0) - pad, x.max(0) + pad
    gx, gy = np.meshgrid(np.linspace(lo[0], hi[0], resolution), np.linspace(lo[1], hi[1], resolution))
    grid = torch.tensor(np.c_[gx.ravel(), gy.ravel()], dtype=torch.float32)
    from ..data import load_dataset

    data = load_dataset(rc.dataset.id, rc.data_dir)
    x_test, y_test = torch.as_tensor(data.x_test, dtype=torch.float32), np.asarray(data.y_test)

    plt = _plt()
    from matplotlib.colors import ListedColormap
    from matplotlib.lines import Line2D

    cmap = ListedColormap(CLASS_COLOURS[:num_classes])
    fig, axes = plt.subplots(len(order), len(rounds), figsize=(3.3 * len(rounds), 3.1 * len(order)), squeeze=False)
    clients_seen: set[int] = set()
    for i, method in enumerate(order):
        run_dir = Path(runs[runs["method"] == method].iloc[0]["run_dir"])
        mrc = run_config(run_dir)
        for j, rnd in enumerate(rounds):
            ax = axes[i, j]
            snap = _snapshot(run_dir, rnd)
            zg = _logits(mrc, snap["global_after"], grid, num_classes)
            ax.contourf(gx, gy, zg.argmax(1).reshape(gx.shape), levels=np.arange(num_classes + 1) - 0.5, cmap=cmap, alpha=0.18)
            for cid, state in sorted(snap["clients"].items()):
                ls, _ = CLIENT_STYLES[int(cid) % len(CLIENT_STYLES)]
                clients_seen.add(int(cid))
                m = _margins(_logits(mrc, state, grid, num_classes))
                for c in range(num_classes):
                    if m[c].min() < 0 < m[c].max():
                        ax.contour(gx, gy, m[c].reshape(gx.shape), levels=[0.0], colors=CLIENT_COLOURS[int(cid) % len(CLIENT_COLOURS)], linestyles=[ls], linewidths=1.1)
            for cid in np.unique(owner[owner >= 0]):
                rows = owner == cid
                _, mk = CLIENT_STYLES[int(cid) % len(CLIENT_STYLES)]
                ax.scatter(x[rows, 0], x[rows, 1], c=[CLASS_COLOURS[k] for k in y[rows]], marker=mk, s=14, edgecolors="k", linewidths=0.3)
            acc = (_logits(mrc, snap["global_after"], x_test, num_classes).argmax(1) == y_test).mean()
            ax.set_title(f"{method}, round {rnd}: global {100 * acc:.1f}%", fontsize=9)
            ax.set_xlim(lo[0], hi[0]), ax.set_ylim(lo[1], hi[1])
            ax.set_xticks([]), ax.set_yticks([])
    handles = [Line2D([], [], color=CLIENT_COLOURS[c % len(CLIENT_COLOURS)], markerfacecolor="w", linestyle=CLIENT_STYLES[c % len(CLIENT_STYLES)][0], marker=CLIENT_STYLES[c % len(CLIENT_STYLES)][1], label=f"client {c + 1}") for c in sorted(clients_seen)]
    handles += [Line2D([], [], color=CLASS_COLOURS[k], marker="o", linestyle="", label=f"class {k}") for k in range(num_classes)]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(
        f"{first['dataset']} {first['setting']}, seed {seed}: shading = global model after aggregation; "
        "lines = each client's local-model decision boundaries after local training; points = private training data",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    out = Path(out)
    _save(fig, out)
    plt.close(fig)
    return [out]


@FIGURES.register("param_sweep")
def param_sweep(
    inp: FigureInput,
    out: Path,
    param: str = "proj_dropout",
    one_minus: bool = False,
    xlabel: str | None = None,
    metric: str = "final",
    methods: list[str] | None = None,
) -> list[Path]:
    if metric not in ("final", "best"):
        raise FedForgetError(f"figure 'param_sweep': metric={metric!r}; allowed: final | best")
    runs = inp.runs[inp.runs["status"] == "completed"]
    if methods:
        runs = runs[runs["method"].isin(methods)]
    rows = []
    for _, r in runs.iterrows():
        params = run_config(r["run_dir"]).method.params
        if param not in params:
            continue
        v = float(params[param])
        rows.append({"dataset": r["dataset"], "setting": r["setting"], "method": r["method"], "seed": r["seed"],
                     "x": 1.0 - v if one_minus else v, "acc": 100 * r[f"{metric}_global_model_test_acc"]})  # fmt: skip
    if not rows:
        raise FedForgetError(f"figure 'param_sweep': no completed run has method parameter '{param}'")
    df = pd.DataFrame(rows)
    table = df.groupby(["dataset", "setting", "x"])["acc"].agg(["mean", "std", "count"]).reset_index()
    out = Path(out)
    table.to_csv(out.with_suffix(".csv"), index=False)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(4.8, 3.4))
    for (ds, st), sub in table.groupby(["dataset", "setting"]):
        ax.errorbar(sub["x"], sub["mean"], yerr=sub["std"].fillna(0), marker="o", capsize=3, label=f"{ds} {st}")
    ax.set_xlabel(xlabel or (f"1 - {param}" if one_minus else param))
    ax.set_ylabel(f"{metric}-round global test accuracy (%)")
    ax.set_title(f"mean ± std over seeds (n = {int(table['count'].max())})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
    return [out, out.with_suffix(".csv")]
