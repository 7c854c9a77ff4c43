"""Expected time of each paper table config on one GPU (issue 17, item 8): an estimate from
measured times per round, scaled by each run's arithmetic.

Measured inputs (files under ``benchmarks/results``, overridable):

* ``--gpu``: ``paper_gpu.json`` (``benchmarks/paper_gpu.py`` on a lent H100). It gives
  FedAvg's seconds per round on the batched ("vectorized") engine and FedSOL's (head
  perturbation) on the sequential one. The setting is FedSOL Table 1's CIFAR-10 layout:
  McMahan CNN, 50,000 rows, 10 % of 100 clients per round, 5 local epochs, and global test
  evaluation on 10,000 rows every round.
* ``--method-cost``: ``method_cost.json`` files (``benchmarks/method_cost.py``, CPU:
  2026-11-25's, and ``cpu-2026-12-05-d/method_cost_fedsol_bases.json`` for FedSOL combined with
  the bases of its Table 4). Each one-task method's time per round relative to FedAvg on the
  same engine.
* ``--continual-cost``: ``continual_cost.json`` files (``benchmarks/continual_cost.py``, CPU:
  ``cpu-2026-12-06-e``'s, every continual baseline with Tar+LODE and Fed+SCR (2026-11-25's and
  2026-12-05's before it), and for L2P and FedGP over L2P
  ``cpu-2026-12-05-d/continual_cost_vit.json``, on a ViT of the paper ViT-B/16's 197 tokens,
  and FedGP over each of its other bases ``cpu-2026-12-05-d/continual_cost_fedgp_bases.json``,
  each against its own FedAvg on the same model). The same ratio for the continual
  baselines, as the median over a task's rounds. TARGET's (and
  Tar+LODE's) is rescaled by its replay rows per step at the run's scale (``target_replay``):
  on digits it replays 40x a batch, on ImageNet-R about 14x.
* ``--task-end-cost``: ``cpu-2026-12-05-e/task_end_cost-{1,2,3,4}.json``,
  ``cpu-2026-12-05-f/task_end_cost-{5,8,9}.json`` and ``cpu-2026-12-06-i/task_end_cost-{10,...,14}.json``
  (``benchmarks/task_end_cost.py``, CPU): each paper setting's task end (bases, exemplars) as
  training inputs (below).

The model (``estimate_run``), per run of a config:

    FLOPs/round  = 3 F x S x m + F x E
    time         = rounds x FLOPs/round / R_engine

The terms:

* F: the model's forward FLOPs per input, counted by ``torch.utils.flop_counter`` on the
  config's model at the dataset's input shape. Pretrained weights are not loaded. A Hugging
  Face model is built from its hub config, or from the published shapes in ``HF_SHAPES``
  when the hub cannot be reached.
* The factor 3: a training step is one forward pass and one backward pass of about twice the
  forward's FLOPs. It is 1 for a frozen encoder (``freeze_encoder``), whose head alone trains.
* Frozen stages (the model option ``freeze_stages``, FedProTIP's tables): after the first
  task a step is a forward pass and a backward pass through the layers that train only
  (nothing before the frozen stem and stages trains, so no gradient reaches them): 3 - 2 h
  passes, h the frozen layers' share of the forward FLOPs (``held_share``), averaged over the
  run's tasks (equal rounds each). A measured rate (``--model-rates``, timed with every layer
  training) is scaled by the same factor, taking time as proportional to FLOPs [D].
* A frozen encoder with its features kept (``feature_cache``, the ``hf`` model's default since
  the seventh session of 2026-12-02) runs once per distinct row of the run instead:

      FLOPs = F x (training rows of every task + test rows) + rounds x (3 F_h x S x m + F_h x E)

  with F_h the head's forward FLOPs per input (2 x hidden x classes). Such a run's time is
  then bound by its local steps (``local_steps`` in the JSON), which this FLOP model does not
  count: read its hours as the encoder's share only.
* S: training inputs per round. That is sample rate x the rows of a task x local epochs. A
  split stream's task holds its classes' share of the rows; a ``domains`` stream's task one
  domain's rows, taken as the training rows divided by the tasks (before the eleventh session
  of 2026-12-05 every row: 6 times a DomainNet task's training); a rotated or permuted
  stream's task every row.
* m: the method's measured ratio to FedAvg (1 where none was measured, flagged "m?"). A
  method over a base (``params.base``: FedGP over L2P) takes ``<method>+<base>``'s ratio where
  one was measured (``fedgp+l2p``), else its own.
* E: evaluated inputs per round. Global evaluation covers every ``eval_every`` rounds and
  scores every task's test rows: the test set, times the tasks in a rotated or permuted
  stream, whose every task transforms all of it (counted once before the eleventh session of
  2026-12-05). Local models are evaluated every round where ``eval_local_models``: the
  sampled clients times those rows.
* R_engine: the FLOP rate measured in the calibration setting, one per engine:
  * batched, from FedAvg;
  * sequential, from FedSOL divided by its m.

  A run takes the engine ``client_engine: auto`` picks for it on a GPU (``gpu_engine``:
  ``trainers.choose_trainer`` on its method, its experiment's pairing and its model, as
  ``engine_coverage.py`` counts them; since 2026-12-02, before which only the method and the
  pairing were read); clients on lanes count as the sequential engine.

What this leaves out, so read the hours as an order of magnitude:

* **The rates are those of a small CNN.** Larger models (ResNet-18, ViT-B/16, BERT) keep a
  GPU busier per FLOP, so their estimates are likely too high.
* **The measured ratios m come from a CPU.**
* **Work outside the steady rounds** is counted for the task ends (TARGET's, Tar+LODE's and
  LANDER's synthesis; the other methods' bases and exemplars) and GLFC's reconstructions
  (below). Server distillation over a public set runs every round: m includes it.

**GLFC's reconstructions** (GLFC, LGA, FedGP over either; since the eleventh session of
2026-12-05): at the first round of every task each sampled client sends a prototype gradient
per class of its task data, and the proxy server inverts each by ``recon_iters`` L-BFGS steps
on a small LeNet at batch 1, bound by latency, not FLOPs. ``recon_samples`` counts them per
run (an upper bound: every sampled client holding every class of its task [D]); with
``--recon-cost`` (``benchmarks/recon_cost.py``'s seconds per sample on one device) each table
gets ``recon_hours``, which join ``measured_hours`` where ``--model-rates`` are of the same
device. The FLOP model's hours (``gpu_hours``) leave them out.

**The other task ends** (FedProTIP's core bases and references, GPM's and FOT's bases,
iCaRL's, GLFC's and LGA's exemplars, FedGP over iCaRL or GLFC; since the twelfth session of
2026-12-05, before which they were left out): ``--task-end-cost`` (``benchmarks/task_end_cost.py``,
this CPU) gives each setting's task end (``task_end_setting``: method params but the
thresholds, model, input shape, a task's classes, heads, clients, those that do the task end's
client work, rows per client) as the
training inputs the same machine processes in its time. A run has one per task (the last
task's too), each timed as that many training inputs of the run (3 F each, at the run's
engine's rate; at its setting's ``samples_per_s`` with ``--model-rates``) [D: the ratio of a
task end to training measured on a CPU taken to hold on a GPU, as m is]: ``task_end_pflop``
per table; ``task_end_unmeasured_runs`` the runs with task ends the file has no row for
(counted as none).

**Synthesis at task ends** (TARGET, Tar+LODE, LANDER; since the eleventh session of
2026-12-05, before which it was left out): after every task but the last the server trains a
generator against the global model and, from its ``warmup`` on, a student on the pool. The
rows each network sees come from the method's own synthesizer schedule (``synthesis_rows``:
its ``rounds``, ``adversarial``, ``stores``, ``trains_student`` on the run's params), and

    FLOPs/task end = G x (3 F_g + 2 F) + A x 3 F + K x (F + 3 F)

with G the generator steps' rows (every round's ``g_steps`` x ``syn_batch``; the frozen
teacher runs forward and backward to its inputs, 2 F), A those of the boundary term's rounds
(the student's forward and backward), K the student's KD rows (a teacher forward, a student
step) and F_g the generator's forward FLOPs per row (``make_decoder``: LANDER's label layers
are not counted). [D] It runs one model at large batches on the server, so it is timed at
the batched rate (measured per model: at the setting's FedAvg training rate, 3 F a row)
whichever engine trains the clients.
* **The data pipeline is not modelled:** augmentation, streaming from disk, tokenization.

``benchmarks/paper_gpu.py`` measures a config's real time per round on a lent GPU.

**Measured per model** (``--model-rates``, issue 32 item 6): the files ``benchmarks/model_rates.py``
wrote on one device (``benchmarks/gpu.sh``'s section ``rates``) give each distinct (model,
options, input shape, batch) its own rates on each engine (a run is looked up on the one
``client_engine: auto`` picks for it on the files' device): local training in samples/s
(FedAvg, ``samples_per_s``) and the global model's evaluation in rows/s
(``eval_samples_per_s``). A run whose setting and engine were measured is then timed without
FLOPs (``measured_run``):

    time = rounds x (S x m / R_train + E / R_eval)

and a frozen encoder whose features are kept, ``distinct rows / R_eval + rounds x S x m /
R_train`` (its timed training rounds read kept features: the head's steps). The method's
ratio m and the evaluated inputs E are those above; a row without an evaluation rate (an
older file) counts evaluation at 3 x R_train (a forward pass of the three a step has), and
says so. The other runs keep the FLOP model's time. Per table, ``measured_hours`` is the sum
(``measured_runs`` of its runs at measured rates) beside ``gpu_hours``, the FLOP model's.

**Repeated trainings** (``training_key``): a run whose training another run of the configs
already does, bit for bit, in the order the configs are given (a table that reruns Table 1's
runs under its own experiment name "so the table stands alone", a figure's centre point
repeated in each panel, a run that differs only in what is evaluated or recorded), counts in
``repeat_runs`` / ``repeat_hours`` of the config it is in (``distinct_hours``: the rest). The
identity is the run's (``RunConfig.hash``) without its experiment name and labels, the
method's own train overrides (merged into the run's train settings), its evaluation and
diagnostics settings (``EVALUATION_KEYS``) and the scenario's ``incremental`` (a task-IL run
trains the class-IL run: tests/methods/test_task_il.py), with the client engine it asks for
and whether its experiment pairs engines (``engine_pairing``: the engines agree up to float
summation order only). Each config still runs its repeats as it is: the pipeline keys a run
by its experiment.

    python benchmarks/paper_runtime.py                     # every config/experiments/paper/*.yaml
    python benchmarks/paper_runtime.py --json runtime.json --markdown runtime.md
    python benchmarks/paper_runtime.py --model-rates results/<gpu>-<date>/rates.json --json runtime.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from fedforget.config import RunConfig, run_hash
from fedforget.data import DATASETS
from fedforget.methods import METHODS, make_params
from fedforget.methods.base import TASK_END
from fedforget.models import build_model
from fedforget.parse import parse_config
from fedforget.schedule import sample_clients
from fedforget.trainers import choose_trainer

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
TASK_END_FILES = [("cpu-2026-12-05-e", 1), ("cpu-2026-12-05-e", 2), ("cpu-2026-12-05-e", 3), ("cpu-2026-12-05-e", 4),
                  ("cpu-2026-12-05-f", 5), ("cpu-2026-12-05-f", 8), ("cpu-2026-12-05-f", 9),
                  ("cpu-2026-12-06-i", 10), ("cpu-2026-12-06-i", 11), ("cpu-2026-12-06-i", 12),
                  ("cpu-2026-12-06-i", 13), ("cpu-2026-12-06-i", 14)]  # task_end_cost.py (folder, file number)
RECONSTRUCTING = ("glfc", "lga")  # the methods with GLFC's proxy server (LGA subclasses it)
# train settings that change what is evaluated or recorded, not what trains (training_key):
# the evaluation runs in eval mode and restores the model, the diagnostics read the uploads or
# take gradients without a step (engine.py, metrics.py). Not eval_batch_size: CFeD's teacher
# scores and FedDF's public logits, which train, are computed in chunks of it (found in review)
EVALUATION_KEYS = ("eval_every", "eval_local_models", "diagnostics")


def training_key(rc: RunConfig) -> str:
    """What a run trains (``Repeated trainings`` above): ``RunConfig.hash`` without the
    experiment name, the method's and dataset's labels, the method's train overrides (in
    ``train`` already), ``EVALUATION_KEYS`` and the scenario's ``incremental``; with the
    engine it asks for and whether its experiment pairs engines."""
    d = rc.to_dict()
    d.pop("experiment", None)
    d["method"] = {**d["method"], "label": None, "train": None}
    scenario = d["dataset"].get("scenario")
    if scenario:
        scenario = {**scenario, "incremental": None}
    d["dataset"] = {**d["dataset"], "label": None, "scenario": scenario}
    d["train"] = {k: v for k, v in d["train"].items() if k not in EVALUATION_KEYS}
    d["engine"] = [rc.train.client_engine, bool(rc.train.engine_pairing)]
    return run_hash(d)


def config_runs(path: str | Path) -> list[RunConfig]:
    """Every run of one experiment config (``config/config.yaml``'s defaults under it, the
    repository's paper results)."""
    raw = {**yaml.safe_load((REPO / "config/config.yaml").read_text()), **yaml.safe_load(Path(path).read_text())}
    raw["paper_results"] = str(REPO / "config/paper_results.csv")
    return parse_config(raw).runs()
# NVIDIA H100 SXM's dense FP32 peak (datasheet): the compute floor of the estimate's lower end
FP32_PEAK = 67e12
# the calibration setting of benchmarks/paper_gpu.py (FedSOL Table 1, CIFAR-10 shaped)
CALIBRATION = {"model": "cnn_mcmahan", "shape": (3, 32, 32), "classes": 10, "train_per_round": 0.1 * 50_000 * 5,
               "eval_per_round": 10_000}  # fmt: skip
# published encoder shapes (config.json of each hub id), for FLOP counting where the hub is not
# reachable; only the shapes matter (weights are never loaded here)
HF_SHAPES = {
    "huawei-noah/TinyBERT_General_4L_312D": ("bert", {"hidden_size": 312, "num_hidden_layers": 4, "num_attention_heads": 12, "intermediate_size": 1200}),
    "distilbert-base-uncased": ("distilbert", {"dim": 768, "n_layers": 6, "n_heads": 12, "hidden_dim": 3072}),
}  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=sorted(str(f) for f in (REPO / "config/experiments/paper").glob("*.yaml")))
    p.add_argument("--gpu", default=str(RESULTS / "h100-2026-11-24-paper/paper_gpu.json"))
    p.add_argument("--method-cost", nargs="+", default=[str(RESULTS / "cpu-2026-11-25/method_cost.json"),
                                                      str(RESULTS / "cpu-2026-12-05-d/method_cost_fedsol_bases.json")],
                   help="method_cost.py --json files: a method in several files, the first's")
    p.add_argument("--continual-cost", nargs="+", default=[str(RESULTS / "cpu-2026-12-06-e/continual_cost.json"),
                                                          str(RESULTS / "cpu-2026-12-05-d/continual_cost_vit.json"),
                                                          str(RESULTS / "cpu-2026-12-05-d/continual_cost_fedgp_bases.json")],
                   help="continual_cost.py --json files, each with its own FedAvg: a method in several files, the first's")
    p.add_argument("--model-rates", nargs="*", default=[],
                   help="benchmarks/model_rates.py --json files of one device: runs of the settings they measured "
                        "are timed at those rates (measured_hours); a setting in several files: the last file's row")
    p.add_argument("--recon-cost", default=None,
                   help="benchmarks/recon_cost.py --json file: GLFC's reconstructions timed at its seconds per sample "
                        "(recon_hours; added to measured_hours where --model-rates are of the same device)")
    p.add_argument("--task-end-cost", nargs="*", default=[str(RESULTS / f"{d}/task_end_cost-{i}.json") for d, i in TASK_END_FILES],
                   help="benchmarks/task_end_cost.py --json files: each run's task ends (bases, exemplars) as that many "
                        "training inputs (none given: none counted)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    return p.parse_args()


# ----------------------------------------------------------------------------- FLOPs
def forward_flops(model: torch.nn.Module, shape: tuple[int, ...], text: bool) -> float:
    """Forward FLOPs per input of ``model`` on inputs of ``shape`` (torch's flop counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.zeros((2, *shape), dtype=torch.long) if text else torch.randn(2, *shape)
    if text:
        x[:, 1] = 1  # attention mask: every token
    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x)
    return counter.get_total_flops() / 2


def held_share(model: torch.nn.Module, shape: tuple[int, ...]) -> float:
    """The share of ``model``'s forward FLOPs per input in the layers it holds from the
    second task on (``Classifier.held``: ``freeze_stages``), 0 without: the FLOPs of each
    outermost module whose parameters are all held."""
    from torch.utils.flop_counter import FlopCounterMode

    held = getattr(model, "held", frozenset())
    if not held:
        return 0.0
    mods = {n: m for n, m in model.named_modules() if n and list(m.parameters())
            and all(f"{n}.{k}" in held for k, _ in m.named_parameters())}  # fmt: skip
    outer = [n for n in mods if not any(n.startswith(f"{o}.") for o in mods)]
    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randn(2, *shape))
    counts = counter.get_flop_counts()
    top = type(model).__name__
    part = sum(sum(counts.get(f"{top}.{n}", {}).values()) for n in outer)
    return part / counter.get_total_flops()


def training_passes(h: float, tasks: int) -> float:
    """Passes per training input (forward 1, backward 2), averaged over ``tasks`` tasks of
    equal rounds, where after the first task a share ``h`` of the forward FLOPs sits in frozen
    layers that no backward pass reaches: 3 then 3 - 2h."""
    return (3.0 + (tasks - 1) * (3.0 - 2.0 * h)) / tasks


def hf_config(name_or_path: str, options: dict[str, Any]):
    """The transformers config of a hub encoder from its published shapes (``HF_SHAPES``),
    with the run's ``config`` overrides: no hub call."""
    from transformers import BertConfig, DistilBertConfig

    if name_or_path not in HF_SHAPES:
        raise KeyError(f"no shapes known offline for {name_or_path!r} (add it to HF_SHAPES)")
    kind, dims = HF_SHAPES[name_or_path]
    return (BertConfig if kind == "bert" else DistilBertConfig)(**dims, **dict(options.get("config") or {}))


def hf_offline(name_or_path: str, shape: tuple[int, ...], classes: int, options: dict[str, Any]) -> torch.nn.Module:
    """The ``hf`` model built from ``HF_SHAPES`` (no hub), with the config's overrides,
    pooling and frozen encoder; randomly initialised."""
    from transformers import AutoModel

    from fedforget.models import Classifier, HFBody

    cfg = hf_config(name_or_path, options)
    frozen, cache = bool(options.get("freeze_encoder", False)), bool(options.get("feature_cache", True))
    body = HFBody(AutoModel.from_config(cfg), options.get("pooling", "cls"), frozen, cache)
    return Classifier(body, cfg.hidden_size, classes)


_FLOPS: dict[str, tuple[float, str, torch.nn.Module]] = {}


def model_flops(
    name: str, options: dict[str, Any], shape: tuple[int, ...], classes: int
) -> tuple[float, str, torch.nn.Module]:
    """(forward FLOPs per input, how they were counted, the model counted: its engine choice,
    ``gpu_engine``), cached per model and shape."""
    key = json.dumps([name, options, shape, classes], sort_keys=True)
    if key not in _FLOPS:
        opts = {k: v for k, v in options.items() if k != "pretrained"}
        if "pretrained" in options or name in ("hf", "vit", "resnet18_imagenet"):
            opts["pretrained"] = False
        if name == "hf":  # the encoder's own FLOPs per input (a kept feature is read, not counted)
            opts["feature_cache"] = False
        if name == "hf" and str(options.get("name_or_path")) in HF_SHAPES:  # no hub call for known shapes
            model, how = hf_offline(str(options["name_or_path"]), shape, classes, opts), "counted (published shapes)"
        else:
            model, how = build_model(name, shape, classes, opts), "counted"
        _FLOPS[key] = forward_flops(model, shape, name == "hf"), how, model
    return _FLOPS[key]


_HELD: dict[str, float] = {}


def model_held_share(name: str, options: dict[str, Any], shape: tuple[int, ...], classes: int) -> float:
    """``held_share`` of ``model_flops``'s model, counted once per model and shape (a table's
    runs share a few)."""
    key = json.dumps([name, options, shape, classes], sort_keys=True)
    if key not in _HELD:
        _HELD[key] = held_share(model_flops(name, options, shape, classes)[2], shape)
    return _HELD[key]


def gpu_engine(rc: RunConfig, model: torch.nn.Module, device: str = "cuda") -> str:
    """The trainer ``client_engine`` (auto) picks for the run on a GPU (or ``device``:
    ``choose_trainer``, as ``engine_coverage.py`` counts it): vectorized or sequential (lanes
    count as sequential)."""
    params = make_params(rc.method.name, dict(rc.method.params))
    trainer, _ = choose_trainer(METHODS.get(rc.method.name), model, rc.train, torch.device(device), params)
    return "vectorized" if trainer.name == "vectorized" else "sequential"


# ----------------------------------------------------------------------------- measured inputs
def rates(gpu: dict[str, Any], ratios: dict[str, float]) -> dict[str, float]:
    """FLOPs per second of each engine in the calibration setting."""
    c = CALIBRATION
    f, _, _ = model_flops(c["model"], {}, c["shape"], c["classes"])
    by = {r["method"]: r for r in gpu["results"]}
    out = {}
    for method, engine in (("fedavg", "vectorized"), ("fedsol", "sequential")):
        r = by[method]
        m = ratios.get("fedsol-head", 1.0) if method == "fedsol" else 1.0
        flops = 3 * f * c["train_per_round"] * m + f * c["eval_per_round"]
        out[engine] = flops / r["s_per_round"]["median"]
    return out


def setting_key(model: str, options: dict[str, Any], shape, batch: int) -> tuple:
    """A (model, options, input shape, batch) setting as ``model_rates.py`` keys it: the
    options without ``pretrained`` (the same shapes; it times randomly initialised weights)
    and ``freeze_stages`` (it times every layer training; ``estimate_run`` scales)."""
    opts = {k: v for k, v in options.items() if k not in ("pretrained", "freeze_stages")}
    return model, json.dumps(opts, sort_keys=True), tuple(shape), int(batch)


def measured_rates(paths: list[str]) -> tuple[dict[tuple, dict[str, Any]], str | None]:
    """((setting key, engine) -> its ``model_rates.py`` row, the device they were measured
    on), from files of one device, a later file's row replacing an earlier one's; rows with an
    error (not measured) are left out."""
    rows: dict[tuple, dict[str, Any]] = {}
    devices = set()
    for path in paths:
        d = json.loads(Path(path).read_text())
        devices.add(d["setting"]["device"])
        for r in d["rows"]:
            if "error" not in r:
                rows[setting_key(r["model"], r["options"], r["shape"], r["batch"]), r["engine"]] = r
    if len(devices) > 1:
        raise SystemExit(f"--model-rates: files of several devices ({', '.join(sorted(devices))}): give one device's")
    return rows, next(iter(devices), None)


def measured_run(row: dict[str, Any], rounds: int, train: float, m: float, evals: float,
                 distinct: float | None = None) -> tuple[float, bool]:  # fmt: skip
    """(seconds of a run at its setting's measured rates, whether its evaluation rate was
    measured): ``train`` inputs per round at ``row``'s training rate times the method's ratio
    ``m``, ``evals`` evaluated inputs per round at its evaluation rate; with ``distinct`` (a
    frozen encoder's kept features) the encoder once over that many rows instead, at the
    evaluation rate (a forward pass per row), and no per-round evaluation beyond the head's."""
    r_eval = row.get("eval_samples_per_s")
    measured = r_eval is not None
    r_eval = r_eval if measured else 3 * row["samples_per_s"]
    if distinct is not None:
        return distinct / r_eval + rounds * train * m / row["samples_per_s"], measured
    return rounds * (train * m / row["samples_per_s"] + evals / r_eval), measured


def method_ratios(method_costs: list[dict[str, Any]], *continual_costs: dict[str, Any]) -> dict[str, float]:
    """Each method's measured time per round relative to FedAvg's (CPU): each ``method_costs``
    file's, then each ``continual_costs`` file's methods against that file's own FedAvg (a
    method already given keeps its first value)."""
    out: dict[str, float] = {}
    for method_cost in method_costs:
        for n, r in method_cost.get("ratio_vs_fedavg", {}).items():
            if r == r and n not in out:
                out[n] = float(r)
    for continual_cost in continual_costs:
        cont = continual_cost.get("methods", {})  # steady-state rounds (medians): task ends apart
        base = cont.get("fedavg", {}).get("s_per_round", {}).get("median")
        for name, r in cont.items():
            if base and name not in out:
                out[name] = r["s_per_round"]["median"] / base
    return out


# ----------------------------------------------------------------------------- the estimate
def rows_per_task(rc: RunConfig) -> tuple[int, int]:
    """(training rows of a task, test rows) of the run's dataset."""
    info = DATASETS.get(rc.dataset.name)
    n_train, n_test = info.split_sizes(info.resolve(rc.dataset.options))
    pub = rc.dataset.public
    if pub and pub.get("source") == "holdout":
        n_train = int(n_train * (1 - float(pub["fraction"])))
    sc = rc.dataset.scenario
    if sc and sc.get("kind") == "split":
        share = int(sc["tasks"]) * int(sc["classes_per_task"]) / info.num_classes
        return int(n_train * share / int(sc["tasks"])), n_test
    if sc and sc.get("kind") == "domains":  # one domain's rows a task (taken as equal shares)
        return int(n_train / int(sc["tasks"])), n_test
    return n_train, n_test


def target_replay(params: dict[str, Any], client_rows: float, batch: int, dataset_rows: float = 0.0,
                  clients: int = 1, tasks: int = 1) -> float:  # fmt: skip
    """TARGET's inputs per local epoch relative to a plain epoch's. ``replay_rule: steps``
    (the default): ``target_replay_rows`` synthetic rows join each batch of ``batch``, so
    its cost grows with the pool and shrinks with the client's data. ``code``: the code's
    ``code_replay_rows`` per step, and the epoch stops after ceil(pool / rows) steps
    (``dataset_rows``, ``clients``, ``tasks``: the nominal step count's terms). What the
    measured ratio of ``continual_cost.py`` includes at its size (the steps rule)."""
    from fedforget.methods.synthesis import SynthesisParams
    from fedforget.methods.target import code_replay_rows, target_replay_rows

    d = {f: getattr(SynthesisParams, f) for f in ("replay_batch", "syn_size", "syn_batch", "syn_rounds")}
    p = {**d, **params}
    pool = min(p["syn_size"], p["syn_rounds"] * p["syn_batch"])
    if p.get("replay_rule", "steps") == "code":
        rows = code_replay_rows(p["replay_batch"], p["syn_size"], pool, round(dataset_rows), clients, tasks, batch)
        private = max(1, math.ceil(client_rows / batch))
        return min(private, math.ceil(pool / rows)) * (batch + rows) / (private * batch)
    rows = target_replay_rows(p["replay_batch"], p["syn_size"], pool, math.ceil(client_rows), batch)
    return (batch + rows) / batch


COST_SETTING = {"client_rows": 1347 / 5 / 5, "batch": 64}  # digits' 1,347 training rows


_GENERATOR_FLOPS: dict[tuple, float] = {}


def synthesis_rows(synthesizer: type, p: Any) -> dict[str, int]:
    """The rows each network sees in one synthesis of ``synthesizer`` (TARGET's ``Synthesizer``,
    LANDER's ``LanderSynthesizer``) under the method's params ``p``, read off the class's own
    schedule (``rounds``, ``stores``, ``adversarial``, ``trains_student``: functions of ``p``
    alone): ``generator`` and ``teacher_grad`` (every step's ``syn_batch`` rows, the generator's
    forward and backward, the teacher's forward and backward to its inputs), ``student_grad``
    (the boundary term's steps), ``student_kd`` (the student's KD steps, up to
    ``student_batch`` rows of the pool so far each: a teacher forward and a student step).
    The pool's scoring after the run is not counted."""
    plan = object.__new__(synthesizer)  # the schedule reads p alone: nothing else is built
    plan.p = p
    step_rows = p.g_steps * p.syn_batch
    out = dict.fromkeys(("generator", "teacher_grad", "student_grad", "student_kd"), 0)
    pool = 0
    for r in range(plan.rounds()):
        out["generator"] += step_rows
        out["teacher_grad"] += step_rows
        if p.adv > 0 and plan.adversarial(r):
            out["student_grad"] += step_rows
        if plan.stores(r):
            pool = min(p.syn_size, pool + p.syn_batch)
        if plan.trains_student(r) and p.student_steps > 0 and pool:
            out["student_kd"] += p.student_steps * min(p.student_batch, pool)
    return out


def synthesis_flops(rc: RunConfig, f: float, shape: tuple[int, ...]) -> float:
    """FLOPs of the run's syntheses (every task end but the last; 0 for a method without
    one), by the module docstring's formula."""
    cls = METHODS.get(rc.method.name)
    synthesizer = getattr(cls, "synthesizer", None)
    if synthesizer is None:
        return 0.0
    from fedforget.methods.synthesis import make_decoder

    p = make_params(rc.method.name, dict(rc.method.params))
    sc = rc.dataset.scenario or {}
    ends = int(sc.get("tasks", 1)) - 1
    if ends <= 0:
        return 0.0
    key = (p.nz, p.ngf, shape)
    if key not in _GENERATOR_FLOPS:
        _GENERATOR_FLOPS[key] = forward_flops(make_decoder(p.nz, p.ngf, shape), (p.nz,), False)
    f_g = _GENERATOR_FLOPS[key]
    w = synthesis_rows(synthesizer, p)
    return ends * (w["generator"] * (3 * f_g + 2 * f) + w["student_grad"] * 3 * f + w["student_kd"] * 4 * f)


def recon_params(name: str, params: dict[str, Any]) -> Any | None:
    """The GLFC params a run reconstructs with (a method over a base: its base's), or None
    where the run reconstructs nothing (another method, or ``proxy`` off)."""
    if params.get("base") in RECONSTRUCTING:
        name, params = params["base"], dict(params.get("base_params") or {})
    if name not in RECONSTRUCTING:
        return None
    p = make_params(name, dict(params))
    return p if p.proxy else None


def recon_key(shape: Sequence[int], classes: int, iters: int, inner: int) -> tuple:
    """A reconstruction setting (``recon_cost.py``'s rows): (input shape, classes,
    recon_iters, recon_inner)."""
    return tuple(int(d) for d in shape), int(classes), int(iters), int(inner)


def recon_samples(rc: RunConfig, classes: int) -> tuple[int, Any]:
    """(GLFC's reconstructed samples in the run, the GLFC params they use; 0 and None for a run
    without its proxy server): at the first round of every task each sampled client sends
    one prototype gradient per class of its task data, each inverted into a sample. [D] An
    upper bound: every sampled client is taken to hold every class of its task (a split
    stream's ``classes_per_task``, else all ``classes``)."""
    p = recon_params(rc.method.name, dict(rc.method.params))
    if p is None:
        return 0, None
    sc = rc.dataset.scenario or {}
    per_task = int(sc["classes_per_task"]) if sc.get("kind") == "split" else classes
    sampled = math.ceil(rc.train.sample_rate * rc.partition.clients)
    return int(sc.get("tasks", 1)) * sampled * per_task, p


def recon_rates(path: str | None) -> tuple[dict[tuple, float], str | None]:
    """(recon_cost.py's seconds per sample by setting, its device) of ``path`` (none: {})."""
    if not path:
        return {}, None
    d = json.loads(Path(path).read_text())
    rows = {recon_key(r["shape"], r["classes"], r["recon_iters"], r["recon_inner"]): r["s_per_sample"] for r in d["rows"]}
    return rows, d["setting"]["device"]


TASK_END_WORK_FREE = ("threshold", "threshold_step")  # params that set the ranks kept, not a task end's work [D]


def has_task_end(name: str, params: dict[str, Any]) -> bool:
    """Whether a run of method ``name`` with ``params`` has task ends that ``task_end_cost.py``
    times: TASK_END declared by the method or its base (``params.base``), and no synthesizer
    (whose task ends ``synthesis_flops`` counts)."""
    cls = METHODS.get(name)
    if getattr(cls, "synthesizer", None) is not None:
        return False
    own = cls.exchanges if isinstance(cls.exchanges, tuple) else ()  # a plug-in's: a property, its base's
    base = params.get("base")
    return TASK_END in own or (base is not None and TASK_END in METHODS.get(base).exchanges)


# methods whose clients do the task-end work in the task's last round, when the method's
# param has this value: FOT's local sketch (each client trained in that round sketches its task
# data on its model just trained and sends it with its upload [C: FedGP App. A.6]), so the
# round's sampled clients do it, not every client holding the task
LAST_ROUND_ENDS = {"fot": ("sketch_model", "local")}


def end_clients(rc: RunConfig) -> int:
    """The clients whose work makes a task end of the run: a round's sampled clients for a
    ``LAST_ROUND_ENDS`` method, else every client (each holds data of every task)."""
    clients = rc.partition.clients
    param, value = LAST_ROUND_ENDS.get(rc.method.name, (None, None))
    if param is not None and getattr(make_params(rc.method.name, dict(rc.method.params)), param) == value:
        return len(sample_clients(rc.seed, 1, clients, rc.train.sample_rate))
    return clients


def task_end_setting(rc: RunConfig) -> dict[str, Any]:
    """What sets the work of the run's task ends (``task_end_cost.py``'s settings): the method
    and its params (``TASK_END_WORK_FREE`` apart), the model and its options (``pretrained``
    apart), the input shape, a task's classes (a split stream's ``classes_per_task``, else all),
    the heads, the clients, those whose work makes a task end (``end_clients``) and each one's
    rows of a task."""
    info = DATASETS.get(rc.dataset.name)
    sc = rc.dataset.scenario or {}
    return {
        "method": rc.method.name,
        "params": {k: v for k, v in sorted(rc.method.params.items()) if k not in TASK_END_WORK_FREE},
        "model": rc.dataset.model,
        "options": {k: v for k, v in sorted((rc.dataset.model_options or {}).items()) if k != "pretrained"},
        "shape": [int(d) for d in info.input_shape(info.resolve(rc.dataset.options))],
        "classes": int(sc["classes_per_task"]) if sc.get("kind") == "split" else info.num_classes,
        "heads": sc.get("heads", "shared"), "clients": rc.partition.clients, "end_clients": end_clients(rc),
        "rows_per_client": rows_per_task(rc)[0] // rc.partition.clients,
    }  # fmt: skip


TASK_END_FIELDS = ("method", "params", "model", "options", "shape", "classes", "heads", "clients", "end_clients",
                   "rows_per_client")  # fmt: skip


def task_end_key(setting: dict[str, Any]) -> str:
    """A task-end setting's identity (a ``task_end_cost.py`` row's, results apart). A row
    written before ``end_clients`` (2026-12-06) timed every client: its ``clients``."""
    s = {"end_clients": setting["clients"], **setting}
    return json.dumps({k: s[k] for k in TASK_END_FIELDS}, sort_keys=True)


def task_end_rates(paths: Sequence[str]) -> dict[str, float]:
    """task_end_cost.py's training rows per task end by setting (``task_end_key``) of the files
    ``paths`` (a setting in several: the last file's row); rows with an error left out."""
    out: dict[str, float] = {}
    for path in paths:
        if not Path(path).is_file():
            raise SystemExit(f"--task-end-cost {path}: no such file (benchmarks/task_end_cost.py --json writes one)")
        rows = json.loads(Path(path).read_text())["rows"]
        out.update({task_end_key(r): r["task_end_rows"] for r in rows if "error" not in r})
    return out


def estimate_run(rc: RunConfig, ratios: dict[str, float], rate: dict[str, float],
                 measured: dict[tuple, dict[str, Any]] | None = None, measured_on: str = "cuda",
                 recon: dict[tuple, float] | None = None, recon_measured: bool = False,
                 task_ends: dict[str, float] | None = None) -> dict[str, Any]:  # fmt: skip
    """A run's FLOPs and time by the FLOP model on a GPU, and (``measured``: rows of
    ``measured_rates``, taken on a ``measured_on`` device, cpu or cuda) at its setting's
    measured rates on the engine ``client_engine: auto`` picks there; ``task_ends``
    (``task_end_rates``): its task ends, each as that many training inputs."""
    info = DATASETS.get(rc.dataset.name)
    shape = tuple(info.input_shape(info.resolve(rc.dataset.options)))
    f, how, model = model_flops(rc.dataset.model, dict(rc.dataset.model_options or {}), shape, info.num_classes)
    rows, n_test = rows_per_task(rc)
    t = rc.train
    train = t.sample_rate * rows * t.local_epochs
    sc = rc.dataset.scenario or {}
    tasks = int(sc.get("tasks", 1))
    # an evaluation scores every task's test rows: a rotated or permuted stream's task has all of them
    per_eval = n_test * tasks if sc.get("kind") in ("rotated", "permuted") else n_test
    evals = per_eval / t.eval_every + (t.sample_rate * rc.partition.clients * per_eval if t.eval_local_models else 0)
    # a method over a base: the pairing's ratio where measured (no base: no such key)
    m = ratios.get(f"{rc.method.name}+{rc.method.params.get('base')}", ratios.get(rc.method.name))
    if rc.method.name in ("target", "target_lode") and m is not None:  # the replay's rows at this run's scale
        pool_rows = rows * tasks if sc.get("kind") in ("split", "domains") else rows  # the training split's rows
        here = target_replay(rc.method.params, rows / rc.partition.clients, t.batch_size, pool_rows,
                             rc.partition.clients, tasks)  # fmt: skip
        m *= here / target_replay({}, **COST_SETTING)
    engine = gpu_engine(rc, model)
    # a frozen encoder (FedGP's text task) trains its head alone: a forward pass per input
    opts = rc.dataset.model_options or {}
    # frozen stages after the first task (freeze_stages): fewer backward FLOPs from then on
    h = model_held_share(rc.dataset.model, dict(opts), shape, info.num_classes)
    passes = 1 if opts.get("freeze_encoder") else training_passes(h, tasks)
    flops = t.rounds * (passes * f * train * (m or 1.0) + f * evals)
    distinct = None
    if rc.dataset.model == "hf" and opts.get("freeze_encoder") and opts.get("feature_cache", True):
        # its features kept: the encoder once per distinct row, the head's steps every round
        split = sc.get("kind") == "split"
        distinct = rows * tasks + n_test * (1 if split else tasks)
        f_head = 2.0 * model.head.in_features * info.num_classes
        flops = f * distinct + t.rounds * (3 * f_head * train * (m or 1.0) + f_head * evals)
    steps = t.rounds * t.local_epochs * math.ceil(t.sample_rate * rc.partition.clients) * math.ceil(
        rows / rc.partition.clients / t.batch_size)
    syn = synthesis_flops(rc, f, shape)  # the server's, at task ends: at the batched rate [D]
    # the other task ends (bases, exemplars): one per task, each as task_end_cost.py's training inputs
    ends = has_task_end(rc.method.name, dict(rc.method.params))
    te_rows = (task_ends or {}).get(task_end_key(task_end_setting(rc))) if ends else None
    te_inputs = tasks * te_rows if te_rows is not None else 0.0
    flops += 3 * f * te_inputs
    out = {"seconds": flops / rate[engine] + syn / rate["vectorized"], "flops": flops + syn, "synthesis_flops": syn,
           "engine": engine, "measured_m": m is not None, "model": rc.dataset.model, "flops_how": how,
           "local_steps": steps, "task_end_flops": 3 * f * te_inputs,
           "task_end": None if not ends else ("measured" if te_rows is not None else "unmeasured")}  # fmt: skip
    there = engine if measured_on == "cuda" or not measured else gpu_engine(rc, model, measured_on)
    row = (measured or {}).get((setting_key(rc.dataset.model, opts, shape, t.batch_size), there))
    out["measured_seconds"], out["measured_eval"] = out["seconds"], None
    if row is not None:
        scaled = train * passes / 3 if distinct is None else train  # a measured rate trains every layer
        out["measured_seconds"], out["measured_eval"] = measured_run(row, t.rounds, scaled, m or 1.0, evals, distinct)
        out["measured_seconds"] += (syn / (3 * f) + te_inputs) / row["samples_per_s"]
    # GLFC's reconstructions, latency-bound: at recon_cost.py's seconds per sample, where given
    n, p = recon_samples(rc, info.num_classes)
    per = (recon or {}).get(recon_key(shape, info.num_classes, p.recon_iters, p.recon_inner)) if n else None
    out["recon_samples"], out["recon_seconds"] = n, (n * per if per is not None else None)
    if recon_measured and out["recon_seconds"] is not None:
        out["measured_seconds"] += out["recon_seconds"]
    return out


def load(path: str) -> dict[str, Any]:
    p = Path(path)
    return json.loads(p.read_text()) if p.is_file() else {}


def hours(h: float) -> str:
    return f"{h:.1f} h" if h >= 1 else f"{60 * h:.0f} min"


def main() -> None:
    a = parse_args()
    torch.manual_seed(0)
    ratios = method_ratios([load(f) for f in a.method_cost], *(load(f) for f in a.continual_cost))
    rate = rates(load(a.gpu), ratios)
    measured, rates_device = measured_rates(a.model_rates)
    on = "cpu" if rates_device == "cpu" else "cuda"  # model_rates.py names a GPU by its name
    recon, recon_device = recon_rates(a.recon_cost)
    both = bool(measured) and recon_device == rates_device  # the reconstructions join measured_hours
    task_ends = task_end_rates(a.task_end_cost)
    rows = []
    trained: set[str] = set()  # training_key of every run of the configs before (and of this one so far)
    for path in a.configs:
        runs = config_runs(path)
        est = [estimate_run(rc, ratios, rate, measured, on, recon, both, task_ends) for rc in runs]
        flops = sum(e["flops"] for e in est)
        repeat = []
        for rc in runs:
            key = training_key(rc)
            repeat.append(key in trained)
            trained.add(key)
        rows.append({
            "config": Path(path).name, "runs": len(runs), "pflop": flops / 1e15,
            "synthesis_pflop": sum(e["synthesis_flops"] for e in est) / 1e15,
            "task_end_pflop": sum(e["task_end_flops"] for e in est) / 1e15,
            "task_end_runs": sum(e["task_end"] is not None for e in est),
            "task_end_unmeasured_runs": sum(e["task_end"] == "unmeasured" for e in est),
            "recon_samples": sum(e["recon_samples"] for e in est),
            "recon_hours": sum(e["recon_seconds"] or 0 for e in est) / 3600,
            "recon_unmeasured_runs": sum(e["recon_samples"] > 0 and e["recon_seconds"] is None for e in est),
            "gpu_hours": sum(e["seconds"] for e in est) / 3600, "floor_hours": flops / FP32_PEAK / 3600,
            "repeat_runs": sum(repeat), "repeat_hours": sum(e["seconds"] for e, r in zip(est, repeat) if r) / 3600,
            "distinct_hours": sum(e["seconds"] for e, r in zip(est, repeat) if not r) / 3600,
            "models": sorted({e["model"] for e in est}), "sequential_runs": sum(e["engine"] == "sequential" for e in est),
            "batched_runs": sum(e["engine"] == "vectorized" for e in est),
            "unmeasured_methods": sorted({rc.method.name for rc, e in zip(runs, est) if not e["measured_m"]}),
            "local_steps": sum(e["local_steps"] for e in est),
            "measured_hours": sum(e["measured_seconds"] for e in est) / 3600,
            "measured_runs": sum(e["measured_eval"] is not None for e in est),
            "evaluation_estimated_runs": sum(e["measured_eval"] is False for e in est),
        })  # fmt: skip
        r = rows[-1]
        print(f"{r['config']:<32} {r['runs']:>5} runs {r['pflop']:>10.1f} PFLOP  measured-rate {hours(r['gpu_hours']):>10}  "
              f"FP32-peak floor {hours(r['floor_hours']):>9}  {'/'.join(r['models'])}"
              + (f"  measured per model {hours(r['measured_hours'])} ({r['measured_runs']} runs)" if measured else "")
              + (f"  (no measured cost: {','.join(r['unmeasured_methods'])})" if r["unmeasured_methods"] else "")
              + (f"  task ends {r['task_end_pflop']:.1f} PFLOP" + (f" ({r['task_end_unmeasured_runs']} of "
                 f"{r['task_end_runs']} runs unmeasured)" if r["task_end_unmeasured_runs"] else "")
                 if r["task_end_runs"] else "")
              + (f"  GLFC reconstructions {r['recon_samples']:,}" + (f" ({hours(r['recon_hours'])} on {recon_device})"
                 if recon else "") if r["recon_samples"] else "")
              + (f"  repeats {r['repeat_runs']} runs, {hours(r['repeat_hours'])}" if r["repeat_runs"] else ""))  # fmt: skip
    tot = {k: sum(r[k] for r in rows)
           for k in ("runs", "pflop", "synthesis_pflop", "task_end_pflop", "task_end_runs", "task_end_unmeasured_runs",
                     "gpu_hours", "floor_hours", "measured_hours", "measured_runs", "recon_samples", "recon_hours",
                     "recon_unmeasured_runs", "repeat_runs", "repeat_hours", "distinct_hours")}
    print(f"{'all':<32} {tot['runs']:>5} runs {tot['pflop']:>10.1f} PFLOP  measured-rate {hours(tot['gpu_hours']):>10}  "
          f"FP32-peak floor {hours(tot['floor_hours']):>9}"
          + (f"  measured per model {hours(tot['measured_hours'])} ({tot['measured_runs']} runs)" if measured else "")
          + f"  repeats {tot['repeat_runs']} runs, {hours(tot['repeat_hours'])}")  # fmt: skip
    print("rates (FLOP/s, measured in the calibration setting):", {k: f"{v:.3g}" for k, v in rate.items()})
    out = {"rates_flop_s": rate, "fp32_peak_flop_s": FP32_PEAK, "method_ratios": ratios,
           "gpu": load(a.gpu).get("device"), "model_rates": a.model_rates, "model_rates_device": rates_device,
           "recon_cost": a.recon_cost, "recon_device": recon_device, "recon_in_measured_hours": both,
           "task_end_cost": a.task_end_cost,
           "tables": rows, "total": tot}  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    if a.markdown:
        extra = f" measured per model ({rates_device}) |" if measured else ""
        lines = ["| config | runs | models | PFLOP | at the measured rate | FP32-peak floor |" + extra,
                 "|---|---|---|---|---|---|" + ("---|" if measured else "")]  # fmt: skip
        for r in rows:
            per = f" {hours(r['measured_hours'])} ({r['measured_runs']} of {r['runs']} runs) |" if measured else ""
            lines.append(f"| {r['config']} | {r['runs']} | {', '.join(r['models'])} | {r['pflop']:.1f} | "
                         f"{hours(r['gpu_hours'])} | {hours(r['floor_hours'])} |" + per)  # fmt: skip
        Path(a.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
