"""A raw config -> a validated ``WorkflowConfig`` (``parse_config``): the schema
(``fedforget.validation``), then each part by the module it belongs to (datasets and their
options, models, task streams, augmentation, partitions' feasibility, methods' parameters and
requirements, figures, paper links), every problem reported in one error naming the key, the
bad value and what is allowed, before any job runs. Its place is above everything it checks,
so that none of those modules imports the config layer back.

It imports the method, model and figure modules, hence torch: loading an already validated
config (``fedforget.parsecache``) imports ``fedforget.config`` alone and stays torch-free."""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from .config import (
    PAPER_RESULTS,
    DatasetSpec,
    Experiment,
    FigureSpec,
    MethodSpec,
    RunConfig,
    TrainSpec,
    WorkflowConfig,
    deep_merge,
    load_yaml,
)
from .continual import TASK_AWARE
from .data import DATASETS, dataset_id
from .data.base import public_splits
from .data.scenario import check_rounds, has_task_aware_scores, resolve_scenario
from .figures import check_figure
from .inputs import check_augment, check_normalize
from .methods import METHODS, ClientShape, make_params
from .methods.params import param_schema, recorded
from .models import check_model, eval_by_batch, meta_model, parameter_count, parameters_of
from .paper_tables import SCORED
from .partition import PartitionSpec, check_feasible, check_per_class_shards, check_scheme_keys
from .plots import CURVES
from .smoke import smoke_config
from .train_spec import optimizer_block_problem
from .trainers import engine_pairing
from .utils import FedForgetError, byte_size, paper_tables
from .validation import check_numbers, did_you_mean, validate_schema
from .vectorized import method_not_vectorized


def check_paper_link(paper: dict[str, Any], path: str, key: str, aware: dict[str, bool] | None = None) -> None:
    """An experiment's paper link must point at rows that exist: the file (top-level key
    ``paper_results``) and at least one row of that paper and table in it; its dataset_map's
    values must be the paper's dataset name, {dataset, setting, scored} or a list of those,
    ``scored`` one of ``paper_tables.SCORED``, task_aware only for a dataset that has
    task-aware scores (``aware``: our dataset label -> whether it has)."""
    aware = aware or {}
    file = Path(path)
    if not file.is_file():
        raise FedForgetError(
            f"{key}: links paper '{paper['name']}' table {paper['table']!r}, but the paper results file "
            f"'{path}' (top-level key paper_results) does not exist; run from the repository root or set paper_results"
        )
    with file.open(newline="", encoding="utf-8") as f:
        tables = {(r.get("paper"), r.get("table")) for r in csv.DictReader(f)}
    for table in paper_tables(paper):
        if (paper["name"], table) not in tables:
            known = sorted({f"{p}/{t}" for p, t in tables if p == paper["name"]}) or sorted({p for p, _ in tables})
            raise FedForgetError(
                f"{key}: paper '{paper['name']}' table {table!r} has no rows in '{path}'; allowed: {known}"
            )
    for ours, theirs in (paper.get("dataset_map") or {}).items():
        entries = theirs if isinstance(theirs, list) and theirs else [theirs]
        for entry in entries:
            ok = isinstance(entry, str) or (
                isinstance(entry, dict) and "dataset" in entry and set(entry) <= {"dataset", "setting", "scored"}
            )
            if not ok:
                raise FedForgetError(
                    f"{key}.dataset_map.{ours}={theirs!r}; allowed: the paper's dataset name, "
                    "{dataset: ..., setting: ..., scored: ...}, or a list of those"
                )
            scored = entry.get("scored") if isinstance(entry, dict) else None
            if scored is not None and scored not in SCORED:
                raise FedForgetError(f"{key}.dataset_map.{ours}.scored={scored!r}; allowed: {list(SCORED)}")
            if scored == TASK_AWARE and ours in aware and not aware[ours]:
                raise FedForgetError(
                    f"{key}.dataset_map.{ours}.scored={scored!r}: dataset '{ours}' has no task-aware scores (they "
                    "are kept for a task stream scored without the task id: scenario.tasks > 1, incremental class "
                    "or a domain stream); allowed: a class-incremental or domain stream, or no 'scored'"
                )


def paper_map_problems(experiments: list[Experiment]) -> list[str]:
    """A paper link's dataset_map, setting_map and method_map keys must be labels the config
    has (a dataset label, a partition setting, a method label of any of its experiments: a
    link is often one anchor shared by several); a misspelt one left its column or row
    unlinked without a word."""
    have = {
        "dataset_map": {d.label for e in experiments for d in e.datasets},
        "setting_map": {p.setting for e in experiments for p in e.partitions},
        "method_map": {m.label for e in experiments for m in e.methods},
    }
    out = []
    for i, e in enumerate(experiments):
        for name, labels in have.items():
            for k in (e.paper or {}).get(name) or {}:
                if k not in labels:
                    out.append(
                        f"experiments[{i}].paper.{name}: '{k}' is no {name.split('_')[0]} label of this config"
                        f"{did_you_mean(k, sorted(labels))}; allowed: {', '.join(sorted(labels))}"
                    )
    return out


def _task_aware_scores(scenario: dict[str, Any] | None, smoke: bool = False) -> bool:
    """``has_task_aware_scores`` of a resolved scenario block (None: one task), any number
    of tasks counting as several at smoke scale, whose ``smoke.tasks`` may cut a stream to one."""
    if not scenario:
        return False
    return has_task_aware_scores(2 if smoke else int(scenario.get("tasks") or 1), scenario.get("incremental"))


def _model(raw: Any) -> tuple[str, dict[str, Any]]:
    return (raw, {}) if isinstance(raw, str) else (raw["name"], dict(raw.get("options", {})))


def parse_config(raw: dict[str, Any]) -> WorkflowConfig:
    """Validate a raw config dict (schema, registries, sizes) and build typed objects. Every
    problem is reported in one error naming the key, the bad value and what is allowed."""
    check_numbers(raw, param_schema)  # before the schema: its range checks pass NaN, and reals and integers beyond float32 and int64
    validate_schema(raw)
    if raw.get("scale", "full") == "smoke":  # shrunk, then validated as any config
        # [D] the config as written first, at full scale: a config the smoke run accepts is
        # one the full run accepts, and the shrinking reads only checked values (it cast
        # freeze_stages 'zz' with int() and replaced a bad pretrained or image size unseen)
        parse_config({**raw, "scale": "full"})
        raw = smoke_config(raw)
        validate_schema(raw)
    scale = raw.get("scale", "full")
    problems: list[str] = []

    def check(fn, *args):
        try:
            return fn(*args)
        except FedForgetError as e:
            problems.append(str(e))
            return None

    experiments = []
    names: set[str] = set()
    for i, ex in enumerate(raw["experiments"]):
        key = f"experiments[{i}]"
        if ex["name"] == "partitions":
            problems.append(
                f"{key}.name: 'partitions' is reserved (results/partitions holds the partitions)"
            )
        if ex["name"] in names:
            problems.append(f"{key}.name: duplicate experiment name '{ex['name']}'")
        names.add(ex["name"])
        train = dict(ex.get("train") or {})
        for okey, block in [(f"{key}.train.optimizer", train.get("optimizer"))] + [
            (f"{key}.methods[{j}].train.optimizer", (m.get("train") or {}).get("optimizer")) for j, m in enumerate(ex["methods"])
        ]:  # fmt: skip
            if (problem := optimizer_block_problem(block, okey)) is not None:
                problems.append(problem)
        datasets: list[DatasetSpec] = []
        for j, d in enumerate(ex["datasets"]):
            dkey = f"{key}.datasets[{j}]"
            info = check(DATASETS.get, d["name"], f"{dkey}.name")
            if info is None:
                continue
            try:
                opts = info.resolve(d.get("options"))
            except FedForgetError as e:
                problems.append(f"{dkey}.options: {e}")
                continue
            mname, mopts = _model(d["model"])
            shape = info.input_shape(opts)
            if check(check_model, mname, shape, mopts, f"{dkey}.model") is None:
                continue
            public = dict(d["public"]) if d.get("public") else None
            if public and public["source"] == "holdout":
                public.setdefault("seed", 0)
            if public and public["source"] == "dataset":
                public = check(public_splits, public, d["name"], f"{dkey}.public") or public
                pinfo = check(DATASETS.get, public["dataset"], f"{dkey}.public.dataset")
                popts = check(pinfo.resolve, public.get("options")) if pinfo else None
                if popts is not None:
                    public["options"] = popts
                    if tuple(pinfo.input_shape(popts)) != tuple(shape):
                        problems.append(
                            f"{dkey}.public.dataset: '{public['dataset']}' has input shape {list(pinfo.input_shape(popts))}, "
                            f"but '{d['name']}' has {list(shape)}; a public set must match the private data's shape"
                        )
                    elif "tokenizer" in opts and popts.get("tokenizer") != opts["tokenizer"]:  # text: same ids
                        problems.append(
                            f"{dkey}.public.options.tokenizer: '{popts.get('tokenizer')}' differs from the private "
                            f"set's '{opts['tokenizer']}'; a public text set must be tokenized the same way"
                        )
            scenario = check(
                resolve_scenario, d.get("scenario"), info.num_classes, tuple(shape), f"{dkey}.scenario", info.domains(opts)
            )
            frozen = mopts.get("freeze_stages")
            if frozen and int((scenario or {}).get("tasks") or 1) < 2:
                problems.append(
                    f"{dkey}.model.options.freeze_stages={frozen}: the model freezes them from the second task on, "
                    f"but dataset '{d['name']}' streams one task, so nothing would be frozen; allowed: 0, or a "
                    f"scenario of two or more tasks"
                )
            augment = check(check_augment, d.get("augment"), tuple(shape), f"{dkey}.augment")
            normalize = check(check_normalize, d.get("normalize"), tuple(shape), f"{dkey}.normalize", info.uint8_images(opts))
            ds = DatasetSpec(
                d["name"], opts, mname, mopts, public, d.get("label") or dataset_id(d["name"], opts), scenario,
                augment, normalize,
            )  # fmt: skip
            if ds.label in {x.label for x in datasets}:
                problems.append(
                    f"{dkey}.label: duplicate dataset label '{ds.label}' (set a distinct label)"
                )
            datasets.append(ds)
        partitions: list[PartitionSpec] = []
        for j, p in enumerate(ex["partitions"]):
            pkey = f"{key}.partitions[{j}]"
            check(check_scheme_keys, p, pkey)
            spec = PartitionSpec(**p)
            if spec.slug in {x.slug for x in partitions}:
                problems.append(f"{pkey}: duplicate partition '{spec.slug}'")
            partitions.append(spec)
            for ds in datasets:
                n_train = DATASETS.get(ds.name).split_sizes(ds.options)[0]
                if ds.public and ds.public["source"] == "holdout":
                    n_train -= int(round(ds.public["fraction"] * n_train))
                try:
                    check_feasible(spec, n_train, pkey, DATASETS.get(ds.name).num_classes)
                except FedForgetError as e:
                    problems.append(f"{e} (dataset '{ds.label}')")
                if spec.per_task and spec.scheme == "shards" and spec.shard_rule == "per_class":  # drawn per task
                    sc = ds.scenario or {}
                    per = int(sc["classes_per_task"]) if sc.get("kind") == "split" else DATASETS.get(ds.name).num_classes
                    check(check_per_class_shards, spec.shards_per_client, spec.clients, per, f"{pkey} (dataset '{ds.label}', per task)")
        methods: list[MethodSpec] = []
        rounds: dict[str, int] = {}  # each method's train.rounds (a figure's round option is checked against them)
        precisions: dict[str, str] = {}  # each method's train.precision (one per experiment)
        for j, m in enumerate(ex["methods"]):
            mkey = f"{key}.methods[{j}]"
            if check(METHODS.get, m["name"], f"{mkey}.name") is None:
                continue
            pobj = check(make_params, m["name"], m.get("params") or {}, f"{mkey}.params")
            if pobj is None:
                continue
            params = recorded(pobj)  # with defaults filled in (methods.params.recorded)
            label = m.get("label") or m["name"]
            if label in {x.label for x in methods}:
                problems.append(
                    f"{mkey}.label: duplicate method label '{label}' (give each variant its own label)"
                )
            spec = MethodSpec(m["name"], params, label, dict(m.get("train") or {}))
            methods.append(spec)
            cls = METHODS.get(m["name"])
            mtrain = TrainSpec.from_dict(deep_merge(train, spec.train))
            rounds[label] = mtrain.rounds
            precisions[label] = mtrain.precision
            try:
                cls.check_train(mtrain, pobj)
            except FedForgetError as e:
                problems.append(f"{mkey}: {e}")
            if mtrain.client_engine == "vectorized":  # the model's part is known when the job builds it
                why = method_not_vectorized(cls, mtrain.optimizer.name, mtrain.drop_last, pobj)
                if why is not None:
                    problems.append(f"{mkey}: train.client_engine='vectorized' is not possible here: {why}; allowed: auto, sequential")
            # a method defined on one model alone (its class's needs_model, or a plug-in's base's: L2P)
            needs = {getattr(METHODS.get(n), "needs_model", None) for n in (m["name"], params.get("base"))
                     if isinstance(n, str) and n in METHODS} - {None}  # fmt: skip
            for ds in datasets:
                if needs and ds.model not in needs:
                    problems.append(
                        f"{key}.datasets[{datasets.index(ds)}].model: method '{label}' needs model "
                        f"{' or '.join(sorted(needs))}, got '{ds.model}'"
                    )
                try:
                    cls.check_model(ds.model, pobj, ds.model_options)
                except FedForgetError as e:
                    problems.append(f"{key}.datasets[{datasets.index(ds)}].model (method '{label}'): {e}")
                if eval_by_batch(ds.model, ds.model_options) and mtrain.eval_batch_size != mtrain.batch_size:
                    problems.append(
                        f"{key}.train.eval_batch_size={mtrain.eval_batch_size}: dataset '{ds.label}''s "
                        f"model normalises each evaluation batch by its own statistics (norm: batch_stateless), so the "
                        f"evaluation batch is part of the experiment; allowed: train.batch_size ({mtrain.batch_size}), "
                        f"as the FedSOL and FedNTD code evaluate"
                    )
                dkey = f"{key}.datasets[{datasets.index(ds)}].scenario (method '{label}')"
                check(check_rounds, ds.scenario, mtrain.rounds, dkey)
                try:
                    cls.check_scenario(ds.scenario, pobj)
                except FedForgetError as e:
                    problems.append(f"{dkey}: {e}")
                if ds.scenario and ds.scenario.get("class_overlap") and cls.trait("one_task_per_class", pobj):
                    problems.append(
                        f"{dkey}.class_overlap={ds.scenario['class_overlap']}: method '{m['name']}' maps each class to "
                        f"one task (one_task_per_class), so neighbouring tasks cannot share classes; allowed: "
                        f"class_overlap 0, or a method without that trait (e.g. fedavg, fot, fedprotip)"
                    )
            late = [r for r in mtrain.save_client_models if r > mtrain.rounds]
            if late:
                problems.append(
                    f"{key}.train.save_client_models: rounds {late} are beyond train.rounds={mtrain.rounds} (method '{label}'); allowed: 1..{mtrain.rounds}"
                )
            if "projection_geometry" in mtrain.diagnostics and not cls.trait("shared_projection", pobj):
                problems.append(
                    f"{key}.train.diagnostics: projection_geometry needs a method whose local step is one projection "
                    f"shared by every client (shared_projection: fedprotip); method '{label}' ('{m['name']}') has none"
                )
            for ds in datasets:
                if cls.trait("needs_public", pobj) and not ds.public:
                    problems.append(
                        f"{mkey}.name: method '{m['name']}' needs a public set, but dataset '{ds.label}' declares none (datasets[].public)"
                    )
        if len(set(precisions.values())) > 1:  # one experiment is one table: its methods compared at one arithmetic
            problems.append(
                f"{key}.methods: train.precision differs between methods ({', '.join(f'{k}: {v}' for k, v in precisions.items())}), "
                f"but an experiment's methods are compared in one table; allowed: one precision per experiment (set it in "
                f"{key}.train, or put the methods in two experiments)"
            )
        if len(set(ex["seeds"])) != len(ex["seeds"]):
            problems.append(f"{key}.seeds: duplicate seeds {ex['seeds']}")
        figures: list[FigureSpec] = []
        for j, f in enumerate(ex.get("figures") or []):
            fkey = f"{key}.figures[{j}]"
            fig = FigureSpec(f["name"], f.get("label") or f["name"], dict(f.get("options") or {}))
            check(check_figure, fig.name, fig.options, fkey)
            at = fig.options.get("round")
            if isinstance(at, int) and not isinstance(at, bool) and rounds:
                label, last = min(rounds.items(), key=lambda kv: kv[1])
                if not 1 <= at <= last:  # else found only by the figure job, after training
                    problems.append(
                        f"{fkey}.options.round: {at} is beyond the rounds of method '{label}' (train.rounds={last}); allowed: 1..{last}"
                    )
            if fig.label in {x.label for x in figures} or fig.label in CURVES:
                problems.append(f"{fkey}.label: duplicate figure label '{fig.label}' (set a distinct label)")
            figures.append(fig)
        if ex.get("paper"):
            # at smoke scale a stream cut to one task keeps its full-scale link (smoke.tasks)
            aware = {ds.label: _task_aware_scores(ds.scenario, scale == "smoke") for ds in datasets}
            check(check_paper_link, ex["paper"], raw.get("paper_results", PAPER_RESULTS), f"{key}.paper", aware)
        experiments.append(
            Experiment(
                ex["name"],
                ex.get("description", ""),
                datasets,
                partitions,
                methods,
                list(ex["seeds"]),
                train,
                ex.get("paper"),
                figures,
                scale=scale,
            )
        )
    problems += paper_map_problems(experiments)
    if problems:  # one line per problem, once (a rule checked per method may find it for each)
        raise FedForgetError("invalid config:\n  " + "\n  ".join(dict.fromkeys(problems)))
    experiments = [replace(e, pairing=engine_pairing(e)) for e in experiments]
    return WorkflowConfig(
        experiments,
        raw.get("data_dir", "data"),
        raw.get("results_dir", "results"),
        raw.get("paper_results", PAPER_RESULTS),
        scale,
    )


def load_config(path: str | Path) -> WorkflowConfig:
    return parse_config(load_yaml(path))


def dataset_sizes(wf: WorkflowConfig) -> list[str]:
    """One line per distinct dataset of the config (private, and public ones read from
    another dataset) with its rows, their shape and dtype and its prepared size, known
    before it is built (``DatasetInfo.split_sizes``, ``prepared_bytes``): ``fedforget validate`` prints
    them, so that a size typed wrong shows before any job (``prepare`` refuses one that cannot
    fit, ``data.base.check_room``)."""
    seen: dict[str, str] = {}
    for e in wf.experiments:
        for d in e.datasets:
            named = [(d.name, d.options)]
            if d.public and d.public["source"] == "dataset":
                named.append((d.public["dataset"], d.public.get("options") or {}))
            for name, options in named:
                info = DATASETS.get(name)
                o = info.resolve(options)
                did = dataset_id(name, o)
                if did in seen:
                    continue
                n, n_test = info.split_sizes(o)
                bound = "at most " if o.get("subset") else ""
                seen[did] = (
                    f"  {did}: {bound}{n:,} train / {n_test:,} test rows of {list(info.input_shape(o))} "
                    f"{info.input_dtype(o)}, {bound}{byte_size(info.prepared_bytes(o))} prepared"
                )
    return list(seen.values())


def client_shape(rc: RunConfig, build: Callable[[], Any]) -> ClientShape:
    """What run ``rc``'s per-client state is sized by (``FedAvg.client_kept_bytes``): its
    model input (uint8 images become float32), classes, the dataset's training rows (at
    most, before it is built: twice them under asynchronous windows, ``ClientShape``) and
    ``build``, which gives its model (``meta_model``'s) where a method reads it."""
    d = rc.dataset
    info = DATASETS.get(d.name)
    o = info.resolve(d.options)
    stored = info.input_dtype(o)
    value = 4 if stored == "uint8" else np.dtype(stored).itemsize  # inputs.InputPipeline.convert
    windows = (d.scenario or {}).get("boundaries", "sync") != "sync"
    return ClientShape(tuple(d.input_shape), value, d.num_classes, info.split_sizes(o)[0] * (2 if windows else 1), build)


def _client_state(rc: RunConfig, models: dict[tuple, Any] | None) -> tuple[int, int | None, int | None, Callable[[], Any]]:
    """Run ``rc``'s (model copies per client, at most its other kept bytes per client, the
    whole for every client or None where a hub config sizes it, the meta model's builder):
    the model made (and kept in ``models``, by model) only where the copies or the method
    need it, so a parse of runs that keep nothing builds none."""
    m, d = rc.method, rc.dataset
    cls, params = METHODS.get(m.name), make_params(m.name, m.params)
    key = (d.model, repr(sorted(d.model_options.items())), tuple(d.input_shape), d.num_classes)
    models = {} if models is None else models

    def build() -> Any:
        if key not in models:
            models[key] = meta_model(d.model, d.input_shape, d.num_classes, d.model_options)
        return models[key]

    copies = cls.client_copies(params)
    kept = cls.client_kept_bytes(params, client_shape(rc, build))
    n = parameters_of(build()) if copies else 0
    per_client = None if kept is None or n is None else 4 * n * copies + kept
    return copies, kept, None if per_client is None else per_client * rc.partition.clients, build


def client_state_of(rc: RunConfig, models: dict[tuple, Any] | None = None) -> dict[str, Any] | None:
    """What run ``rc``'s method keeps per client across rounds, as ``client_state`` lists
    it: None where it keeps nothing. ``copies`` of the model (``FedAvg.client_model_copies``)
    and ``kept_bytes``, at most, of other tensors per client (``FedAvg.client_kept_bytes``:
    replay buffers, exemplars, bases); ``bytes``, the whole for every client of the
    partition (and the same in MiB rounded up, ``client_state_mb``), None where only the
    model's hub config knows its size. ``models`` keeps the models already made on the meta
    device, by model (``meta_model``: milliseconds, but thousands of runs share a few)."""
    copies, kept, size, build = _client_state(rc, models)
    if not copies and kept == 0:
        return None
    d = rc.dataset
    return {"method": rc.method.label, "model": d.model, "dataset": d.label, "input_shape": list(d.input_shape),
            "clients": rc.partition.clients, "copies": copies, "parameters": parameters_of(build()), "kept_bytes": kept,
            "bytes": size, "client_state_mb": None if size is None else -(-size // 2**20)}  # fmt: skip


def client_state_mb(rc: RunConfig, models: dict[tuple, Any] | None = None) -> int:
    """[D] The host memory, in MiB rounded up, of what run ``rc`` keeps per client once
    every client has trained (``client_state_of``: model copies, and at most its buffers,
    exemplars, bases or class reports at their fullest): the training job's Snakemake resource
    ``client_state_mb`` (workflow/rules/train.smk), by which the jobs packed in one SLURM
    submission (``slurm-packed``) or on one machine (``--resources client_state_mb=N``) run
    at once only as many as fit. 0 where the method keeps nothing, or where the model's
    size is its hub config's (not counted). Builds no model a row would only list."""
    size = _client_state(rc, models)[2]
    return 0 if size is None else -(-size // 2**20)


def client_state(wf: WorkflowConfig) -> list[dict[str, Any]]:
    """One row per distinct (method, model, dataset, clients) of the config's runs whose
    method keeps state per client (``client_state_of``): the model copies, the model's
    parameters (``parameter_count``; None where only its hub config knows), at most the
    bytes of its other kept tensors per client, and the host memory of all of it once every
    client has trained (float32 bytes). A job refuses, before round 1, a run whose training
    clients' model copies cannot fit its host (``Simulation.check_client_state_fits``); jobs
    packed in one submission run at once only as many as fit its memory (``client_state_mb``)."""
    rows: dict[tuple, dict[str, Any] | None] = {}
    models: dict[tuple, Any] = {}
    for rc in wf.runs():  # seeds and the rest repeat a row's key
        m, d = rc.method, rc.dataset
        key = (m.label, d.label, d.model, repr(sorted(d.model_options.items())), rc.partition.clients)
        if key not in rows:
            rows[key] = client_state_of(rc, models)
    return [r for r in rows.values() if r is not None]


def client_state_sizes(wf: WorkflowConfig) -> list[str]:
    """``client_state`` as ``fedforget validate`` prints it, a line per row."""
    lines = []
    for r in client_state(wf):
        kept = [f"{r['copies']} cop{'ies' if r['copies'] > 1 else 'y'} of the model"] if r["copies"] else []
        if r["kept_bytes"] is None:
            kept.append("replay rows, exemplars, bases or class reports of a size its hub model sets")
        elif r["kept_bytes"]:
            kept.append(f"at most {byte_size(r['kept_bytes'])} of replay rows, exemplars, bases or class reports")
        total = "a size its hub model sets" if r["bytes"] is None else f"{byte_size(r['bytes'])} (client_state_mb {r['client_state_mb']:,})"
        lines.append(f"  {r['method']} on {r['model']} ({r['dataset']} {r['input_shape']}), {r['clients']:,} clients: "
                     f"{' and '.join(kept)} per client, {total} once all have trained")  # fmt: skip
    return lines


def model_sizes(wf: WorkflowConfig) -> list[str]:
    """One line per distinct model of the config (name, options, the dataset's input shape
    and classes) with its parameters, counted without building it (``parameter_count``;
    one head, before a method's modules): ``fedforget validate`` prints them, so that a size
    typed wrong shows before any job."""
    seen: dict[tuple, str] = {}
    for e in wf.experiments:
        for d in e.datasets:
            shape, k = d.input_shape, d.num_classes
            key = (d.model, repr(sorted(d.model_options.items())), shape, k)
            if key in seen:
                continue
            n = parameter_count(d.model, shape, k, d.model_options)
            opts = f" {d.model_options}" if d.model_options else ""
            size = "its size is its hub config's" if n is None else f"{n:,} parameters ({byte_size(4 * n)} in float32)"
            seen[key] = f"  {d.model}{opts} on {d.name} {list(shape)}, {k} classes: {size}"
    return list(seen.values())
