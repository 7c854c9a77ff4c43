"""Typed configuration: the workflow config (experiments = datasets x partitions x methods x
seeds) is validated once, against the JSON schema and then against the registries and the
data sizes, and expanded into one ``RunConfig`` per training job."""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from .data import DATASETS, dataset_id, public_id
from .partition import PartitionSpec, check_feasible
from .plots import CURVES
from .utils import FedForgetError, config_hash, paper_tables
from .validation import check_finite, validate_schema

# ----------------------------------------------------------------------------- spec objects

PAPER_RESULTS = "config/paper_results.csv"  # default of the top-level key paper_results


@dataclass(frozen=True)
class OptimizerSpec:
    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)


@dataclass(frozen=True)
class TrainSpec:
    rounds: int = 50
    local_epochs: int = 1
    batch_size: int = 32
    sample_rate: float = 1.0
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    lr_decay: float = 1.0
    eval_every: int = 1
    drop_last: bool = False  # skip each epoch's trailing partial minibatch
    eval_local_models: bool = True
    eval_batch_size: int = 1024
    diagnostics: tuple[str, ...] = ()  # extra per-round analyses, see metrics.DIAGNOSTICS
    save_client_models: tuple[int, ...] = ()  # rounds whose local models are saved (snapshots/)
    checkpoint_every: int = 1  # rounds between checkpoints (resume point of an interrupted run)
    client_engine: str = "auto"  # auto | sequential | vectorized (fedforget.vectorized)
    max_parallel_clients: int = 128  # clients per batched group (memory bound)
    device: str = "auto"
    threads: int = 0
    data_storage: str = "auto"  # auto | device | stream: where the training pool lives (fedforget.inputs)
    log_every: int = 1  # rounds between progress lines when not on a terminal (fedforget.progress)
    # set by Experiment.runs, not by users: why client_engine auto trains this job's clients
    # one after another, to pair it with a method of its experiment that cannot batch them
    engine_pairing: str = ""

    def epoch_rows(self, n: int, batch_size: int | None = None) -> int:
        """The rows of a local epoch over ``n`` rows that train, in minibatches of
        ``batch_size`` (default ``self.batch_size``; a method passes its client context's):
        all of them; with ``drop_last`` the full minibatches only, except that a client with
        fewer rows than one batch keeps them as its one batch, unless it has a single row,
        which is no batch (BatchNorm cannot train on one row: the client does not train) [D]."""
        bs = batch_size or self.batch_size
        if not self.drop_last:
            return n
        if n >= bs:
            return (n // bs) * bs
        return n if n > 1 else 0

    def epoch_steps(self, n: int, batch_size: int | None = None) -> int:
        """Local steps per epoch over ``n`` rows (at least 1): the minibatches of
        ``epoch_rows``."""
        bs = batch_size or self.batch_size
        return max(math.ceil(self.epoch_rows(n, bs) / bs), 1)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> TrainSpec:
        d = dict(d or {})
        opt = OptimizerSpec(**{**d.pop("optimizer", {})})
        for key in ("diagnostics", "save_client_models"):
            if key in d:
                d[key] = tuple(d[key])
        if isinstance(opt.betas, list):
            opt = OptimizerSpec(**{**asdict(opt), "betas": tuple(opt.betas)})
        return cls(optimizer=opt, **d)


# TrainSpec fields that the config does not set (not in the schema): Experiment.runs does
INTERNAL_TRAIN_KEYS = ("engine_pairing",)
# train settings that do not change what a job computes (excluded from RunConfig.hash)
RUNTIME_TRAIN_KEYS = (
    "threads", "device", "checkpoint_every", "client_engine", "max_parallel_clients", "log_every",
    "engine_pairing", "data_storage",
)  # fmt: skip


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    options: dict[str, Any]
    model: str
    model_options: dict[str, Any]
    public: dict[str, Any] | None
    label: str
    # the task stream (fedforget.data.scenario, defaults filled in); None: the one-task case
    scenario: dict[str, Any] | None = None
    # training-time augmentation (fedforget.inputs: {kind: crop_flip, pad}); None: none
    augment: dict[str, Any] | None = None

    @property
    def id(self) -> str:
        return dataset_id(self.name, self.options)

    @property
    def public_id(self) -> str | None:
        return public_id(self.public, self.id) if self.public else None

    @property
    def pool_id(self) -> str:
        """What the private training pool is: the dataset, less a held-out public slice."""
        if self.public and self.public["source"] == "holdout":
            return self.public_id  # type: ignore[return-value]
        return self.id


@dataclass(frozen=True)
class MethodSpec:
    name: str
    params: dict[str, Any]
    label: str
    train: dict[str, Any] = field(default_factory=dict)  # overrides of the experiment's train


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = (
            deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def typed_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Give the scalars of Snakemake's nested ``--config`` values their YAML types, in place.

    [D] ``--config smoke={rounds: 3}`` is read with YAML's BaseLoader, which leaves every
    scalar inside a mapping or list a string ("3"), so the schema would reject it. Each such
    string is read again as a YAML scalar (3, 0.5, true, null; anything else stays the
    string) where it sits in ``config``, the merged config. A top-level ``key=value`` is left
    as Snakemake typed it (int, float, bool, else str)."""

    def walk(held: Any, over: Any) -> Any:
        if isinstance(over, dict) and isinstance(held, dict):
            for k, v in over.items():
                if k in held:
                    held[k] = walk(held[k], v)
            return held
        if isinstance(over, list) and isinstance(held, list) and len(over) == len(held):
            return [walk(h, o) for h, o in zip(held, over)]
        if isinstance(over, str) and held == over:
            try:
                typed = yaml.safe_load(over)
            except yaml.YAMLError:
                return held
            return typed if typed is None or isinstance(typed, (bool, int, float)) else held
        return held

    for key, over in overrides.items():
        if isinstance(over, (dict, list)) and key in config:
            config[key] = walk(config[key], over)


@dataclass(frozen=True)
class RunConfig:
    """Everything one training job needs; its hash names the job's provenance."""

    experiment: str
    dataset: DatasetSpec
    partition: PartitionSpec
    method: MethodSpec
    seed: int
    train: TrainSpec
    data_dir: str = "data"
    results_dir: str = "results"
    scale: str = "full"  # full | smoke (fedforget.smoke: the config was shrunk)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["partition"] = self.partition.to_dict()
        for key in ("scenario", "augment"):  # unset: a run keeps the hash it had before the key
            if d["dataset"][key] is None:
                del d["dataset"][key]
        if d["scale"] == "full":  # a full run keeps the hash it had before the key
            del d["scale"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        d = copy.deepcopy(d)
        part = {
            f.name: d["partition"][f.name]
            for f in fields(PartitionSpec)
            if f.name in d["partition"]
        }
        return cls(
            experiment=d["experiment"],
            dataset=DatasetSpec(**d["dataset"]),
            partition=PartitionSpec(**part),
            method=MethodSpec(**d["method"]),
            seed=int(d["seed"]),
            train=TrainSpec.from_dict(d["train"]),
            data_dir=d.get("data_dir", "data"),
            results_dir=d.get("results_dir", "results"),
            scale=d.get("scale", "full"),
        )

    @property
    def hash(self) -> str:
        """Hash of what determines the results: every setting except where and how fast
        the job runs (train.threads, train.device, train.checkpoint_every), so a job
        resumed with other threads or on another device keeps its identity."""
        return run_hash(self.to_dict())

    # paths (relative to the working directory)
    @property
    def partition_dir(self) -> Path:
        return partition_dir(self.results_dir, self.dataset, self.partition)

    @property
    def run_dir(self) -> Path:
        return (
            Path(self.results_dir) / self.experiment / self.dataset.label / self.partition.slug
            / self.method.label / f"seed{self.seed}"
        )  # fmt: skip


def run_hash(d: dict[str, Any]) -> str:
    """``RunConfig.hash`` of a run's ``to_dict()`` (``d`` is not changed)."""
    train = {k: v for k, v in d["train"].items() if k not in RUNTIME_TRAIN_KEYS}
    return config_hash({**d, "train": train})


def partition_dir(results_dir: str, ds: DatasetSpec, part: PartitionSpec) -> Path:
    return Path(results_dir) / "partitions" / ds.pool_id / part.slug


@dataclass(frozen=True)
class Experiment:
    name: str
    description: str
    datasets: list[DatasetSpec]
    partitions: list[PartitionSpec]
    methods: list[MethodSpec]
    seeds: list[int]
    train: dict[str, Any]  # raw train settings; each method may override some
    paper: dict[str, Any] | None
    figures: list[FigureSpec] = field(default_factory=list)
    # engine_pairing's answer, fixed when the config is validated (parse_config), so that a
    # config loaded from the parse cache (fedforget.parsecache) needs no method module
    pairing: str | None = None
    scale: str = "full"  # full | smoke (fedforget.smoke), recorded in every run's config

    def train_for(self, m: MethodSpec) -> TrainSpec:
        return TrainSpec.from_dict(deep_merge(self.train, m.train))

    def engine_pairing(self) -> str:
        """Why every ``client_engine: auto`` job of this experiment trains its clients one
        after another ("" if none must): methods compared in one table run on the same
        numerics, so if one method's local training cannot be batched (its hooks, optimizer
        or drop_last), the others do not take the batched engine either (it equals the
        sequential one only up to float summation order)."""
        if self.pairing is not None:
            return self.pairing
        from .methods import METHODS
        from .vectorized import method_not_vectorized

        for m in self.methods:
            t = self.train_for(m)
            why = method_not_vectorized(METHODS.get(m.name), t.optimizer.name, t.drop_last)
            if why is not None:
                return (
                    f"auto, paired within experiment '{self.name}': {why} (method '{m.label}'), so every "
                    "method of the experiment trains clients one after another (train.client_engine overrides)"
                )
        return ""

    def runs(self, data_dir: str, results_dir: str) -> list[RunConfig]:
        pairing = self.engine_pairing()
        train = {}
        for m in self.methods:
            t = self.train_for(m)
            train[m.label] = replace(t, engine_pairing=pairing) if pairing and t.client_engine == "auto" else t
        return [
            RunConfig(self.name, ds, part, m, seed, train[m.label], data_dir, results_dir, self.scale)
            for ds in self.datasets for part in self.partitions for m in self.methods for seed in self.seeds
        ]  # fmt: skip


@dataclass(frozen=True)
class FigureSpec:
    name: str  # a registered figure (fedforget.figures)
    label: str  # file stem: figures/<label>.png
    options: dict[str, Any]


@dataclass(frozen=True)
class WorkflowConfig:
    experiments: list[Experiment]
    data_dir: str = "data"
    results_dir: str = "results"
    paper_results: str = PAPER_RESULTS
    scale: str = "full"  # full | smoke (fedforget.smoke)

    def runs(self) -> list[RunConfig]:
        return [r for e in self.experiments for r in e.runs(self.data_dir, self.results_dir)]

    def experiment(self, name: str) -> Experiment:
        for e in self.experiments:
            if e.name == name:
                return e
        raise FedForgetError(
            f"unknown experiment '{name}'; allowed: {[e.name for e in self.experiments]}"
        )

    def datasets_to_prepare(self) -> dict[str, tuple[str, dict[str, Any]]]:
        """dataset id -> (name, options) for every private and public dataset used."""
        out: dict[str, tuple[str, dict[str, Any]]] = {}
        for e in self.experiments:
            for ds in e.datasets:
                out[ds.id] = (ds.name, ds.options)
                if ds.public and ds.public["source"] == "dataset":
                    out[ds.public_id] = (ds.public["dataset"], ds.public.get("options", {}))  # type: ignore[index]
        return out

    def holdouts_to_prepare(self) -> dict[str, tuple[str, dict[str, Any]]]:
        """public id -> (private dataset id, public spec) for held-out public slices."""
        return {
            ds.public_id: (ds.id, ds.public)  # type: ignore[misc]
            for e in self.experiments for ds in e.datasets
            if ds.public and ds.public["source"] == "holdout"
        }  # fmt: skip


# ----------------------------------------------------------------------------- validation (schema errors: fedforget.validation)

def check_paper_link(paper: dict[str, Any], path: str, key: str) -> None:
    """An experiment's paper link must point at rows that exist: the file (top-level key
    ``paper_results``) and at least one row of that paper and table in it."""
    import csv

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
        ok = isinstance(theirs, str) or (
            isinstance(theirs, dict) and "dataset" in theirs and set(theirs) <= {"dataset", "setting"}
        )
        if not ok:
            raise FedForgetError(
                f"{key}.dataset_map.{ours}={theirs!r}; allowed: the paper's dataset name, or {{dataset: ..., setting: ...}}"
            )



def _model(raw: Any) -> tuple[str, dict[str, Any]]:
    return (raw, {}) if isinstance(raw, str) else (raw["name"], dict(raw.get("options", {})))


def parse_config(raw: dict[str, Any]) -> WorkflowConfig:
    """Validate a raw config dict (schema, registries, sizes) and build typed objects. Every
    problem is reported in one error naming the key, the bad value and what is allowed."""
    # the checks that need torch (methods, models, scenarios, figures) are imported here, not
    # at module level: loading a validated config (fedforget.parsecache) stays torch-free
    from .data.scenario import check_rounds, resolve_scenario
    from .figures import check_figure
    from .inputs import check_augment
    from .methods import METHODS, make_params
    from .models import check_model

    check_finite(raw)  # before the schema: its range checks pass NaN
    validate_schema(raw)
    if raw.get("scale", "full") == "smoke":  # shrunk, then validated as any config
        from .smoke import smoke_config

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
            augment = check(check_augment, d.get("augment"), tuple(shape), f"{dkey}.augment")
            ds = DatasetSpec(
                d["name"], opts, mname, mopts, public, d.get("label") or dataset_id(d["name"], opts), scenario,
                augment,
            )  # fmt: skip
            if ds.label in {x.label for x in datasets}:
                problems.append(
                    f"{dkey}.label: duplicate dataset label '{ds.label}' (set a distinct label)"
                )
            datasets.append(ds)
        partitions: list[PartitionSpec] = []
        for j, p in enumerate(ex["partitions"]):
            spec = PartitionSpec(**p)
            pkey = f"{key}.partitions[{j}]"
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
        methods: list[MethodSpec] = []
        for j, m in enumerate(ex["methods"]):
            mkey = f"{key}.methods[{j}]"
            if check(METHODS.get, m["name"], f"{mkey}.name") is None:
                continue
            pobj = check(make_params, m["name"], m.get("params") or {}, f"{mkey}.params")
            if pobj is None:
                continue
            params = asdict(pobj)  # with defaults filled in
            label = m.get("label") or m["name"]
            if label in {x.label for x in methods}:
                problems.append(
                    f"{mkey}.label: duplicate method label '{label}' (give each variant its own label)"
                )
            spec = MethodSpec(m["name"], params, label, dict(m.get("train") or {}))
            methods.append(spec)
            cls = METHODS.get(m["name"])
            mtrain = TrainSpec.from_dict(deep_merge(train, spec.train))
            try:
                cls.check_train(mtrain, pobj)
            except FedForgetError as e:
                problems.append(f"{mkey}: {e}")
            # a method defined on one model alone (its class's needs_model, or a plug-in's base's: L2P)
            needs = {getattr(METHODS.get(n), "needs_model", None) for n in (m["name"], params.get("base"))
                     if isinstance(n, str) and n in METHODS} - {None}  # fmt: skip
            for ds in datasets:
                if needs and ds.model not in needs:
                    problems.append(
                        f"{key}.datasets[{datasets.index(ds)}].model: method '{label}' needs model "
                        f"{' or '.join(sorted(needs))}, got '{ds.model}'"
                    )
                dkey = f"{key}.datasets[{datasets.index(ds)}].scenario (method '{label}')"
                check(check_rounds, ds.scenario, mtrain.rounds, dkey)
                try:
                    cls.check_scenario(ds.scenario, pobj)
                except FedForgetError as e:
                    problems.append(f"{dkey}: {e}")
            late = [r for r in mtrain.save_client_models if r > mtrain.rounds]
            if late:
                problems.append(
                    f"{key}.train.save_client_models: rounds {late} are beyond train.rounds={mtrain.rounds} (method '{label}'); allowed: 1..{mtrain.rounds}"
                )
            for ds in datasets:
                if cls.trait("needs_public", pobj) and not ds.public:
                    problems.append(
                        f"{mkey}.name: method '{m['name']}' needs a public set, but dataset '{ds.label}' declares none (datasets[].public)"
                    )
        if len(set(ex["seeds"])) != len(ex["seeds"]):
            problems.append(f"{key}.seeds: duplicate seeds {ex['seeds']}")
        figures: list[FigureSpec] = []
        for j, f in enumerate(ex.get("figures") or []):
            fkey = f"{key}.figures[{j}]"
            fig = FigureSpec(f["name"], f.get("label") or f["name"], dict(f.get("options") or {}))
            check(check_figure, fig.name, fig.options, fkey)
            if fig.label in {x.label for x in figures} or fig.label in CURVES:
                problems.append(f"{fkey}.label: duplicate figure label '{fig.label}' (set a distinct label)")
            figures.append(fig)
        if ex.get("paper"):
            check(check_paper_link, ex["paper"], raw.get("paper_results", PAPER_RESULTS), f"{key}.paper")
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
    if problems:
        raise FedForgetError("invalid config:\n  " + "\n  ".join(problems))
    experiments = [replace(e, pairing=e.engine_pairing()) for e in experiments]
    return WorkflowConfig(
        experiments,
        raw.get("data_dir", "data"),
        raw.get("results_dir", "results"),
        raw.get("paper_results", PAPER_RESULTS),
        scale,
    )


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise FedForgetError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise FedForgetError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise FedForgetError(f"config file {path}: expected a mapping at the top level")
    return data


def load_config(path: str | Path) -> WorkflowConfig:
    return parse_config(load_yaml(path))


def load_run_config(path: str | Path) -> RunConfig:
    """A single job's config (as written by ``fedforget plan`` or found in run.json)."""
    d = load_yaml(path)
    d = d.get("config", d)  # accept a run.json too
    check_finite(d)
    try:
        return RunConfig.from_dict(d)
    except (KeyError, TypeError) as e:
        raise FedForgetError(f"run config {path}: missing or unexpected key {e}") from None
