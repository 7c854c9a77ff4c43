"""No two texts of a figure overlap (issue 35, 3): the figures the workflow draws (rule plot:
``plot_experiment``'s learning curves and continual figures; rule figure: the experiment
figures a config lists) for the shapes of every shipped config (config/config.yaml and
config/experiments/**/*.yaml: their datasets, partitions, methods, tasks and rounds, their
dataset and method labels), drawn from synthetic summaries with random values.

Every text a reader reads is checked against every other: the heading, panel titles, axis
labels, tick labels (those inside the view), legend entries and titles, colour-bar labels,
annotations and notices, as the Agg renderer places them after ``fig.canvas.draw()``.

Drawing every figure of rule plot for every shipped experiment (573 figures) takes six
minutes, so the test draws, for each figure function, the experiments that bound the others
(``representatives``): of those whose grid has one column (the narrowest figure) and of
those whose panels have neighbours the one with the widest panel title, and over all the
one with the most methods, the widest method label, the most rounds, the most tasks and,
for the heatmaps, the fewest. Rows of panels repeat the geometry of the rows above, so a
synthetic summary keeps the first row and one panel of the second, the widest titles first;
the tallest learning-curve figure is drawn whole (the heading over the first row)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedforget import plots
from fedforget.continual import scenario_shape
from fedforget.figures import FIGURES, FigureInput
from fedforget.models import build_model
from fedforget.parse import load_config
from fedforget.plots import CURVES, RUN_KEYS, setting_label

from .conftest import REPO

SHIPPED = [REPO / "config" / "config.yaml", *sorted((REPO / "config" / "experiments").rglob("*.yaml"))]
TOLERANCE = 0.5  # pixels: boxes that share less than this in either direction only touch


# ----------------------------------------------------------------------------- the check
def drawn_texts(fig) -> list[tuple[str, object]]:
    """(kind, Text) of every visible, non-empty text a reader reads in ``fig``."""
    out, seen = [], set()

    def add(kind, text):
        if id(text) not in seen and text.get_visible() and text.get_text().strip():
            seen.add(id(text))
            out.append((kind, text))

    if fig._suptitle is not None:
        add("heading", fig._suptitle)
    for t in fig.texts:
        add("figure text", t)
    legends = list(fig.legends)
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        add("title", ax.title)
        add("x label", ax.xaxis.label)
        add("y label", ax.yaxis.label)
        for kind, axis in (("x tick", ax.xaxis), ("y tick", ax.yaxis)):
            lo, hi = sorted(axis.get_view_interval())
            eps = 1e-9 * max(1.0, hi - lo)
            for tick in axis.get_major_ticks():
                if lo - eps <= tick.get_loc() <= hi + eps:  # ticks outside the view are not drawn
                    add(kind, tick.label1)
                    add(kind, tick.label2)
        for t in ax.texts:
            add("text", t)
        if ax.get_legend() is not None:
            legends.append(ax.get_legend())
    for legend in legends:
        for t in legend.get_texts():
            add("legend entry", t)
        add("legend title", legend.get_title())
    return out


def overlaps(fig) -> list[str]:
    """Every pair of drawn texts whose boxes overlap, in words."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = drawn_texts(fig)
    boxes = np.array([t.get_window_extent(renderer).extents for _, t in texts]).reshape(-1, 4)
    found = []
    for i in range(len(texts) - 1):
        rest = boxes[i + 1 :]
        w = np.minimum(boxes[i, 2], rest[:, 2]) - np.maximum(boxes[i, 0], rest[:, 0])
        h = np.minimum(boxes[i, 3], rest[:, 3]) - np.maximum(boxes[i, 1], rest[:, 1])
        for j in np.nonzero((w > TOLERANCE) & (h > TOLERANCE))[0]:
            (k1, t1), (k2, t2) = texts[i], texts[i + 1 + j]
            found.append(f"{k1} {t1.get_text()!r} x {k2} {t2.get_text()!r}: {w[j]:.1f} x {h[j]:.1f} px")
    return found


@pytest.fixture
def checked(monkeypatch):
    """Figures are checked where they would be saved (nothing is written): {path: overlaps}."""
    found: dict[str, list[str]] = {}

    def save(fig, path):
        found[str(path)] = overlaps(fig)

    for module in ("fedforget.plots", "fedforget.figures", "fedforget.figures.fedsol", "fedforget.figures.fedproj",
                   "fedforget.figures.sweep", "fedforget.figures.cost", "fedforget.figures.fedprotip"):
        monkeypatch.setattr(f"{module}._save", save)
    return found


def test_the_check_finds_overlapping_texts():
    plt = plots._plt()
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.set_title("a title much wider than its panel, and wider still")
    ax.text(0.5, 1.02, "under the title", transform=ax.transAxes, ha="center")
    ax.set_xticks([0, 0.01], labels=["0", "1"])  # two tick labels in one place
    found = overlaps(fig)
    plt.close(fig)
    assert any("title" in f and "under the title" in f for f in found), found
    assert any(f.startswith("x tick '0' x x tick '1'") for f in found), found


# ----------------------------------------------------------------------------- the shapes
@dataclass
class Shape:
    """One shipped experiment: its runs, and what makes its figures' texts wide or many."""

    name: str
    runs: list
    pairs: list  # (dataset, setting) in order
    methods: list
    tasks: int  # of its continual runs (1: none)
    rounds: int
    figures: list

    @property
    def continual(self) -> bool:
        return self.tasks > 1

    def title_width(self, per_method: bool) -> float:
        """The widest line of its panel titles ("<dataset>, <partition>", and in the
        per-method figures "<method> (<n> seeds)" below)."""
        from fedforget.plots import PANEL_TITLE_SIZE, _text_width

        widest = max(_text_width(f"{d}, {setting_label(s)}", PANEL_TITLE_SIZE) for d, s in self.pairs)
        if per_method:
            seeds = len({r.seed for r in self.runs})
            widest = max(widest, *(_text_width(f"{m} ({seeds} seeds)", PANEL_TITLE_SIZE) for m in self.methods))
        return widest

    def method_width(self) -> float:
        from fedforget.plots import _text_width

        return max(_text_width(m, 8) for m in self.methods)


def shipped_shapes() -> list[Shape]:
    """The shape of every experiment of every shipped config."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)  # the paper results file is relative to the working directory
        shapes = []
        for path in SHIPPED:
            wf = load_config(path)
            runs = wf.runs()
            for exp in wf.experiments:
                rs = [r for r in runs if r.experiment == exp.name]
                cont = [scenario_shape(r.dataset.scenario, r.train.rounds) for r in rs]
                shapes.append(Shape(
                    name=exp.name, runs=rs,
                    pairs=list(dict.fromkeys((r.dataset.label, r.partition.setting) for r in rs)),
                    methods=list(dict.fromkeys(r.method.label for r in rs)),
                    tasks=max((c[0] for c in cont if c), default=1),
                    rounds=max(c[0] * c[1] if c else r.train.rounds for r, c in zip(rs, cont)),
                    figures=list(exp.figures),
                ))  # fmt: skip
    return shapes


@pytest.fixture(scope="module")
def shipped() -> list[Shape]:
    shapes = shipped_shapes()
    assert len(shapes) > 50 and any(s.continual for s in shapes)
    return shapes


# figure function -> (its panels hold one method each, most columns of its grid, what else
# widens or multiplies its texts: "methods" legend entries, "rounds" x tick labels, "tasks"
# the heatmaps' size, Acc_t's x ticks and the task legend, "few tasks" the narrowest heatmaps)
KINDS = {
    "curves": (False, 3, ("methods", "rounds")),
    "acc_after_task": (False, 3, ("methods", "tasks")),
    # the other after-task figures share its layout: the two with its longest texts
    # (current_task_acc's heading and y label are shorter than these)
    "acc_after_task_aware": (False, 3, ("methods", "tasks")),
    "fgt_after_task": (False, 3, ("methods", "tasks")),
    "fgt_after_task_aware": (False, 3, ("methods", "tasks")),
    "accuracy_matrix": (True, 4, ("tasks", "few tasks")),
    "task_accuracy": (True, 4, ("rounds", "tasks")),
}


def representatives(shapes: list[Shape], kind: str) -> list[Shape]:
    """The shipped experiments that bound the others' texts for one figure function (the
    module's docstring)."""
    per_method, most, extremes = KINDS[kind]
    pool = [s for s in shapes if kind == "curves" or s.continual]

    def ncol(s):
        return min(most, len(s.methods) if per_method else len(s.pairs))

    def size(s):
        return len(s.pairs) * (len(s.methods) if per_method else 1)

    def title(s):
        return s.title_width(per_method)

    picks = {}
    for several in (False, True):  # one column (the narrowest figure), or neighbours
        group = [s for s in pool if (ncol(s) > 1) == several]
        if group:
            best = max(group, key=lambda s: (title(s), -size(s)))
            picks[best.name] = best
    keys = {
        "methods": [lambda s: (len(s.methods), s.method_width()), lambda s: (s.method_width(), len(s.methods))],
        "rounds": [lambda s: (len(str(s.rounds)), title(s))],
        "tasks": [lambda s: (s.tasks, title(s))],
        "few tasks": [lambda s: (-s.tasks, title(s))],
    }
    for key in (k for e in extremes for k in keys[e]):
        best = max(pool, key=key)
        picks[best.name] = best
    return list(picks.values())


def tallest(shapes: list[Shape]) -> Shape:
    """The experiment with the most rows of learning-curve panels: drawn whole, its heading
    must keep clear of the first row however tall the figure (with tight_layout, 6 rows of
    embedded_skew_sweep put the heading 205 x 11 px into the first titles)."""
    return max(shapes, key=lambda s: (len(s.pairs), s.title_width(False)))


# ----------------------------------------------------------------------------- synthetic summaries
def summaries(
    shape: Shape, kind: str, rng, whole: bool = False
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(runs, metrics, tasks, matrices) as ``aggregate`` writes them, random values, for the
    shape's runs of the figure's first row of panels and one panel of the second (the widest
    titles first; the rows below repeat their geometry), or of all its panels (``whole``),
    with every method where the methods are legend entries."""
    from fedforget.plots import PANEL_TITLE_SIZE, _text_width

    per_method, most, _ = KINDS[kind]

    def widest_first(labels, text):
        return sorted(labels, key=lambda x: -_text_width(text(x), PANEL_TITLE_SIZE))

    pairs = widest_first(shape.pairs, lambda p: f"{p[0]}, {setting_label(p[1])}")
    if per_method:
        methods = widest_first(shape.methods, str)
        panels = [(p, m) for p in pairs for m in methods]
        keep = set(panels if whole else panels[: min(most, len(methods)) + 1])
    else:
        keep = {(p, m) for p in (pairs if whole else pairs[: min(most, len(pairs)) + 1]) for m in shape.methods}
    runs, metrics, tasks, matrices = [], [], [], []
    for rc in shape.runs:
        key = dict(zip(RUN_KEYS, (rc.dataset.label, rc.partition.setting, rc.partition.clients,
                                  rc.partition.seed, rc.method.label, rc.seed)))  # fmt: skip
        if ((key["dataset"], key["setting"]), key["method"]) not in keep:
            continue
        sc = scenario_shape(rc.dataset.scenario, rc.train.rounds)
        t, r = sc or (1, rc.train.rounds)
        rounds = t * r if sc else rc.train.rounds
        runs.append({**key, "status": "completed", "tasks": t, "rounds_per_task": r})
        for rnd in sorted(set(np.linspace(0, rounds, 5).astype(int))):
            local = rng.random() if rc.train.eval_local_models and rnd else np.nan
            row = {**key, "round": rnd, "global_model_test_acc": rng.random(), "global_model_test_loss": rng.random(),
                   "sampled_clients_local_train_loss_mean": rng.random() if rnd else np.nan,
                   "local_models_global_test_acc_mean": local, "local_models_global_test_acc_min": local}  # fmt: skip
            metrics.append(row)
        if sc:
            matrices += [{**key, "after_task": a, "task": i, "accuracy": rng.random()} for a in range(t) for i in range(t)]
            for a in range(t):
                for rnd in sorted({a * r + 1, (a + 1) * r}):
                    tasks += [{**key, "round": rnd, "current_task": a, "task": i, "accuracy": rng.random()} for i in range(t)]
    return tuple(pd.DataFrame(x) for x in (runs, metrics, tasks, matrices))


def draw(shape: Shape, kind: str, out: Path, rng, whole: bool = False) -> None:
    """The figure function of ``kind`` (as ``plot_experiment`` calls it) on the shape; of
    the learning curves the first alone where ``whole``."""
    runs, metrics, tasks, matrices = summaries(shape, kind, rng, whole)
    if kind == "curves":
        for column in list(CURVES)[:1] if whole else CURVES:
            plots.learning_curves(metrics, column, out / f"{column}.png")
        return
    cont = runs[runs["tasks"] > 1]
    if kind == "accuracy_matrix":
        plots.accuracy_matrix_heatmaps(matrices, cont, out / f"{kind}.png")
    elif kind in plots.AFTER_TASK:  # the task-aware one draws matrices of the same shape
        plots.after_task_curves(matrices, cont, out / f"{kind}.png", kind)
    else:
        plots.task_accuracy_curves(tasks, cont, out / f"{kind}.png")


@pytest.mark.long  # half a minute: make smoke
def test_no_text_overlaps_in_the_figures_of_the_shipped_configs(shipped, checked, tmp_path):
    rng = np.random.default_rng(0)
    drawn = []
    for kind in KINDS:
        for shape in representatives(shipped, kind):
            draw(shape, kind, tmp_path / kind / shape.name, rng)
            drawn.append(kind)
    draw(tallest(shipped), "curves", tmp_path / "tallest", rng, whole=True)
    assert len(checked) == sum(len(CURVES) if kind == "curves" else 1 for kind in drawn) + 1
    bad = {path: found for path, found in checked.items() if found}
    assert not bad, "\n".join(f"{p}:\n  " + "\n  ".join(f[:5]) for p, f in bad.items())


# ----------------------------------------------------------------------------- experiment figures
# figure -> the metrics columns it draws besides those its options name
FIGURE_COLUMNS = {
    "fedsol_vs_rho": ["fedsol_prox_loss", "fedsol_cos_update_prox"],
    "fedsol_divergence": ["local_models_dist_to_global_mean", "local_models_pairwise_dist_mean"],
    "fedsol_knowledge": ["local_models_global_test_acc_mean"],
    "fedsol_classwise": [f"global_model_test_acc_class{c}" for c in range(10)],  # digits, CIFAR-10
    "buffer_tasks": [f"fedgp_buffer_task{t}" for t in range(10)],  # FedGP Table 9's 10 tasks
    # the McMahan CNN's parameters (FedSOL Fig. 4b)
    "layer_lambda": [f"layer_lambda:{n}" for n, _ in build_model("cnn_mcmahan", (3, 32, 32), 10, {}).named_parameters()],
    # FedProTIP Fig. 2 (10 tasks): rho of the current task, beta of each older one
    "projection_geometry": ["projection_task", "projection_rho", *(f"projection_beta_task{t}" for t in range(9))],
}
# these read model files and the dataset (tests/test_figures_fedproj.py, tests/test_figures_fedsol.py)
NOT_DRAWN = {"decision_boundaries", "fedsol_landscape"}
FIGURE_METHODS = ("fedsol", "fedproj", "fedgp")  # methods whose own columns ("<method>_<name>") experiment figures draw


def experiment_figure_input(shape: Shape, columns: list[str], rng, rounds: tuple[int, ...] = ()) -> tuple[FigureInput, dict]:
    """A FigureInput of the shape's runs of its two datasets x partitions with the widest
    titles (these figures have a row of panels per dataset x partition; the rows below repeat
    their geometry), random values in ``columns`` (a method's own column, "<method>_<name>",
    only in that method's runs; rows at 5 rounds from 0 to the last, and at ``rounds``, e.g. the
    round a figure's options name), and {run_dir: RunConfig} for the figures that read a run's
    config."""
    from fedforget.plots import _text_width

    pairs = sorted(shape.pairs, key=lambda p: -_text_width(f"{p[0]}, {setting_label(p[1])}", 9))[:2]
    runs, metrics, configs = [], [], {}
    for i, rc in enumerate(shape.runs):
        if (rc.dataset.label, rc.partition.setting) not in pairs:
            continue
        key = dict(zip(RUN_KEYS, (rc.dataset.label, rc.partition.setting, rc.partition.clients,
                                  rc.partition.seed, rc.method.label, rc.seed)))  # fmt: skip
        run_dir = f"{shape.name}/{i}"
        configs[run_dir] = rc
        runs.append({**key, "status": "completed", "run_dir": run_dir,
                     "final_global_model_test_acc": rng.random(), "best_global_model_test_acc": rng.random()})  # fmt: skip
        if rc.method.name == "fedprotip":  # runs.csv's task-identity Acc_t (figure task_identity)
            for t in range(1, (rc.dataset.scenario or {}).get("tasks", 1) + 1):
                runs[-1].update({f"avg_acc_after_task_{t}_task_id_{m}": rng.random() for m in ("batch", "sample")})
        every_task = ()  # Fig. 2's heatmap: a round in every task
        if "projection_task" in columns:
            tasks = (rc.dataset.scenario or {}).get("tasks", 1)
            every_task = tuple(int((k + 0.5) * rc.train.rounds / tasks) for k in range(tasks))
        for rnd in sorted(set(np.linspace(0, rc.train.rounds, 5).astype(int)) | set(rounds) | set(every_task)):
            row = {**key, "round": rnd, "global_model_test_acc": rng.random()}
            for c in columns:
                mine = c.split("_")[0] not in FIGURE_METHODS or c.startswith(f"{rc.method.name}_")
                row[c] = rng.random() if mine and rnd else np.nan
            if "projection_task" in columns and rnd:  # the round's task; beta of the older ones only
                tasks = (rc.dataset.scenario or {}).get("tasks", 1)
                row["projection_task"] = task = min(rnd * tasks // rc.train.rounds, tasks - 1)
                row.update({c: np.nan for c in columns if c.startswith("projection_beta_task") and int(c[20:]) >= task})
            metrics.append(row)
    return FigureInput(shape.name, Path(), pd.DataFrame(runs), pd.DataFrame(metrics)), configs


@pytest.mark.long  # make smoke
def test_no_text_overlaps_in_the_experiment_figures_of_the_shipped_configs(shipped, checked, monkeypatch, tmp_path):
    """Rule figure's figures (``fedforget figure``) that the shipped configs list: each
    figure with each of its option sets once, on the experiment listing it with the widest
    panel titles, then the most methods (the legend)."""
    from fedforget.figures import cost, fedproj, fedsol, sweep

    configs: dict = {}
    monkeypatch.setattr(cost, "_cost", lambda run_dir: {"hours": 12.5, "memory_gb": 40.0, "gpu": True})
    monkeypatch.setattr(cost, "_phase_peaks", lambda run_dir: ({p: 40960.0 for p in cost.PHASES}, True))
    monkeypatch.setattr(fedproj, "run_config", lambda run_dir: configs[run_dir])
    monkeypatch.setattr(sweep, "run_config", lambda run_dir: configs[run_dir])
    monkeypatch.setattr(fedsol, "_method_params", lambda run_dir: (configs[run_dir].method.name, configs[run_dir].method.params))
    listed: dict[str, tuple] = {}
    for shape in shipped:
        for fig in shape.figures:
            key = f"{fig.name} {json.dumps(fig.options, sort_keys=True)}"
            widths = (shape.title_width(False), len(shape.methods), shape.method_width())
            if fig.name not in NOT_DRAWN and (key not in listed or widths > listed[key][0]):
                listed[key] = (widths, shape, fig)
    rng = np.random.default_rng(0)
    for _, shape, fig in listed.values():
        columns = FIGURE_COLUMNS.get(fig.name, []) + list(fig.options.get("columns", []))
        columns += [fig.options["column"]] if "column" in fig.options else []
        at = (fig.options["round"],) if "round" in fig.options else ()
        inp, cfgs = experiment_figure_input(shape, list(dict.fromkeys(columns)), rng, at)
        configs.update(cfgs)
        out = tmp_path / shape.name / f"{fig.label}.png"
        out.parent.mkdir(parents=True, exist_ok=True)  # as make_figure does
        FIGURES.get(fig.name)(inp, out, **fig.options)
    assert len(listed) >= 10 and len(checked) == len(listed)
    bad = {path: found for path, found in checked.items() if found}
    assert not bad, "\n".join(f"{p}:\n  " + "\n  ".join(f[:5]) for p, f in bad.items())


# ----------------------------------------------------------------------------- partition heatmaps
def test_no_text_overlaps_in_the_partition_heatmaps_of_the_shipped_configs(shipped, checked):
    """Rule partition's heatmap (clients x classes) for the shipped partitions with the most
    clients, the most classes, the most annotated cells and the narrowest figure (fewest
    classes, longest title); counts up to a class's share of the training set. Classes are
    labelled by number here (the prepared data's class names are not at hand)."""
    from fedforget.data import DATASETS

    parts, most = {}, {}
    for shape in shipped:
        for rc in shape.runs:
            title = f"{rc.dataset.pool_id}: {rc.partition.slug}"
            info = DATASETS.get(rc.dataset.name)
            parts[title] = (rc.partition.clients, info.num_classes)
            most[title] = info.split_sizes(info.resolve(rc.dataset.options))[0] // info.num_classes
    annotated = {t: kc for t, kc in parts.items() if kc[0] * kc[1] <= 400}
    picks = {
        max(parts, key=lambda t: parts[t]),
        max(parts, key=lambda t: parts[t][::-1]),
        max(annotated, key=lambda t: (annotated[t][0] * annotated[t][1], len(t))),
        max(parts, key=lambda t: (-parts[t][1], len(t))),
    }
    rng = np.random.default_rng(0)
    for title in picks:
        k, c = parts[title]
        plots.partition_heatmap(rng.integers(0, most[title] + 1, (k, c)), Path(f"{title}.png"), title)
    assert len(checked) == len(picks) and max(k for k, _ in parts.values()) >= 100
    bad = {path: found for path, found in checked.items() if found}
    assert not bad, "\n".join(f"{p}:\n  " + "\n  ".join(f[:5]) for p, f in bad.items())
