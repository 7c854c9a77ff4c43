"""FedSOL figures (paper Figs. 2, 4a, 5, 6, 7), drawn from an experiment's runs.

- ``fedsol_vs_rho`` (Fig. 2, Fig. 4a): a per-run statistic of metrics columns (mean over
  rounds, or the final round) against FedSOL's rho, one line per variant (``group``: the
  FedSOL parameters that tell variants apart, e.g. perturb, or adaptive + lambda_norm), mean
  ± std over seeds; other methods (FedAvg) are dashed reference lines. Writes a .csv beside it.
- ``fedsol_divergence`` (Fig. 5): ||w_g - w_k|| and mean pairwise ||w_i - w_j|| of the sampled
  clients' local models per round (engine diagnostic ``weight_divergence``).
- ``fedsol_knowledge`` (Fig. 6a): global-model test accuracy and the local models' accuracy on
  the global test set right after local training, per round.
- ``fedsol_classwise`` (Fig. 6b): class-wise test accuracy of the global model per round, one
  heatmap (class x round, mean over seeds) per method and setting (engine diagnostic
  ``classwise_accuracy``), plus a .csv of the final-round class accuracies.
- ``layer_lambda`` (Fig. 4b): FedSOL's Eq. 7 lambda of the local models per layer (engine
  diagnostic ``layer_lambda``: the mean over a parameter tensor's elements and the round's
  clients) in one round (default each run's last), one bar per parameter tensor in the
  model's order (a run's saved model.pt), one group per method, mean ± std over seeds, one panel per dataset x
  setting. Writes a .csv beside it.
- ``fedsol_landscape`` (Fig. 7): each method's final global model (model.pt): the training
  loss over the plane of its Hessian's top-2 eigenvectors, titled with lambda_1 and
  lambda_1 / lambda_5 (``fedforget.landscape``), plus a .csv of the top eigenvalues and one
  of the loss grids.
The per-round figures have one row of panels per dataset x setting, one line per method and
a ±1 std band over seeds.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..data import load_dataset, load_public
from ..inputs import InputPipeline
from ..landscape import loss_grid, top_eigen
from ..models import build_model
from ..plots import (
    Y_MARGIN,
    _plt,
    _save,
    _wrap,
    axis_label,
    is_accuracy,
    mean_sd_lines,
    method_colors,
    setting_label,
)
from ..utils import FedForgetError, torch_seed
from . import FIGURES, FigureInput, method_bars, round_means, run_config

STATS = ("mean", "final")


def _method_params(run_dir: str) -> tuple[str, dict]:
    method = run_config(run_dir).method
    return method.name, method.params


NEEDS = (" (FedSOL diagnostics need method fedsol; weight divergence / class-wise accuracy / layer lambda need "
         "train.diagnostics: [weight_divergence, classwise_accuracy, layer_lambda])")  # fmt: skip


def _need(inp: FigureInput, figure: str, columns: list[str]) -> None:
    inp.require_columns(figure, columns, NEEDS)


def _parameter_order(inp: FigureInput, names: list[str]) -> list[str]:
    """``names`` in the model's order: that of the state dict a run saved (model.pt, the
    model's registration order), else a natural sort (numbers as numbers, a module's weight
    before its bias)."""
    for run_dir in inp.runs.loc[inp.runs["status"] == "completed", "run_dir"]:
        saved = Path(run_dir) / "model.pt"
        if saved.is_file():
            keys = list(torch.load(saved, map_location="cpu", weights_only=True, mmap=True))  # its keys: the file mapped, not read
            return [k for k in keys if k in names] + sorted(set(names) - set(keys))

    def natural(name: str) -> list:
        *path, leaf = name.split(".")
        return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path] + [(2, leaf != "weight", leaf)]

    return sorted(names, key=natural)


@FIGURES.register("layer_lambda")
def layer_lambda(inp: FigureInput, out: Path, round: int | None = None) -> list[Path]:
    names = [c[len("layer_lambda:"):] for c in inp.metrics.columns if c.startswith("layer_lambda:")]
    if not names:
        _need(inp, "layer_lambda", ["layer_lambda:<parameter>"])
    cols = {f"layer_lambda:{n}": n for n in _parameter_order(inp, names)}
    table = round_means(inp, "layer_lambda", cols, "parameter", round)
    which = "the last round" if round is None else f"round {round}"
    return method_bars(table, "parameter", out, ylabel="mean λ of the layer\n(over local models)", stacked=True,
                       title=f"Layer-wise λ (Eq. 7) of the local models, {which} (FedSOL Fig. 4b), mean ± std over seeds")  # fmt: skip


@FIGURES.register("fedsol_vs_rho")
def fedsol_vs_rho(
    inp: FigureInput,
    out: Path,
    columns: list[str] | None = None,
    group: list[str] | str = "perturb",
    stat: str = "mean",
) -> list[Path]:
    columns = list(columns or ["fedsol_prox_loss", "fedsol_cos_update_prox"])
    group = [group] if isinstance(group, str) else list(group)
    if stat not in STATS:
        raise FedForgetError(f"figure 'fedsol_vs_rho': stat={stat!r}; allowed: {', '.join(STATS)}")
    _need(inp, "fedsol_vs_rho", columns)
    runs = inp.runs[inp.runs["status"] == "completed"]
    keys = ["dataset", "setting", "method", "seed"]
    per_run = inp.per_run(columns, stat)
    rows = []
    for _, r in runs.iterrows():
        name, params = _method_params(r["run_dir"])
        if name == "fedsol":
            variant = ", ".join(f"{g}={params.get(g)}" for g in group)
            rho = float(params.get("rho", 0.0))
        else:  # another method: drawn as a reference line
            variant, rho = name, float("nan")
        rows.append({**{k: r[k] for k in keys}, "variant": variant, "rho": rho})
    if not rows:
        raise FedForgetError("figure 'fedsol_vs_rho': no completed run to draw")
    df = pd.DataFrame(rows).merge(per_run, on=keys)
    if df.empty:
        raise FedForgetError("figure 'fedsol_vs_rho': no completed run to draw")
    table = df.groupby(["dataset", "setting", "variant", "rho"], dropna=False)[columns].agg(["mean", "std", "count"])
    table.columns = [f"{c}_{s}" for c, s in table.columns]
    out = Path(out)
    table.reset_index().to_csv(out.with_suffix(".csv"), index=False)
    plt = _plt()
    panels = list(dict.fromkeys(zip(df["dataset"], df["setting"])))
    over = f"{stat} over rounds" if stat == "mean" else "final round"  # the y labels' statistic
    fig, axes = plt.subplots(len(panels), len(columns), figsize=(4.8 * len(columns), 3.4 * len(panels)), squeeze=False)
    for i, (ds, st) in enumerate(panels):
        sub = df[(df["dataset"] == ds) & (df["setting"] == st)]
        for j, col in enumerate(columns):
            ax = axes[i, j]
            k = 100 if is_accuracy(col) else 1  # accuracies drawn in % (the .csv: fractions)
            for variant, v in sub.groupby("variant"):
                if v["rho"].isna().all():  # a non-FedSOL method: reference line, where it has the column
                    if v[col].notna().any():
                        ax.axhline(k * v[col].mean(), ls="--", color="grey", label=variant)
                    continue
                s = v.groupby("rho")[col].agg(["mean", "std"]).reset_index()
                ax.errorbar(s["rho"], k * s["mean"], yerr=k * s["std"].fillna(0), marker="o", capsize=3, label=variant)
            ax.set_xlabel("rho")
            ax.set_ylabel(f"{axis_label(col)}\n({over})")
            ax.set_title(f"{ds}, {setting_label(st)}" if ds else "", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("FedSOL vs rho (mean ± std over seeds)")
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
    return [out, out.with_suffix(".csv")]


def _round_grid(inp: FigureInput, out: Path, columns: list[str], labels: list[str], title: str) -> list[Path]:
    df = inp.metrics[inp.metrics["round"] >= 1]
    colors = method_colors(df["method"])
    panels = list(dict.fromkeys(zip(df["dataset"], df["setting"])))
    plt = _plt()
    fig, axes = plt.subplots(len(panels), len(columns), figsize=(4.8 * len(columns), 3.4 * len(panels)), squeeze=False)
    for i, (ds, st) in enumerate(panels):
        sub = df[(df["dataset"] == ds) & (df["setting"] == st)]
        for j, (col, lab) in enumerate(zip(columns, labels)):
            ax = axes[i, j]
            mean_sd_lines(ax, sub.dropna(subset=[col]), "round", col, colors, legend=i == 0 and j == 0)
            panel = f"{ds}, {setting_label(st)}: {lab}" if ds else lab
            ax.set_title(_wrap(panel, 4.8 - Y_MARGIN, 9), fontsize=9)  # wider, it met the next panel's y label
            ax.set_ylabel(axis_label(col))
            ax.grid(alpha=0.3)
    fig.suptitle(f"{title} (band: ±1 std over seeds)")
    fig.tight_layout()
    out = Path(out)
    _save(fig, out)
    plt.close(fig)
    return [out]


@FIGURES.register("fedsol_divergence")
def fedsol_divergence(inp: FigureInput, out: Path) -> list[Path]:
    cols = ["local_models_dist_to_global_mean", "local_models_pairwise_dist_mean"]
    _need(inp, "fedsol_divergence", cols)
    return _round_grid(inp, out, cols, ["||w_g - w_k|| (mean over sampled clients)", "mean pairwise ||w_i - w_j||"],
                       "Weight divergence of local models (FedSOL Fig. 5)")  # fmt: skip


@FIGURES.register("fedsol_knowledge")
def fedsol_knowledge(inp: FigureInput, out: Path) -> list[Path]:
    cols = ["global_model_test_acc", "local_models_global_test_acc_mean"]
    _need(inp, "fedsol_knowledge", cols)
    return _round_grid(inp, out, cols, ["global model", "local models after local training"],
                       "Accuracy on the global test set (FedSOL Fig. 6a)")  # fmt: skip


@FIGURES.register("fedsol_classwise")
def fedsol_classwise(inp: FigureInput, out: Path, methods: list[str] | None = None) -> list[Path]:
    pat = re.compile(r"^global_model_test_acc_class(\d+)$")
    cls_cols = sorted((c for c in inp.metrics.columns if pat.match(c)), key=lambda c: int(pat.match(c).group(1)))
    if not cls_cols:
        _need(inp, "fedsol_classwise", ["global_model_test_acc_class0"])
    df = inp.metrics[inp.metrics["round"] >= 1]
    if methods:
        df = df[df["method"].isin(methods)]
    ms = list(dict.fromkeys(df["method"]))
    panels = list(dict.fromkeys(zip(df["dataset"], df["setting"])))
    if not ms:
        raise FedForgetError(f"figure 'fedsol_classwise': no run of methods {methods}")
    plt = _plt()
    fig, axes = plt.subplots(len(ms), len(panels), figsize=(4.4 * len(panels), 3.0 * len(ms)), squeeze=False,
                             constrained_layout=True)  # fmt: skip
    finals = []
    for j, (ds, st) in enumerate(panels):
        for i, meth in enumerate(ms):
            ax = axes[i, j]
            sub = df[(df["dataset"] == ds) & (df["setting"] == st) & (df["method"] == meth)]
            mean = sub.groupby("round")[cls_cols].mean()  # over seeds
            if mean.empty:
                ax.set_visible(False)
                continue
            im = ax.imshow(100 * mean.to_numpy().T, aspect="auto", vmin=0, vmax=100, cmap="viridis",
                           extent=(mean.index.min() - 0.5, mean.index.max() + 0.5, len(cls_cols) - 0.5, -0.5))  # fmt: skip
            last = 100 * mean.iloc[-1].to_numpy()
            # how much the class accuracies jump between rounds (the paper's "fluctuations")
            jumps = 100 * np.abs(np.diff(mean.to_numpy(), axis=0)).mean() if len(mean) > 1 else float("nan")
            finals.append({"dataset": ds, "setting": st, "method": meth,
                           **{f"class{k}": v for k, v in enumerate(last)},
                           "final_class_std": float(np.std(last)), "mean_abs_round_change": float(jumps)})  # fmt: skip
            ax.set_title(f"{meth} | {ds} {st}\nfinal class acc std {np.std(last):.1f}, mean |change| {jumps:.1f}", fontsize=8)
            ax.set_ylabel("class")
            ax.set_xlabel("round")
    fig.colorbar(im, ax=axes, shrink=0.6, label="global test accuracy of the class (%)")
    fig.suptitle("Class-wise accuracy of the global model (FedSOL Fig. 6b), mean over seeds")
    out = Path(out)
    _save(fig, out)
    plt.close(fig)
    pd.DataFrame(finals).to_csv(out.with_suffix(".csv"), index=False)
    return [out, out.with_suffix(".csv")]


def _landscape_rows(rc, rows: int, seed: int):
    """(x, y, input shape, classes): ``rows`` rows of the run's training pool (the rows a
    public holdout takes left out) drawn without replacement by a keyed generator, as the
    model sees them before augmentation."""
    data = load_dataset(rc.dataset.id, rc.data_dir)
    public = load_public(rc.dataset.public, rc.dataset.id, rc.data_dir, False)
    pool = np.arange(len(data.y_train))
    if public is not None and public.excluded_train_rows is not None:
        pool = np.setdiff1d(pool, np.asarray(public.excluded_train_rows))
    gen = torch.Generator().manual_seed(torch_seed(seed, LANDSCAPE_ROWS))
    take = np.sort(pool[torch.randperm(len(pool), generator=gen)[: min(rows, len(pool))].numpy()])
    x = InputPipeline.of(data.meta, None, rc.seed).convert(torch.as_tensor(np.asarray(data.x_train[take])))
    y = torch.as_tensor(np.asarray(data.y_train[take]), dtype=torch.long)
    return x, y, data.input_shape, data.num_classes


LANDSCAPE_ROWS = 0xE2  # keyed randomness of the rows fedsol_landscape evaluates


@FIGURES.register("fedsol_landscape")
def fedsol_landscape(
    inp: FigureInput, out: Path, methods: list[str] | None = None, seed: int = 0, setting: str | None = None,
    rows: int = 500, top: int = 5, iters: int = 100, tol: float = 1e-3, radius: float = 1.0, points: int = 21,
    batch: int = 500, device: str = "auto",
) -> list[Path]:
    """FedSOL Fig. 7 [P: fedsol.md Sec. 5, "Smoothness of Loss Landscape"]: per method, the
    final global model's training loss L(w + a v_1 + b v_2) over the top-2 Hessian
    eigenvectors, and lambda_1, lambda_1 / lambda_5 (``fedforget.landscape``) of the run of
    ``seed`` (one dataset and ``setting``, default the first). [D] The loss is the mean
    cross-entropy over ``rows`` rows of the training pool (keyed draw), unaugmented, the
    model in eval mode; the figure does not say which data or range the paper used (500
    rows: PyHessian's examples take the Hessian on one batch of a few hundred). The cost is
    up to top x iters Hessian-vector products over the rows per method (each about three
    backward passes): ``device`` auto computes on the GPU where there is one."""
    if top < 2:
        raise FedForgetError(f"figure 'fedsol_landscape': top={top}; allowed: an integer >= 2 (two directions)")
    runs, order = inp.runs_of_one_setting("fedsol_landscape", seed, setting, methods)
    first = runs.iloc[0]
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device)
    data = None  # the rows: one dataset (runs_of_one_setting), the same for every method
    results, grids = [], []
    for method in order:
        run_dir = Path(runs[runs["method"] == method].iloc[0]["run_dir"])
        rc = run_config(run_dir)
        if rc.dataset.scenario:
            raise FedForgetError(f"figure 'fedsol_landscape': run {run_dir} is a task stream; the figure is of one-task runs")
        if data is None:
            data = _landscape_rows(rc, rows, seed)
        x, y, shape, classes = data
        model = build_model(rc.dataset.model, shape, classes, rc.dataset.model_options)
        model.load_state_dict(torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True))
        model, x, y = model.to(dev).eval(), x.to(dev), y.to(dev)
        values, vectors = top_eigen(model, x, y, top=top, iters=iters, tol=tol, seed=seed, batch=batch)
        coords, grid = loss_grid(model, x, y, vectors, radius=radius, points=points, batch=batch)
        results.append({"method": method, "seed": seed, "rows": len(y),
                        **{f"lambda_{k + 1}": v for k, v in enumerate(values)},
                        "lambda_1_over_lambda_top": values[0] / values[-1]})  # fmt: skip
        grids.append((method, coords.numpy(), grid.cpu().numpy(), values))
    plt = _plt()
    fig, axes = plt.subplots(1, len(grids), figsize=(4.0 * len(grids), 3.6), squeeze=False, constrained_layout=True)
    lo = min(g.min() for _, _, g, _ in grids)
    hi = max(g.max() for _, _, g, _ in grids)
    levels = np.linspace(lo, hi, 21) if hi > lo else 21
    for ax, (method, c, g, values) in zip(axes[0], grids):
        cs = ax.contourf(c, c, g.T, levels=levels, cmap="viridis")  # rows of g: a (x axis)
        ax.contour(c, c, g.T, levels=levels, colors="k", linewidths=0.3)
        ax.set_title(f"{method}\nλ1 = {values[0]:.2f}, λ1/λ{top} = {values[0] / values[-1]:.2f}", fontsize=9)
        ax.set_xlabel("top-1 eigenvector")
        ax.set_ylabel("top-2 eigenvector")
    fig.colorbar(cs, ax=axes, shrink=0.8, label="training loss")
    fig.suptitle(f"Loss landscape of the global model (FedSOL Fig. 7): {first['dataset']}, "
                 f"{setting_label(first['setting'])}, seed {seed}", fontsize=10)  # fmt: skip
    out = Path(out)
    _save(fig, out)
    plt.close(fig)
    pd.DataFrame(results).to_csv(out.with_suffix(".csv"), index=False)
    surface = out.with_name(out.stem + "_grid.csv")
    pd.DataFrame([{"method": m, "a": float(a), "b": float(b), "loss": float(g[i, j])}
                  for m, c, g, _ in grids for i, a in enumerate(c) for j, b in enumerate(c)]).to_csv(surface, index=False)  # fmt: skip
    return [out, out.with_suffix(".csv"), surface]
