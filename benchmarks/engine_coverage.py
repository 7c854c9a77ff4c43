"""Which paper runs would train their clients one after another on a GPU under
``client_engine: auto``, and why (issue 32: "every paper model and method trained batched"):
counts, not timings. For every run of config/experiments/paper, the trainer that
``trainers.choose_trainer`` picks on a CUDA device (only the device type matters; no GPU is
needed), from the run's method, model (built at its input shape, pretrained weights left
out: the same modules) and training settings. Written per reason and per config file, with
how many of the runs trained one after another could train several clients at once on lanes
(``train.concurrent_clients``): all but those whose model draws from the global generator in
training (every registered method trains on lanes: tests/methods/test_concurrent_clients.py;
a Hugging Face encoder's dropout is keyed since the sixth session of 2026-12-02; the
paper configs' hub encoders are built from their published shapes, ``paper_runtime.HF_SHAPES``,
randomly initialised: the same modules). Of the batched runs, which CUDA graphs
their steps run in (``vectorized``): FedAvg's SGD steps with shared heads in graphs kept
across rounds, and how many of those decay their lr (read from a tensor on a GPU since the
fifth session of 2026-12-02: ``lr_on_device``); a method's terms, Adam or per-task heads in
graphs of one group's training; vmap's steps eagerly, and a frozen Hugging Face encoder's
(batched since the seventh session of 2026-12-02: its feature cache reads on the host).

    python benchmarks/engine_coverage.py --json benchmarks/results/<dir>/engine_coverage.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_rates import paper_runs  # noqa: E402  (benchmarks/model_rates.py: every paper run)
from paper_runtime import HF_SHAPES, hf_offline  # noqa: E402  (the hub encoders' published shapes)

from fedforget.methods import METHODS, make_params  # noqa: E402
from fedforget.models import build_model  # noqa: E402
from fedforget.trainers import choose_trainer, global_drawing_module  # noqa: E402
from fedforget.vectorized import no_graphs, stacked_supported  # noqa: E402


def graphs_kind(rc, model, params) -> str:
    """Which CUDA graphs a batched run's steps run in (``vectorized.train_clients_together``:
    ``persistent``, ``capturable_terms``): across_rounds (FedAvg's SGD steps, shared heads),
    across_rounds_lr_decay (the same with a decaying lr), one_group (a method's terms, Adam,
    per-task heads), eager_vmap, eager_terms (terms not capturable), eager_model (``no_graphs``:
    a frozen Hugging Face encoder's feature cache)."""
    if stacked_supported(model) is not None:
        return "eager_vmap"
    if no_graphs(model) is not None:
        return "eager_model"
    cls = METHODS.get(rc.method.name)
    terms = bool(cls.step_terms or cls.live_terms or cls.trait("step_terms", params))
    per_task = (rc.dataset.scenario or {}).get("heads") == "per_task"
    if terms or rc.train.optimizer.name == "adam" or per_task:
        return "one_group" if not terms or cls.trait("capturable_terms", params) else "eager_terms"
    return "across_rounds_lr_decay" if rc.train.lr_decay != 1.0 else "across_rounds"


def coverage() -> dict:
    models: dict = {}
    reasons: collections.Counter = collections.Counter()
    lanes = 0  # sequential runs whose model allows clients at once
    graphs: collections.Counter = collections.Counter()  # batched runs by graphs_kind
    per_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path, rc, shape, opts in paper_runs():
        if rc.dataset.model == "hf" and opts["name_or_path"] not in HF_SHAPES:
            why = "a Hugging Face text model (not checked: built from a hub)"
        else:
            key = (rc.dataset.model, json.dumps(opts, sort_keys=True), shape)
            if key not in models:  # a hub encoder: its published shapes (the same modules), random weights
                hub = rc.dataset.model == "hf"
                models[key] = hf_offline(opts["name_or_path"], shape, 10, opts) if hub else build_model(
                    rc.dataset.model, shape, 10, opts)  # fmt: skip
            params = make_params(rc.method.name, dict(rc.method.params))
            trainer, why = choose_trainer(METHODS.get(rc.method.name), models[key], rc.train, torch.device("cuda"), params)
            why = None if trainer.name == "vectorized" else re.sub(r"experiment '[^']*'", "experiment <name>", why)
            if why is None:
                graphs[graphs_kind(rc, models[key], params)] += 1
            if why is not None and global_drawing_module(models[key]) is None:
                lanes += 1
        label = "batched" if why is None else why
        reasons[label] += 1
        per_file[path.stem][label] += 1
    total = sum(reasons.values())
    return {
        "setting": {"device": "cuda (the choice only)", "configs": "config/experiments/paper/*.yaml"},
        "runs": total,
        "batched": reasons["batched"],
        "sequential": total - reasons["batched"],
        "sequential_on_lanes": lanes,
        "batched_graphs": dict(graphs.most_common()),
        "reasons": dict(reasons.most_common()),
        "per_file": {k: dict(v.most_common()) for k, v in sorted(per_file.items())},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the counts here")
    args = ap.parse_args()
    out = coverage()
    print(f"{out['runs']} paper runs: {out['batched']} batched on a GPU, {out['sequential']} one client after another"
          f" ({out['sequential_on_lanes']} of them may train several at once: train.concurrent_clients)")
    print("batched runs' CUDA graphs: " + ", ".join(f"{k} {n}" for k, n in out["batched_graphs"].items()))
    for why, n in out["reasons"].items():
        if why != "batched":
            print(f"{n:5d}  {why}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
