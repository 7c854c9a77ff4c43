"""Figures: learning curves with seed bands (seaborn) and partition heatmaps."""

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
    if axes.flat[0].get_legend() is not None:
        axes.flat[0].get_legend().set_title("Method")
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


def plot_experiment(summary_dir: str | Path, out_dir: str | Path) -> list[Path]:
    path = Path(summary_dir) / "metrics.parquet"
    if not path.is_file():
        raise FedForgetError(f"summary {path} not found; run `fedforget aggregate` first")
    metrics = pd.read_parquet(path)
    out = Path(out_dir)
    return [learning_curves(metrics, col, out / f"{col}.png") for col in CURVES]
