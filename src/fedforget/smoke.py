"""``scale: smoke``: any config, shrunk so that every cell of its tables runs end to end on a
CPU in seconds [D].

A config's top-level ``scale`` is ``full`` (default: the config as written) or ``smoke``.
``parse_config`` applies :func:`smoke_config` to a schema-valid config before anything else
is checked, so the shrunk config is validated like any other (registries, shapes, partition
sizes, scenario rounds). The top-level ``smoke`` block tunes it (every key optional; ignored
at ``scale: full``, so a config file may carry it while ``--config scale=smoke`` flips the
scale)::

    smoke:
      rounds: 2         # rounds of a one-task run; a task stream gets 1 round per task
      local_epochs: 1   # local epochs at most
      tasks: 2          # tasks of a stream at most (its first ones)
      clients: 4        # clients of every partition (class_fractions partitions keep theirs)
      rows: 200         # about this many rows per split (per task of a class split):
                        # subset = max(2, ceil(rows / classes (per task))) per class
      image_size: 32    # image-folder sets' ``size``; models that resize (vit, resnet18_imagenet)
      max_length: 32    # text sets' tokens per row
      hf_model: DIR     # a local Hugging Face model directory: every ``hf`` model's
                        # name_or_path and every text set's tokenizer (machines without the hub)
      results_dir: ...  # default <results_dir>/smoke

What changes, per experiment:

- seeds: the first one; task streams: their first ``smoke.tasks`` tasks (a split keeps its
  classes per task and says ``leftover_classes: drop`` for the later tasks' classes; a stream of a dataset's domains keeps the dataset's
  first ``smoke.tasks`` domains, its ``domains`` option); train (and every method's train override):
  ``local_epochs`` at most ``smoke.local_epochs`` (1; a config whose diagnostics exist only
  from a client's second step, as FedSOL's cos(g_u, g_p), sets 2 in its ``smoke`` block),
  ``rounds`` ``smoke.rounds`` (at most the configured value), or, when a
  dataset declares a task stream with ``rounds_per_task``, one round per task (``rounds`` =
  the least common multiple of the streams' task counts, each ``rounds_per_task`` = rounds /
  tasks, so the stream stays valid; asynchronous windows of more rounds than that become one
  round each, and hold at least ``smoke.rows`` samples, so that each reaches a client's next
  task); ``sample_rate`` raised so that at least 2 clients of ``smoke.clients``
  train per round (at least 1 anyway: ``engine.sample_clients``); ``save_client_models``
  and figure ``rounds`` and ``round`` options kept within the rounds; figures' compute budgets
  (:data:`FIGURE_BUDGETS`: fedsol_landscape's rows, iterations and grid) at most the smoke value;
- partitions: ``clients`` at most ``smoke.clients``, Dirichlet ``min_size`` at most 2
  (a few hundred rows cannot give every client 10 with small alpha) and ``min_per_class`` 0
  (a smoke pool, or one task's share of it, may hold a single row of a class), shards'
  ``shard_rule`` the default (4 clients' shards may be fewer than the classes, which
  ``per_class`` refuses); partitions that become identical are run once;
- datasets and their public sets: the generic dataset option ``subset`` (first N rows per
  class in each split, ``fedforget.data.base.SUBSET``: about ``smoke.rows`` rows per split,
  or per task of a class split, so that a task's clients hold more than a handful of rows),
  ``size`` at most ``image_size``,
  ``max_length`` at most ``smoke.max_length``, ``tokenizer`` = ``hf_model`` when given; a
  dataset keeps the label it has at full scale, so paper links (``dataset_map``) still match;
- models: ``pretrained: false`` wherever a model takes it (pretrained weights need the
  network; CI has none), ``resnet18_imagenet``'s ``input_size`` and ``vit``'s ``image_size``
  = ``image_size`` (no resize to 224; with ``stem: cifar`` inputs resized to 8 px, where its
  layers run at the sizes torchvision's stem gives 32 px), ``vit`` a 2-layer, 64-wide ViT with 8x8 patches (a
  ViT-B/16 is 86M parameters per client model; ``freeze_stages`` at most 1), ``hf`` one encoder layer
  (``config.num_hidden_layers``) and ``name_or_path`` = ``hf_model`` when given;
- methods: the compute budgets that methods declare as hyperparameters (:data:`BUDGETS`:
  gradient-inversion and generator iterations, synthesis rounds and batches, distillation
  epochs, memory batches, warm-up rounds, FOT's sketch width), at most the smoke value, also
  inside ``base_params`` of methods that run over a base;
- ``results_dir``: ``smoke.results_dir``, default ``<results_dir>/smoke``: smoke outputs
  never mix with real ones. ``data_dir`` is unchanged (the raw-data directory defaults to
  ``<data_dir>/raw``); smoke datasets have their own ids (``subset`` is in the id).

Every run records ``scale: smoke`` in its config (run.json), and its config hash differs from
the full run's (the settings above are in it).
"""

from __future__ import annotations

import copy
import math
from dataclasses import MISSING, fields
from typing import Any

from .utils import FedForgetError, canonical_json

SCALES = ("full", "smoke")
DEFAULTS: dict[str, Any] = {
    "rounds": 2,
    "local_epochs": 1,
    "tasks": 2,
    "clients": 4,
    "rows": 200,
    "image_size": 32,
    "max_length": 32,
    "hf_model": None,
    "results_dir": None,
}
MIN_PER_CLASS = 2  # rows of each class kept at least (a class of one row cannot be split)
MIN_SAMPLED = 2  # clients trained per round at least (aggregation over more than one)
DIRICHLET_MIN_SIZE = 2
# the smoke ViT: same code path as ViT-B/16 (patch embedding, encoder, class token), tiny
VIT = {"layers": 2, "heads": 2, "hidden_dim": 64, "mlp_dim": 128}
VIT_PATCH = 8
HF_LAYERS = 1
# method hyperparameters that are iteration budgets: at most this in a smoke run (only
# methods whose Params declare the key are touched)
BUDGETS: dict[str, int] = {
    # GLFC / LGA: the proxy server's gradient perturbation and L-BFGS inversion
    "perturb_iters": 2,
    "recon_iters": 2,
    "recon_inner": 2,
    "recon_keep": 2,
    # TARGET / LANDER: data-free synthesis at task ends
    "syn_rounds": 2,
    "g_steps": 2,
    "warmup": 1,
    "syn_batch": 8,
    "syn_size": 32,
    "student_steps": 2,
    "student_batch": 8,
    # server distillation (FedDF, FedET, FedProj, CFeD) and per-step memory batches (FedProj's
    # public-set reference gradient, A-GEM's and DER's replay)
    "distill_epochs": 1,
    "memory_batch_size": 32,
    # FedProj: no projection in the first n rounds / last n rounds (a 2-round run projects)
    "proj_warmup_rounds": 1,
    "proj_cooldown_rounds": 0,
}
# the compute budgets of experiment figures (their options), at most these at smoke scale:
# fedsol_landscape's Hessian power iteration and loss grid
FIGURE_BUDGETS: dict[str, dict[str, int]] = {"fedsol_landscape": {"rows": 64, "iters": 5, "top": 5, "points": 5}}
# float budgets: FOT's Gaussian sketch has sketch_factor x d_l columns per layer (5 x 4608
# for ResNet-18's last convolutions: minutes of float64 eigendecomposition per task end)
FLOAT_BUDGETS: dict[str, float] = {"sketch_factor": 0.1}


def smoke_settings(raw: dict[str, Any]) -> dict[str, Any]:
    return {**DEFAULTS, **(raw.get("smoke") or {})}


def smoke_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A schema-valid config at ``scale: smoke`` shrunk as the module says (a new dict;
    ``raw`` is not changed). Names that no registry knows are left as they are, for the
    validation that follows to report."""
    s = smoke_settings(raw)
    out = copy.deepcopy(raw)
    out["scale"] = "smoke"
    out["results_dir"] = s["results_dir"] or f"{str(raw.get('results_dir', 'results')).rstrip('/')}/smoke"
    for ex in out["experiments"]:
        # each dataset entry its own (deepcopy keeps YAML anchors shared: one scenario block
        # shrunk twice, once per experiment naming it, left 2 tasks beside 6 domains)
        ex["datasets"] = [copy.deepcopy(d) for d in ex["datasets"]]
        _experiment(ex, s)
    return out


# ----------------------------------------------------------------------------- experiments


def _experiment(ex: dict[str, Any], s: dict[str, Any]) -> None:
    ex["seeds"] = ex["seeds"][:1]
    for d in ex["datasets"]:
        sc = d.get("scenario")
        if sc and sc.get("kind") == "domains":
            _first_domains(d, int(s["tasks"]))
        elif sc and int(sc.get("tasks", 1)) > int(s["tasks"]):
            sc["tasks"] = int(s["tasks"])
            if sc.get("kind") == "split":  # the later tasks' classes: left out on purpose
                sc["leftover_classes"] = "drop"
    rounds, per_task = _rounds(ex, s)
    for d in ex["datasets"]:
        _dataset(d, s)
        sc = d.get("scenario")
        if per_task is not None and sc and sc.get("rounds_per_task") is not None:
            sc["rounds_per_task"] = rounds // int(sc.get("tasks", 1))
        b = sc.get("boundaries") if sc else None
        if isinstance(b, dict):  # windows within the rounds, each reaching a client's next task
            # (a client's task holds at most about smoke.rows rows: Scenario.check_windows)
            sc["boundaries"] = {
                "samples_per_window": max(int(b["samples_per_window"]), int(s["rows"])),
                "window_rounds": 1 if b.get("window_rounds", 1) > rounds else b["window_rounds"],
            }
    parts, seen = [], set()
    for p in ex["partitions"]:
        p = _partition(p, s)
        key = canonical_json(p)
        if key not in seen:
            seen.add(key)
            parts.append(p)
    ex["partitions"] = parts
    clients = max(int(p["clients"]) for p in parts)
    ex["train"] = _train(ex.get("train") or {}, rounds, per_task is not None, clients, s, top=True)
    for m in ex["methods"]:
        if m.get("train"):
            m["train"] = _train(m["train"], rounds, per_task is not None, clients, s, top=False)
        _method(m)
    for f in ex.get("figures") or []:
        opts = f.get("options") or {}
        r = opts.get("rounds")
        if isinstance(r, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in r):
            opts["rounds"] = [v for v in r if v <= rounds] or [rounds]
        one = opts.get("round")  # a figure of one round (layer_lambda, buffer_tasks): the last one, if beyond
        if isinstance(one, int) and not isinstance(one, bool) and one > rounds:
            opts["round"] = rounds
        for k, cap in FIGURE_BUDGETS.get(f.get("name"), {}).items():
            v = opts.get(k)
            opts[k] = cap if not isinstance(v, int) or isinstance(v, bool) else min(v, cap)
        f["options"] = opts


def _rounds(ex: dict[str, Any], s: dict[str, Any]) -> tuple[int, int | None]:
    """(the smoke rounds, the task count they cover or None): one round per task when a
    dataset declares a stream with ``rounds_per_task`` (the lcm of the task counts, so
    every stream of the experiment fits the one ``train.rounds``), else smoke.rounds."""
    tasks = [
        int(d["scenario"].get("tasks", 1))
        for d in ex["datasets"]
        if d.get("scenario") and d["scenario"].get("rounds_per_task") is not None
    ]
    if tasks:
        lcm = math.lcm(*tasks)
        return lcm, lcm
    configured = (ex.get("train") or {}).get("rounds", 50)
    return min(int(configured), int(s["rounds"])), None


def _train(t: dict[str, Any], rounds: int, stream: bool, clients: int, s: dict[str, Any], top: bool) -> dict[str, Any]:
    t = copy.deepcopy(t)
    if top or "rounds" in t:  # a method's own rounds: at most smoke.rounds (streams: the stream's)
        t["rounds"] = rounds if stream or top else min(int(t["rounds"]), int(s["rounds"]))
    r = int(t.get("rounds", rounds))
    if top or "local_epochs" in t:
        t["local_epochs"] = min(int(t.get("local_epochs", 1)), int(s["local_epochs"]))
    if "sample_rate" in t:
        floor = min(1.0, MIN_SAMPLED / max(1, min(clients, int(s["clients"]))))
        t["sample_rate"] = max(float(t["sample_rate"]), floor)
    if t.get("save_client_models"):
        t["save_client_models"] = [v for v in t["save_client_models"] if v <= r] or [r]
    return t


def _partition(p: dict[str, Any], s: dict[str, Any]) -> dict[str, Any]:
    p = dict(p)
    if p["scheme"] != "classes":  # a class-fraction matrix has one row per client
        p["clients"] = min(int(p["clients"]), int(s["clients"]))
    if p["scheme"] == "dirichlet":
        p["min_size"] = min(int(p.get("min_size", 10)), DIRICHLET_MIN_SIZE)
        p.pop("min_per_class", None)  # 0, the default: a smoke pool may hold one row of a class
    p.pop("shard_rule", None)  # the default: a few clients' shards cannot cut every class alike
    return p


# ----------------------------------------------------------------------------- data and models


def _options(
    name: str, options: dict[str, Any] | None, s: dict[str, Any], scenario: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """A dataset's options shrunk (None for a name no registry knows: left as it is): about
    ``smoke.rows`` rows per split, or per task of a class split (``scenario``), whose
    clients would otherwise hold a few rows of a task (a BatchNorm batch of 2 rows at a
    1x1 feature map makes the step's gradient explode)."""
    from .data import DATASETS
    from .data.base import SUBSET

    if name not in DATASETS:
        return None
    info = DATASETS.get(name)
    o = dict(options or {})
    classes = info.num_classes
    if scenario and scenario.get("kind") == "split" and scenario.get("classes_per_task"):
        classes = min(classes, int(scenario["classes_per_task"]))
    per_class = max(MIN_PER_CLASS, math.ceil(int(s["rows"]) / classes))
    o[SUBSET] = min(int(o[SUBSET]), per_class) if o.get(SUBSET) else per_class
    for key, cap in (("size", s["image_size"]), ("max_length", s["max_length"])):
        if key in info.defaults:
            value = o.get(key, info.defaults[key])
            o[key] = min(int(value), int(cap)) if isinstance(value, int) and not isinstance(value, bool) else value
    if "tokenizer" in info.defaults and s["hf_model"]:
        o["tokenizer"] = str(s["hf_model"])
    return o


def _first_domains(d: dict[str, Any], cap: int) -> None:
    """A stream of a dataset's domains (scenario kind ``domains``): the dataset's first
    ``cap`` domains (its ``domains`` option), and as many tasks, so ``tasks`` still equals
    the number of domains. Left as it is where the config is invalid (validation says why)."""
    from .data import DATASETS, dataset_id

    if d["name"] not in DATASETS or "domains" not in DATASETS.get(d["name"]).defaults:
        return
    info = DATASETS.get(d["name"])
    try:
        domains = info.domains(info.resolve(d.get("options")))
        label = d.get("label") or dataset_id(d["name"], d.get("options"))
    except FedForgetError:
        return
    sc = d["scenario"]
    if len(domains) <= cap or int(sc.get("tasks", 1)) != len(domains):
        return
    d["label"] = label  # the full-scale label: paper links stay as they were
    d["options"] = {**(d.get("options") or {}), "domains": list(domains[:cap])}
    sc["tasks"] = cap


def _dataset(d: dict[str, Any], s: dict[str, Any]) -> None:
    from .data import dataset_id

    opts = _options(d["name"], d.get("options"), s, d.get("scenario"))
    if opts is None:
        return
    if not d.get("label"):  # the full-scale label: paper links and labels stay as they were
        try:
            d["label"] = dataset_id(d["name"], d.get("options"))
        except FedForgetError:
            pass  # bad options: the validation reports them
    d["options"] = opts
    pub = d.get("public")
    if pub and pub.get("source") == "dataset":
        popts = _options(pub["dataset"], pub.get("options"), s)
        if popts is not None:
            pub["options"] = popts
    d["model"] = _model(d["model"], s)


SMOKE_CIFAR_STEM = 8  # px: resnet18_imagenet with stem cifar at smoke scale (_model)

def _model(model: Any, s: dict[str, Any]) -> Any:
    from .models import MODEL_DEFAULTS

    name, opts = (model, {}) if isinstance(model, str) else (model["name"], dict(model.get("options") or {}))
    defaults = MODEL_DEFAULTS.get(name)
    if defaults is None:
        return model
    size = int(s["image_size"])
    if "pretrained" in defaults:
        opts["pretrained"] = False
    if name == "resnet18_imagenet" and opts.get("input_size", defaults["input_size"]):
        opts["input_size"] = size
    if name == "resnet18_imagenet" and opts.get("stem") == "cifar":
        # the 3x3 stride-1 stem keeps a 32 px image's maps 16 times larger than torchvision's
        # stem: at SMOKE_CIFAR_STEM px its layers run at the sizes torchvision's gives 32 px
        opts["input_size"] = min(int(opts.get("input_size") or size), SMOKE_CIFAR_STEM)
    if name == "vit":
        patch = next(p for p in (VIT_PATCH, 4, 2, 1) if size % p == 0)
        opts.update(VIT, image_size=size, patch_size=patch)
        if opts.get("freeze_stages"):  # some blocks left to train
            opts["freeze_stages"] = min(int(opts["freeze_stages"]), VIT["layers"] - 1)
    if name == "hf":
        cfg = dict(opts.get("config") or {})
        cfg["num_hidden_layers"] = min(int(cfg.get("num_hidden_layers", HF_LAYERS)), HF_LAYERS)
        opts["config"] = cfg
        if s["hf_model"]:
            opts["name_or_path"] = str(s["hf_model"])
    if not opts:
        return model
    return {"name": name, "options": opts}


# ----------------------------------------------------------------------------- methods


def _param_defaults(name: str) -> dict[str, Any] | None:
    from .methods import METHODS

    if name not in METHODS:
        return None
    out = {}
    for f in fields(METHODS.get(name).Params):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


def _budgets(name: str, params: dict[str, Any]) -> dict[str, Any]:
    defaults = _param_defaults(name)
    if defaults is None:
        return params
    p = dict(params)
    for key, cap in BUDGETS.items():
        if key not in defaults:
            continue
        value = p.get(key, defaults[key])
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            p[key] = cap
    for key, fcap in FLOAT_BUDGETS.items():
        value = p.get(key, defaults.get(key))
        if key in defaults and isinstance(value, (int, float)) and not isinstance(value, bool) and value > fcap:
            p[key] = fcap
    base = p.get("base", defaults.get("base"))
    if "base_params" in defaults and isinstance(base, str):
        p["base_params"] = _budgets(base, dict(p.get("base_params") or defaults["base_params"] or {}))
        if not p["base_params"] and "base_params" not in params:
            del p["base_params"]
    return p


def _method(m: dict[str, Any]) -> None:
    params = _budgets(m["name"], dict(m.get("params") or {}))
    if params or "params" in m:
        m["params"] = params
