"""Figures: learning curves with seed bands (seaborn) and partition heatmaps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .utils import atomic_write

CURVES = {
    "global_model_test_acc": "Global model, test accuracy",
    "local_models_global_test_acc_mean": "Local models after local training, test accuracy (mean over sampled clients)",
    "sampled_clients_local_train_loss_mean": "Local training loss (mean over sampled clients)",
}


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
    """One panel per dataset x setting, one line per method, band = ±1 std over seeds."""
    import seaborn as sns

    plt = _plt()
    path = Path(path)
    df = metrics.dropna(subset=[column]) if column in metrics else metrics.iloc[0:0]
    panels = list(dict.fromkeys(zip(df["dataset"], df["setting"]))) or [("", "")]
    ncol = min(3, len(panels))
    nrow = int(np.ceil(len(panels) / ncol))
    fig, axes = plt.subplots(
        nrow,
        ncol,
        figsize=(4.6 * ncol, 3.4 * nrow),
        squeeze=False,
        sharey=column.endswith("acc") or column.endswith("acc_mean"),
    )
    for ax, (ds, setting) in zip(axes.flat, panels):
        sub = df[(df["dataset"] == ds) & (df["setting"] == setting)]
        if len(sub):
            sns.lineplot(
                data=sub,
                x="round",
                y=column,
                hue="method",
                errorbar="sd",
                ax=ax,
                legend=ax is axes.flat[0],
            )
        ax.set_title(f"{ds} {setting}".strip())
        ax.set_ylabel(column if ax is axes.flat[0] else "")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title or CURVES.get(column, column) + " (band: ±1 std over seeds)")
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


def plot_experiment(summary_dir: str | Path, out_dir: str | Path) -> list[Path]:
    metrics = pd.read_parquet(Path(summary_dir) / "metrics.parquet")
    out = Path(out_dir)
    return [learning_curves(metrics, col, out / f"{col}.png") for col in CURVES]
