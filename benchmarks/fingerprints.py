"""Fingerprints of every registered method's results: a refactor's byte-identity check.

For each method (default hyperparameters) a few tiny CPU runs, each reduced to a SHA-256 of
its metrics rows (timings left out, the per-task rows kept) and of its final global weights:

- ``iris``: iris + MLP with a 10 % held-out public set, Dirichlet 0.5 over 4 clients,
  4 rounds at 3 of 4 clients, 2 local epochs, SGD with momentum and weight decay, on the
  sequential trainer and (where the method allows) the batched one;
- ``split``: split digits (3 tasks x 2 classes, 1 round each) on a small CNN, sequential
  (methods that refuse a task stream are recorded as refused, with the reason);
- a method defined on one model alone (L2P's ViT) runs a tiny ViT on digits instead.

Run it before a change and after it; the two JSON files must be equal::

    python benchmarks/fingerprints.py --out before.json
    python benchmarks/fingerprints.py --out after.json && cmp before.json after.json

A change that only adds a column (of the metrics rows or of their per-task rows) is checked
against the earlier commit by leaving that column out (``--skip-columns NAME``): every other
byte must be equal.

Results depend on the torch build and the CPU kernels: compare runs on one machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from fedforget.config import DatasetSpec, MethodSpec, OptimizerSpec, RunConfig, TrainSpec
from fedforget.data import DATASETS, dataset_id, prepare_dataset, prepare_public
from fedforget.data.scenario import resolve_scenario
from fedforget.engine import TIMING_COLUMNS, Simulation
from fedforget.methods import METHODS, make_params
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError

CPU = torch.device("cpu")
THREADS = [1]  # --threads
PUBLIC = {"source": "holdout", "fraction": 0.1, "seed": 0}
SPLIT = {"kind": "split", "tasks": 3, "classes_per_task": 2, "rounds_per_task": 1, "leftover_classes": "drop"}
SMALL_CNN = {"channels": [4, 8], "hidden": 16}
TINY_VIT = {"image_size": 8, "patch_size": 4, "layers": 1, "heads": 2, "hidden_dim": 16, "mlp_dim": 32}


def needs_model(name: str, params: dict) -> str | None:
    for n in (name, params.get("base")):
        if n in METHODS and getattr(METHODS.get(n), "needs_model", None):
            return METHODS.get(n).needs_model
    return None


def run_config(root: Path, dataset: str, model: str, model_options: dict, method: str, engine: str,
               public: dict | None, scenario: dict | None, **train) -> RunConfig:  # fmt: skip
    info = DATASETS.get(dataset)
    if scenario is not None:
        scenario = resolve_scenario(scenario, info.num_classes, tuple(info.input_shape(info.resolve({}))), "scenario")
    ds = DatasetSpec(dataset, {}, model, dict(model_options), public, dataset_id(dataset, {}), scenario)
    t = TrainSpec(
        rounds=4, local_epochs=2, batch_size=8, sample_rate=0.75, device="cpu", threads=THREADS[0],
        optimizer=OptimizerSpec(lr=0.05, momentum=0.9, weight_decay=1e-3), client_engine=engine,
    )  # fmt: skip
    return RunConfig(
        experiment="fingerprint", dataset=ds,
        partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=5, seed=0),
        method=MethodSpec(method, {}, method), seed=0, train=replace(t, **train),
        data_dir=str(root), results_dir=str(root / "results"),
    )  # fmt: skip


SKIP: set[str] = set()  # columns left out of the metrics digest (--skip-columns)


def digest(rows: list[dict], params: dict[str, torch.Tensor]) -> dict[str, str]:
    h = hashlib.sha256()
    for r in rows:
        for k in sorted(r):
            if (k in TIMING_COLUMNS and k != "round") or k in SKIP:
                continue
            v = r[k]
            if k == "_tasks" and SKIP:
                v = [{c: x for c, x in t.items() if c not in SKIP} for t in v]
            if isinstance(v, float):
                v = "nan" if math.isnan(v) else v.hex()
            h.update(f"{k}={v!r};".encode())
    w = hashlib.sha256()
    for k in sorted(params):
        w.update(k.encode())
        w.update(params[k].detach().cpu().contiguous().numpy().tobytes())
    return {"metrics": h.hexdigest()[:16], "weights": w.hexdigest()[:16], "rounds": len(rows)}


def one(rc: RunConfig) -> dict:
    try:  # the method's config-time model check first, as parse_config runs it (SCR's image views on Iris)
        METHODS.get(rc.method.name).check_model(rc.dataset.model, make_params(rc.method.name, dict(rc.method.params)))
        sim = Simulation(rc, device=CPU)
    except FedForgetError as e:
        return {"refused": str(e).splitlines()[0][:160]}
    if sim.engine_info["client_engine"] != rc.train.client_engine:
        return {"refused": sim.engine_info["client_engine_reason"]}
    status, rows, msg = sim.run(progress=False)
    out = digest(rows, sim.global_params)
    out["status"] = status
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default: standard output)")
    ap.add_argument("--methods", nargs="*", default=None, help="only these methods")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--skip-columns", nargs="*", default=[], help="columns left out of the metrics digest")
    args = ap.parse_args()
    SKIP.update(args.skip_columns)
    THREADS[0] = args.threads
    torch.set_num_threads(args.threads)
    result: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="fedforget-fp-") as tmp:
        root = Path(tmp)
        for name in ("iris", "digits"):
            prepare_dataset(name, {}, root)
        prepare_public(PUBLIC, "iris", root)
        for m in args.methods or METHODS.names():
            res: dict[str, dict] = {}
            if needs_model(m, {}) == "vit":
                base = dict(dataset="digits", model="vit", model_options=TINY_VIT, public=None)
            else:
                base = dict(dataset="iris", model="mlp", model_options={}, public=PUBLIC)
            for engine in ("sequential", "vectorized"):
                res[f"iris-{engine}"] = one(run_config(root, method=m, engine=engine, scenario=None, **base))
            split = dict(dataset="digits", model="cnn2d", model_options=SMALL_CNN, public=None)
            if needs_model(m, {}) == "vit":
                split = dict(base)
            try:
                rc = run_config(root, method=m, engine="sequential", scenario=SPLIT, rounds=3,
                                eval_local_models=False, **split)  # fmt: skip
                res["split-sequential"] = one(rc)
            except FedForgetError as e:
                res["split-sequential"] = {"refused": str(e).splitlines()[0][:160]}
            result[m] = res
            print(m, json.dumps(res), file=sys.stderr, flush=True)
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
