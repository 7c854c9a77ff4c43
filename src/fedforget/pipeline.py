"""The pipeline's steps as plain functions (prepare -> partition -> train -> aggregate ->
plot). Snakemake calls them one job at a time through the console script; ``run_all``
chains them in-process for use without Snakemake."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import DatasetSpec, Experiment, RunConfig, WorkflowConfig
from .data import DATASETS, load_dataset, load_public, prepare_dataset, prepare_public
from .data.base import domain_ids
from .data.tasks import row_tasks
from .partition import PartitionSpec, class_counts, partition_dataset, save_partition
from .utils import FedForgetError
from .validation import did_you_mean

log = logging.getLogger(__name__)


def prepare_all(
    wfs: list[WorkflowConfig], raw_dir: str | Path | None = None, download: bool = False
) -> list[Path]:
    """Every dataset and public set of the configs, each once (each into its config's
    data_dir), datasets first: public slices are cut from them. The paper datasets read their
    native files from ``raw_dir`` (default ``<data_dir>/raw``; ``download``: fetch missing ones)."""
    datasets = {(wf.data_dir, did): v for wf in wfs for did, v in wf.datasets_to_prepare().items()}
    publics = {(wf.data_dir, pid): v for wf in wfs for pid, v in wf.holdouts_to_prepare().items()}
    out = [prepare_dataset(name, opts, root, raw_dir, download) for (root, _), (name, opts) in datasets.items()]
    return out + [prepare_public(spec, private, root) for (root, _), (private, spec) in publics.items()]


def partition_one(ds: DatasetSpec, spec: PartitionSpec, data_dir: str, out_dir: str | Path) -> Path:
    """Partition the private pool of ``ds`` and write assignment, class counts and heatmap."""
    from .plots import partition_heatmap

    data = load_dataset(ds.id, data_dir)
    public = load_public(ds.public, ds.id, data_dir, with_labels=False)
    excluded = public.excluded_train_rows if public is not None else None
    assignment = partition_dataset(data, spec, excluded)
    per_task = None  # [clients, tasks]: a row in no task is in no client's share (make_partition)
    if spec.per_task:
        task = row_tasks(spec.tasks, data.y_train, data.num_classes, domain_ids(data.meta, "train"))  # type: ignore[arg-type]
        per_task = class_counts(assignment, task, spec.clients, int(spec.tasks["tasks"]))  # type: ignore[index]
    out = save_partition(
        out_dir, assignment, spec, ds.id, data.y_train, data.num_classes, ds.public_id, per_task
    )
    counts = class_counts(assignment, data.y_train, spec.clients, data.num_classes)
    partition_heatmap(counts, out / "heatmap.png", f"{ds.pool_id}: {spec.slug}", data.class_names, per_task)
    return out


def experiment_run_dirs(wf: WorkflowConfig, exp: Experiment) -> list[Path]:
    return [r.run_dir for r in exp.runs(wf.data_dir, wf.results_dir)]


def summary_dir(wf: WorkflowConfig, exp: str) -> Path:
    return Path(wf.results_dir) / exp / "summary"


def figures_dir(wf: WorkflowConfig, exp: str) -> Path:
    return Path(wf.results_dir) / exp / "figures"


def run_all(
    wf: WorkflowConfig, force: bool = False, progress: bool | None = None
) -> dict[str, Any]:
    """Every step for every experiment, in-process, skipping finished runs of the same
    config and code (``provenance.stale_reasons``; unless ``force``)."""
    from .aggregate import aggregate
    from .figures import make_figure
    from .paper_tables import write_paper_tables
    from .plots import experiment_curves, plot_experiment
    from .provenance import stale_reasons
    from .runner import run_training

    for name, opts in wf.datasets_to_prepare().items():
        if force or not (Path(wf.data_dir) / name / "meta.json").exists():
            prepare_dataset(*opts, wf.data_dir)
    for pid, (private, spec) in wf.holdouts_to_prepare().items():
        if force or not (Path(wf.data_dir) / "public" / pid / "meta.json").exists():
            prepare_public(spec, private, wf.data_dir)
    done = {}
    for exp in wf.experiments:
        for rc in exp.runs(wf.data_dir, wf.results_dir):
            if force or not (rc.partition_dir / "meta.json").exists():
                partition_one(rc.dataset, rc.partition, wf.data_dir, rc.partition_dir)
            if not force and not stale_reasons(rc):
                continue
            run_training(rc, rc.run_dir, progress, resume=not force)  # --force: from round 0
        table = aggregate(
            experiment_run_dirs(wf, exp),
            summary_dir(wf, exp.name),
            exp.name,
            exp.paper,
            wf.paper_results,
        )
        if exp.paper:
            write_paper_tables(summary_dir(wf, exp.name), exp.name, exp.paper, wf.paper_results)
        curves = experiment_curves(exp.train_for(m) for m in exp.methods)  # what it measured
        plot_experiment(summary_dir(wf, exp.name), figures_dir(wf, exp.name), curves)
        for fig in exp.figures:
            make_figure(
                fig.name,
                summary_dir(wf, exp.name),
                exp.name,
                figures_dir(wf, exp.name) / f"{fig.label}.png",
                fig.options,
            )
        done[exp.name] = table
    return done


def describe(wf: WorkflowConfig) -> str:
    lines = []
    for e in wf.experiments:
        n = len(e.runs(wf.data_dir, wf.results_dir))
        lines.append(
            f"{e.name}: {len(e.datasets)} datasets x {len(e.partitions)} partitions x "
            f"{len(e.methods)} methods x {len(e.seeds)} seeds = {n} training jobs"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Selection:
    """What ``--config only=EXPERIMENT[/METHOD[/SEED]]`` asks a run of the workflow for: one
    experiment (its training runs, tables and figures), or one method of it, or one seed of
    that method (their training runs only: an experiment's tables and figures need every run
    of it, so they are not rebuilt from a part) [D]."""

    experiment: str
    method: str | None = None
    seed: int | None = None

    @property
    def whole_experiment(self) -> bool:
        return self.method is None and self.seed is None

    def takes(self, rc: RunConfig) -> bool:
        return (
            rc.experiment == self.experiment
            and (self.method is None or rc.method.label == self.method)
            and (self.seed is None or rc.seed == self.seed)
        )


def _pick(what: str, value: str, allowed: list[str], where: str) -> str:
    if value in allowed:
        return value
    hint = did_you_mean(value, allowed)
    raise FedForgetError(f"only={where!r}: unknown {what} {value!r}{hint}; allowed: {', '.join(allowed)}")


def parse_only(wf: WorkflowConfig, only: Any) -> Selection | None:
    """The ``only`` config value (EXPERIMENT, EXPERIMENT/METHOD or EXPERIMENT/METHOD/SEED,
    the method by its label) checked against the config: None where it is unset; one error
    naming the unknown part, the nearest name and the allowed ones."""
    if only is None or only == "":
        return None
    text = str(only)
    parts = text.split("/")
    if len(parts) > 3 or not all(parts):
        raise FedForgetError(f"only={text!r}; allowed: EXPERIMENT, EXPERIMENT/METHOD or EXPERIMENT/METHOD/SEED")
    exp = wf.experiment(_pick("experiment", parts[0], [e.name for e in wf.experiments], text))
    method = _pick("method", parts[1], [m.label for m in exp.methods], text) if len(parts) > 1 else None
    seed = None
    if len(parts) > 2:
        seed = int(_pick("seed", parts[2], [str(s) for s in exp.seeds], text))
    return Selection(exp.name, method, seed)


def dataset_names() -> list[str]:
    return DATASETS.names()
