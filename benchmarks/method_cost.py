"""Time per round of every registered method, relative to FedAvg, on one tiny config.

Every method in ``fedforget.methods.METHODS`` (default hyperparameters) runs the same
config: digits + cnn2d, iid over 20 clients, sample rate 0.5, 2 local epochs, batch 32, SGD
lr 0.01, and a held-out public set {source: holdout, fraction: 0.1, seed: 0} declared for
every method (so methods with ``needs_public`` run too, and all methods train on the same
private pool). Evaluation is off (eval_local_models=False, eval_every beyond the last
round), so a round is broadcast + local training + server_aggregate (the average and any
server step after it) + server_metrics. With ``--public-fraction 0`` no public set is declared and methods that need
one are skipped.

Each repeat builds a fresh Simulation per method (untimed), runs ``--warmup`` untimed
rounds, then times ``--rounds`` rounds (wall clock around ``Simulation.run_round``, synced
on CUDA). Methods are interleaved within each repeat, in an order rotated between repeats,
so all methods see the same machine load. Reported: the median seconds per round over all
timed rounds of all repeats and its ratio to FedAvg's, and the fastest round and its ratio
to FedAvg's fastest (resists bursts of load on a shared machine). A method that raises is
reported with its error and does not stop the others.

    python benchmarks/method_cost.py
    python benchmarks/method_cost.py --repeats 5 --json cost.json
    python benchmarks/method_cost.py --methods fedavg fedsam fedasam --device cuda
    python benchmarks/method_cost.py --methods fedavg \
        --variant 'fedsol-head:fedsol:{"perturb": "head", "rho": 1.5}' \
        --variant 'fedsol-all:fedsol:{"perturb": "all", "rho": 2.0}'

``--variant LABEL:METHOD:JSON_PARAMS`` (repeatable) also times METHOD with those
hyperparameters under the name LABEL (with --variant and no --methods, only FedAvg and the
variants run).

All methods run on one client engine, ``--client-engine`` (default ``sequential``, where
every method runs), so the ratios are the methods' own costs; with ``auto`` FedAvg would
train its clients batched and the others not (FedAvg's batched engine against the
sequential one and a plain loop: ``benchmarks/simulation.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import traceback
from dataclasses import replace

import torch

from fedforget.config import DatasetSpec, MethodSpec, OptimizerSpec, RunConfig, TrainSpec
from fedforget.data import prepare_dataset, prepare_public
from fedforget.engine import Simulation, resolve_device
from fedforget.methods import METHODS, check_params
from fedforget.partition import PartitionSpec


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, typ, default in [
        ("dataset", str, "digits"), ("model", str, "cnn2d"), ("clients", int, 20), ("sample-rate", float, 0.5),
        ("local-epochs", int, 2), ("batch-size", int, 32), ("rounds", int, 3), ("warmup", int, 1),
        ("lr", float, 0.01), ("momentum", float, 0.0), ("threads", int, 2), ("device", str, "cpu"),
        ("repeats", int, 3), ("public-fraction", float, 0.1), ("client-engine", str, "sequential"),
    ]:  # fmt: skip
        p.add_argument(f"--{name}", type=typ, default=default, help=f"default: {default}")
    p.add_argument("--methods", nargs="+", help="default: every registered method")
    p.add_argument("--params", default="{}", help='method hyperparameters as JSON, e.g. \'{"fedproj": {"memory_batch_size": 32}}\' (default: each method\'s defaults)')
    p.add_argument("--json", metavar="PATH", help="also write the numbers to this file")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL:METHOD:JSON_PARAMS",
                   help="a method with its own hyperparameters, timed under LABEL (repeatable)")  # fmt: skip
    return p.parse_args()


def parse_variant(text: str) -> tuple[str, str, dict]:
    """'LABEL:METHOD:JSON_PARAMS' -> (label, method, validated params)."""
    parts = text.split(":", 2)
    if len(parts) != 3:
        raise SystemExit(f"--variant {text!r}: expected LABEL:METHOD:JSON_PARAMS")
    label, method, raw = parts
    try:
        params = json.loads(raw)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--variant {text!r}: JSON_PARAMS is not JSON ({e})") from None
    return label, method, check_params(method, params, f"--variant {label}")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    dev = resolve_device(a.device)
    tmp = tempfile.TemporaryDirectory(prefix="fedforget-cost-")
    prepare_dataset(a.dataset, {}, tmp.name)
    public = None
    if a.public_fraction > 0:
        public = {"source": "holdout", "fraction": a.public_fraction, "seed": 0}
        prepare_public(public, a.dataset, tmp.name)

    total = a.warmup + a.rounds
    opt = OptimizerSpec("sgd", lr=a.lr, momentum=a.momentum)
    train = TrainSpec(total, a.local_epochs, a.batch_size, a.sample_rate, opt)
    # no evaluation inside timed rounds: eval_every past the last round (the engine also
    # evaluates at rnd == rounds, so rounds is set beyond the rounds actually run)
    train = replace(
        train, rounds=total + 1, eval_every=10**9, eval_local_models=False,
        device=a.device, threads=a.threads, client_engine=a.client_engine,
    )  # fmt: skip
    ds = DatasetSpec(a.dataset, {}, a.model, {}, public, a.dataset)
    part = PartitionSpec("iid", a.clients)

    method_params = json.loads(a.params)
    variants = [parse_variant(v) for v in a.variant]
    names = a.methods or ([] if variants else METHODS.names())
    if "fedavg" not in names:
        names = ["fedavg", *names]
    # label -> (method, params): the methods (with --params or defaults), then the variants
    specs = {n: (n, method_params.get(n, {})) for n in names}
    for label, method, params in variants:
        if label in specs:
            raise SystemExit(f"--variant {label}: label already used")
        specs[label] = (method, params)
    names = list(specs)
    skipped = {n: "needs a public set" for n in names if METHODS.get(specs[n][0]).needs_public and not public}
    names = [n for n in names if n not in skipped]

    def config(name: str) -> RunConfig:
        method, params = specs[name]
        return RunConfig("method_cost", ds, part, MethodSpec(method, params, name), 0, train, tmp.name, tmp.name)

    seconds: dict[str, list[float]] = {n: [] for n in names}
    errors: dict[str, str] = {}
    load = os.getloadavg()[0]
    for rep in range(a.repeats):
        k = rep % len(names)
        for name in names[k:] + names[:k]:  # rotated: no method always runs first
            if name in errors:
                continue
            try:
                sim = Simulation(config(name), device=dev)
                start = time.perf_counter()
                for rnd in range(1, total + 1):
                    sync(dev)
                    t0 = time.perf_counter()
                    sim.run_round(rnd, start)
                    sync(dev)
                    if rnd > a.warmup:
                        seconds[name].append(time.perf_counter() - t0)
                del sim
            except Exception as e:  # another engineer's method in progress: report, go on
                errors[name] = f"{type(e).__name__}: {e}"
                traceback.print_exc()

    median = {n: statistics.median(v) for n, v in seconds.items() if n not in errors and v}
    base = median.get("fedavg")
    ratio = {n: (m / base if base else float("nan")) for n, m in median.items()}
    best = {n: min(seconds[n]) for n in median}
    ratio_best = {n: (b / best["fedavg"] if base else float("nan")) for n, b in best.items()}

    print(
        f"{a.dataset}/{a.model}, {dev}, {torch.get_num_threads()} threads, torch {torch.__version__}: "
        f"{a.clients} clients x {a.sample_rate}, {a.local_epochs} local epochs, batch {a.batch_size}, "
        f"public {'holdout ' + str(a.public_fraction) if public else 'none'}; {a.warmup} warm-up + "
        f"{a.rounds} timed rounds x {a.repeats} repeats; load avg {load:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    print(f"{'':<16}{'seconds per round':^27}{'vs FedAvg':^20}")
    print(f"{'method':<16}{'median':>9}{'min':>9}{'max':>9}{'median':>10}{'min':>10}")
    for n in sorted(median, key=lambda n: (n != "fedavg", ratio[n], n)):
        v = seconds[n]
        print(f"{n:<16}{median[n]:>9.4f}{best[n]:>9.4f}{max(v):>9.4f}{ratio[n]:>9.2f}x{ratio_best[n]:>9.2f}x")  # fmt: skip
    for n, why in {**skipped, **errors}.items():
        print(f"{n:<16}  not timed: {why}")
    if a.json:
        out = {"args": vars(a), "device": str(dev), "torch": torch.__version__,
               "seconds_per_round": seconds, "median_s_per_round": median,
               "ratio_vs_fedavg": ratio, "min_s_per_round": best, "ratio_vs_fedavg_min": ratio_best,
               "skipped": skipped, "errors": errors}  # fmt: skip
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    tmp.cleanup()


if __name__ == "__main__":
    main()
