"""The Snakemake report (`snakemake --report report.html`) shows every figure and the table:
each learning curve, each experiment figure, each partition heatmap and the summary table is
its own entry with its own labels, nothing collapses into another entry or hides behind a
toggle, and the table is an HTML page the report displays (not only a CSV download).

One tiny pipeline run through the real Snakemake (iris, one partition, two methods, one
seed, two rounds, two experiment figures), then the report, parsed: Snakemake 9 writes one
HTML file whose ``<script id="results">`` holds ``var results = {path: {labels, mime_type,
data_uri (base64), ...}}`` and ``<script id="categories">`` holds ``var categories =
{category: {subcategory: [path, ...]}}``. Marked e2e."""

from __future__ import annotations

import base64
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from fedforget.plots import CONTINUAL_DIR, CONTINUAL_FIGURES, CURVES

# the real command as the workflow tests run it (skipped with them where snakemake is missing)
from .conftest import shared_once
from .test_workflow import snakemake, write_config

pytestmark = pytest.mark.e2e

EXPERIMENT_FIGURES = ["test_loss", "worst_local_acc"]

CONFIG = {
    "experiments": [
        {
            "name": "tiny",
            "datasets": [{"name": "iris", "model": "mlp"}],
            "partitions": [{"scheme": "iid", "clients": 3}],
            "methods": [{"name": "fedavg"}, {"name": "fedavg", "label": "fedavg-lr0.1", "train": {"optimizer": {"lr": 0.1}}}],
            "seeds": [0],
            "train": {"rounds": 2, "local_epochs": 1, "batch_size": 16, "threads": 1},
            # a paper link: the table's paper column (and aggregate's --paper-results argument)
            "paper": {"name": "p", "table": "t1"},
            "figures": [
                {"name": "curves", "label": "test_loss", "options": {"column": "global_model_test_loss"}},
                {"name": "curves", "label": "worst_local_acc", "options": {"column": "local_models_global_test_acc_min"}},
            ],
        },
        {  # a continual experiment: rules aggregate_continual and plot_continual, their entries
            "name": "tiny_cl",
            "datasets": [{"name": "iris", "model": "mlp",
                          "scenario": {"kind": "split", "tasks": 3, "classes_per_task": 1, "rounds_per_task": 1}}],
            "partitions": [{"scheme": "iid", "clients": 3}],
            "methods": [{"name": "fedavg"}],
            "seeds": [0],
            "train": {"rounds": 3, "local_epochs": 1, "batch_size": 16, "threads": 1},
        },
    ],
    "paper_results": "paper_results.csv",
}  # fmt: skip
PAPER = (
    "paper,table,dataset,setting,method,metric,value,std\np,t1,iris,iid,fedavg,accuracy,93.33,1.5\n"
)


def _script_var(html: str, script_id: str, name: str) -> dict:
    m = re.search(rf'<script id="{script_id}">\s*var {name} = (.*?);\s*</script>', html, re.S)
    assert m, f'no <script id="{script_id}"> with var {name} in the report'
    return json.loads(m.group(1))


def parse_report(path: Path) -> tuple[dict, dict]:
    """(results, categories) of a Snakemake 9 HTML report."""
    html = path.read_text(encoding="utf-8")
    return _script_var(html, "results", "results"), _script_var(html, "categories", "categories")


def visible_rows(results: dict, paths: list[str]) -> tuple[int, set[str]]:
    """What the report's results list (components/abstract_results.js, getData) shows for
    one category/subcategory: (rows, toggle labels). Entries are keyed by their label values
    (equal labels: one row, the last file wins); a label other than the first with exactly
    two values, each in half of the entries, becomes a toggle instead of a column."""
    entries = [results[p] for p in paths]
    if not all(e["labels"] for e in entries):
        return len(set(paths)), set()
    first: dict[str, int] = {}
    for e in entries:
        for i, k in enumerate(e["labels"]):
            first.setdefault(k, i)
    labels = sorted(first, key=first.get)
    toggles = set()
    for label in labels[1:]:
        values = [e["labels"][label] for e in entries if label in e["labels"]]
        counts = Counter(values)
        if len(counts) == 2 and all(c == len(entries) / 2 for c in counts.values()):
            toggles.add(label)
    if len(toggles) > 1:
        toggles = set()
    rows = {tuple(e["labels"].get(k, "") for k in labels if k not in toggles) for e in entries}
    return len(rows), toggles


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[Path, dict, dict]:
    def build(work: Path) -> None:
        write_config(work, CONFIG)
        (work / "paper_results.csv").write_text(PAPER)
        snakemake(work)
        snakemake(work, "--report", "report.html")

    work = shared_once(tmp_path_factory, "report", build)  # one pipeline for all workers
    results, categories = parse_report(work / "report.html")
    return work, results, categories


def _category_of(categories: dict, path: str) -> tuple[str, str]:
    hits = [(c, s) for c, subs in categories.items() for s, paths in subs.items() if path in paths]
    assert len(hits) == 1, f"{path} is in {len(hits)} report lists"
    return hits[0]


def test_every_figure_and_table_is_its_own_entry(report) -> None:
    _, results, categories = report
    base = "results/tiny"
    curves = {f"{base}/figures/{c}.png": name for c, name in CURVES.items()}
    figures = {f"{base}/figures/{f}.png": f for f in EXPERIMENT_FIGURES}
    heatmaps = [p for p in results if p.endswith("/heatmap.png")]
    tables = [f"{base}/summary/table.html", f"{base}/summary/table.csv"]
    assert len(heatmaps) == 1
    for path in [*curves, *figures, *heatmaps, *tables]:
        assert path in results, f"{path} is not in the report; it has {sorted(results)}"

    for path, name in curves.items():
        assert results[path]["labels"] == {"figure": name, "experiment": "tiny"}
        assert _category_of(categories, path)[0] == "Learning curves"
        assert results[path]["mime_type"] == "image/png"
    for path, label in figures.items():
        assert results[path]["labels"] == {"figure": label, "experiment": "tiny"}
        assert _category_of(categories, path)[0] == "Figures"
    assert _category_of(categories, heatmaps[0])[0] == "Partitions"
    for path in tables:
        assert _category_of(categories, path)[0] == "Tables"
        assert results[path]["labels"]["experiment"] == "tiny" and results[path]["labels"]["table"]

    # each list shows one row per file: no two files share labels, none hides behind a toggle
    for cat, subs in categories.items():
        for sub, paths in subs.items():
            rows, toggles = visible_rows(results, paths)
            assert (rows, toggles) == (len(paths), set()), (
                f"report list {cat}/{sub}: {len(paths)} files shown as {rows} rows, toggles "
                f"{toggles}: "
                + json.dumps({p: results[p]["labels"] for p in paths}, ensure_ascii=False)
            )


def test_table_renders_as_html_in_the_report(report) -> None:
    work, results, _ = report
    entry = results["results/tiny/summary/table.html"]
    # the report shows text/html inline (an iframe); text/csv is only a download
    assert entry["mime_type"] == "text/html"
    head, _, payload = entry["data_uri"].partition(",")
    assert head.startswith("data:text/html") and head.endswith(";base64")
    page = base64.b64decode(payload).decode("utf-8")
    assert page == (work / "results/tiny/summary/table.html").read_text(encoding="utf-8")
    assert "<table" in page and "<th>Final round (%)</th>" in page
    assert "<script" not in page and "<style>" in page
    # one seed per cell: n = 1 and no ± 0.00
    for method in ("fedavg", "fedavg-lr0.1"):
        assert f"<td>{method}</td>" in page
    assert page.count("(n = 1)") == 4 and "± 0.00" not in page
    assert "<th>Paper (%)</th>" in page and "<td>93.33 ± 1.50</td>" in page


def test_continual_experiment_has_its_figures_and_table(report) -> None:
    """Only the continual experiment gets the continual table and figures, each its own
    entry with its own labels (the list check above covers their lists too)."""
    work, results, categories = report
    base = "results/tiny_cl"
    for fig, name in CONTINUAL_FIGURES.items():
        path = f"{base}/figures/{CONTINUAL_DIR}/{fig}.png"
        assert path in results, f"{path} is not in the report"
        assert results[path]["labels"] == {"figure": name, "experiment": "tiny_cl"}
        assert _category_of(categories, path) == ("Continual learning", "tiny_cl")
    for f in ("continual.html", "continual.csv"):
        assert _category_of(categories, f"{base}/summary/{f}") == ("Tables", "tiny_cl")
    assert results[f"{base}/summary/continual.html"]["mime_type"] == "text/html"
    assert "tiny" not in categories.get("Continual learning", {})
    assert not any("continual" in p for p in results if p.startswith("results/tiny/"))
    assert not (work / "results/tiny/summary/continual.csv").exists()
    assert not (work / "results/tiny/figures" / CONTINUAL_DIR).exists()
