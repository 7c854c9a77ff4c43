"""Typed configuration: the workflow config (experiments = datasets x partitions x methods x
seeds) is validated once, against the JSON schema and then against the registries and the
data sizes, and expanded into one ``RunConfig`` per training job."""

from __future__ import annotations

import copy
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from .data import DATASETS, dataset_id, public_id
from .partition import PartitionSpec
from .train_spec import OptimizerSpec, TrainSpec  # noqa: F401 (OptimizerSpec: re-exported)
from .utils import FedForgetError, config_hash
from .validation import check_numbers

# ----------------------------------------------------------------------------- spec objects

PAPER_RESULTS = "config/paper_results.csv"  # default of the top-level key paper_results


# TrainSpec fields that the config does not set (not in the schema): Experiment.runs does
INTERNAL_TRAIN_KEYS = ("engine_pairing",)
# train settings that do not change what a job computes (excluded from RunConfig.hash)
RUNTIME_TRAIN_KEYS = (
    "threads", "device", "checkpoint_every", "client_engine", "max_parallel_clients", "concurrent_clients", "log_every",
    "engine_pairing", "data_storage", "phase_memory",
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
    # {mean, std} per channel in place of the training split's statistics; None: those
    normalize: dict[str, Any] | None = None

    @property
    def id(self) -> str:
        return dataset_id(self.name, self.options)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """A row's shape as the model sees it (the source's, for these options), known
        before the data are built."""
        info = DATASETS.get(self.name)
        return tuple(info.input_shape(info.resolve(self.options)))

    @property
    def num_classes(self) -> int:
        return DATASETS.get(self.name).num_classes

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
    string) where it sits in ``config``, the merged config. A top-level ``key=value`` keeps
    Snakemake's type (int, float, bool, else str), except that ``true`` / ``false`` in any
    case become booleans: Snakemake reads only ``True`` / ``False`` as such, so the documented
    ``download=true`` would reach the schema as the string "true" [D]."""

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
                typed = yaml.load(over, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader (YAML 1.2 floats)
            except yaml.YAMLError:
                return held
            return typed if typed is None or isinstance(typed, (bool, int, float)) else held
        return held

    for key, over in overrides.items():
        if isinstance(over, (dict, list)) and key in config:
            config[key] = walk(config[key], over)
        elif isinstance(over, str) and over.lower() in ("true", "false") and config.get(key) == over:
            config[key] = over.lower() == "true"


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
        for key in ("scenario", "augment", "normalize"):  # unset: a run keeps the hash it had before the key
            if d["dataset"][key] is None:
                del d["dataset"][key]
        if d["scale"] == "full":  # a full run keeps the hash it had before the key
            del d["scale"]
        if d["train"]["precision"] == "fp32":  # likewise
            del d["train"]["precision"]
        if d["train"]["client_weights"] == "samples":  # likewise
            del d["train"]["client_weights"]
        if d["train"]["eval_order"] == "stored":  # likewise
            del d["train"]["eval_order"]
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
    # why every ``client_engine: auto`` job of the experiment trains its clients one after
    # another ("" if none must): fixed when the config is validated
    # (``fedforget.trainers.engine_pairing``), so that a config loaded from the parse cache
    # (fedforget.parsecache) needs no method module
    pairing: str = ""
    scale: str = "full"  # full | smoke (fedforget.smoke), recorded in every run's config

    def train_for(self, m: MethodSpec) -> TrainSpec:
        return TrainSpec.from_dict(deep_merge(self.train, m.train))

    def runs(self, data_dir: str, results_dir: str) -> list[RunConfig]:
        train = {}
        for m in self.methods:
            t = self.train_for(m)
            train[m.label] = replace(t, engine_pairing=self.pairing) if self.pairing and t.client_engine == "auto" else t
        return [
            RunConfig(self.name, ds, part.for_dataset(ds.scenario), m, seed, train[m.label], data_dir, results_dir, self.scale)
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


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key written twice in one mapping, where YAML keeps
    the last one without a word (``train: {rounds: 30, rounds: 3}`` would run 3 rounds). A
    merge (``<<: *anchor``) followed by keys that override the merged ones is YAML's override,
    not a repeat."""


def _unique_map(loader: UniqueKeyLoader, node: yaml.MappingNode):
    seen: dict[Any, yaml.Mark] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.setdefault(key, key_node.start_mark)
        except TypeError:  # an unhashable key: the mapping constructor refuses it
            continue
        if first is not key_node.start_mark:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice in one mapping (first at line {first.line + 1}); "
                f"YAML would keep the last silently", key_node.start_mark,
            )
    yield from yaml.SafeLoader.construct_yaml_map(loader, node)


UniqueKeyLoader.add_constructor("tag:yaml.org,2002:map", _unique_map)
# [D] YAML 1.2's floats: PyYAML follows YAML 1.1, whose floats need a dot, so ``lr: 5e-2`` (and
# the ``5e-05`` that JSON writes for a job's config.json) were read as strings and refused as
# "not a number"; a quoted "5e-2" stays a string
YAML12_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
UniqueKeyLoader.add_implicit_resolver("tag:yaml.org,2002:float", YAML12_FLOAT, list("-+0123456789."))


def yaml12_floats(config: Any, loaded: Any) -> Any:
    """``config`` (Snakemake's load of the config files, YAML 1.1) with the strings that
    ``loaded`` (the same files through ``load_yaml``, merged as Snakemake merges them; YAML
    1.2 floats) reads as floats at the same place made floats, each read from its own text
    (a value given again by ``--config`` keeps what was given there), in place where it can;
    anything else is left as it is."""
    if isinstance(config, dict) and isinstance(loaded, dict):
        for k in config:
            if k in loaded:
                config[k] = yaml12_floats(config[k], loaded[k])
        return config
    if isinstance(config, list) and isinstance(loaded, list) and len(config) == len(loaded):
        return [yaml12_floats(c, v) for c, v in zip(config, loaded)]
    if isinstance(config, str) and isinstance(loaded, float) and YAML12_FLOAT.match(config):
        return yaml.load(config, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    return config


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise FedForgetError(f"config file not found: {path}")
    try:
        data = yaml.load(path.read_text(), Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as e:  # one line: the file, the line and column, the problem
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        raise FedForgetError(f"config file {path}{where} is not valid YAML: {what}") from None
    if data is None:
        raise FedForgetError(f"config file {path} is empty: expected a mapping of config keys")
    if not isinstance(data, dict):
        raise FedForgetError(
            f"config file {path}: expected a mapping at the top level (of config keys), "
            f"got a {type(data).__name__}"
        )
    return data


def load_run_config(path: str | Path) -> RunConfig:
    """A single job's config (as written by ``fedforget plan`` or found in run.json)."""
    d = load_yaml(path)
    d = d.get("config", d)  # accept a run.json too
    check_numbers(d)
    try:
        return RunConfig.from_dict(d)
    except (KeyError, TypeError) as e:
        raise FedForgetError(f"run config {path}: missing or unexpected key {e}") from None
