"""TARGET under its two replay rules on the embedded FedProTIP Table 1 layout (issue 36, 3):
``replay_rule: steps`` (the default [D]) against ``code`` (the authors' code), final ACC,
forgetting, whether the global model collapsed (the tables' mark: one class takes at least
``COLLAPSE_SHARE`` of the current task's predictions in some round) and seconds per run.

Setting: config/experiments/fedprotip_table1.yaml's TARGET runs on split digits (5 x 2,
class-IL, one head per task: its heads experiment, cnn2d), Dirichlet 0.5 within each task
over 5 clients (its second partition), all sampled, 5 rounds per task, 5 local epochs of batch 64, SGD lr 0.1, wd 5e-4,
as configured; seeds ``--seeds``; one run after another on this machine, the runs of a seed
with the same data, partition and schedule.

    python benchmarks/target_rules.py --json target_rules.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from fedforget.config import MethodSpec
from fedforget.continual import COLLAPSE_SHARE, TOP_SHARE, accuracy_matrix, continual_metrics
from fedforget.data import prepare_dataset
from fedforget.engine import Simulation
from fedforget.parse import load_config

CONFIG = "config/experiments/fedprotip_table1.yaml"
REPO = Path(__file__).resolve().parent.parent


def target_runs(seeds: list[int]):
    """The config's TARGET runs on split digits with Dirichlet 0.5 (one per seed)."""
    cfg = load_config(REPO / CONFIG)
    runs = [r for r in cfg.runs() if r.method.name == "target" and r.dataset.scenario
            and r.dataset.scenario.get("kind") == "split" and r.partition.scheme == "dirichlet"
            and r.partition.alpha == 0.5 and r.seed in seeds]  # fmt: skip
    if len(runs) != len(seeds):
        raise SystemExit(f"{CONFIG}: {len(runs)} TARGET runs on split digits, Dirichlet 0.5, seeds {seeds}")
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    out: dict = {"config": CONFIG, "threads": a.threads, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        prepare_dataset("digits", {}, tmp)
        for rc in target_runs(a.seeds):
            sc = rc.dataset.scenario
            for rule in ("steps", "code"):
                params = {**rc.method.params, "replay_rule": rule}
                run = replace(rc, method=MethodSpec("target", params, f"TARGET-{rule}"), data_dir=tmp,
                              results_dir=f"{tmp}/results", train=replace(rc.train, threads=a.threads))  # fmt: skip
                start = time.perf_counter()
                sim = Simulation(run, device=torch.device("cpu"))
                status, rows, msg = sim.run(progress=False)
                seconds = time.perf_counter() - start
                task_rows = [{"round": r["round"], **t} for r in rows for t in r.get("_tasks", [])]
                m = continual_metrics(accuracy_matrix(task_rows, sc["tasks"], sc["rounds_per_task"]))
                share = max((r.get(TOP_SHARE, 0.0) for r in rows), default=0.0)
                rec = {"seed": rc.seed, "rule": rule, "status": status, "acc": m["acc"], "fgt": m["fgt"],
                       "max_top_pred_share": share, "collapsed": share >= COLLAPSE_SHARE, "seconds": seconds}  # fmt: skip
                out["runs"].append(rec)
                print(json.dumps(rec), flush=True)
    for rule in ("steps", "code"):
        rs = [r for r in out["runs"] if r["rule"] == rule]
        out[rule] = {k: statistics.mean(r[k] for r in rs) for k in ("acc", "fgt", "seconds")}
        out[rule]["collapsed"] = sum(r["collapsed"] for r in rs)
        print(rule, json.dumps(out[rule]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
