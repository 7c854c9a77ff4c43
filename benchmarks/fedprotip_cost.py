"""What FedProTIP costs: time per round against FedAvg and the other continual methods, and
its basis extraction per task (papers/fedprotip.md Sec. 6.5: "FedProTIP is the fastest
method among the continual learning baselines, second only to FedAvg"; Table 8: the
extraction's share of the run time).

Setting (printed and written to ``--json``): the task stream of
config/experiments/fedprotip_table1.yaml (split digits 5 x 2 class-IL or rotated digits,
per-task heads, cnn2d, Dirichlet 0.5 over 5 clients, all sampled, 5 local epochs, batch 64,
SGD lr 0.1, wd 5e-4; FedProTIP eps 0.95, m_s 512), ``--threads`` torch threads, one client
after another. Each method runs the first task (``--rounds`` rounds per task) and the
rounds of the second: the timed rounds are the second task's (bases of the first exist, so
the projection runs), without evaluation. ``task_end_s``: the engine's task end at the end
of the first task (every client's ``client_task_end``, the server's, and FedProTIP's
after-task pass for the references), not in the round times. Runs interleaved round by
round so all see the same load; medians with min-max.

    python benchmarks/fedprotip_cost.py
    python benchmarks/fedprotip_cost.py --stream rotated --json fedprotip_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from task_timing import time_task_ends

from fedforget.config import DatasetSpec, MethodSpec, OptimizerSpec, RunConfig, TrainSpec
from fedforget.data import DATASETS, prepare_dataset
from fedforget.data.scenario import resolve_scenario
from fedforget.engine import Simulation
from fedforget.partition import PartitionSpec

STREAMS = {
    "split": {"kind": "split", "tasks": 5, "classes_per_task": 2, "heads": "per_task"},
    "rotated": {"kind": "rotated", "tasks": 5, "heads": "per_task"},
}
METHODS = {
    "fedavg": {},
    "fedprotip": {"threshold": 0.95},
    "fot": {},
    "gpm": {},
    "agem": {},
    "der": {},
    "fedcurv": {},
    "fedgp": {},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stream", default="split", choices=sorted(STREAMS))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--rounds", type=int, default=6, help="rounds per task; the second task's are timed")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    return p.parse_args()


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    info = DATASETS.get("digits")
    shape = tuple(info.input_shape(info.resolve({})))
    part = PartitionSpec("dirichlet", clients=5, alpha=0.5, min_size=10, seed=0)
    names = a.methods.split(",")
    setting = {
        "dataset": "digits", "model": "cnn2d", "stream": a.stream, "heads": "per_task", "partition": part.setting,
        "clients": part.clients, "sample_rate": 1.0, "local_epochs": 5, "batch_size": 64,
        "optimizer": "sgd lr 0.1 wd 5e-4", "rounds_per_task": a.rounds, "timed": "rounds of task 2",
        "threads": a.threads, "client_engine": "sequential", "device": "cpu", "torch": torch.__version__,
    }  # fmt: skip
    print("setting:", json.dumps(setting))
    with tempfile.TemporaryDirectory() as tmp:
        prepare_dataset("digits", {}, tmp)
        s = resolve_scenario({**STREAMS[a.stream], "rounds_per_task": a.rounds}, info.num_classes, shape, "scenario")
        t = TrainSpec(
            rounds=5 * a.rounds, local_epochs=5, batch_size=64, sample_rate=1.0, eval_local_models=False,
            eval_every=10**6, threads=a.threads, device="cpu", client_engine="sequential",
            optimizer=OptimizerSpec(lr=0.1, weight_decay=5e-4),
        )  # fmt: skip
        sims = {
            n: Simulation(RunConfig("bench", DatasetSpec("digits", {}, "cnn2d", {}, None, "digits", s), part,
                                    MethodSpec(n, METHODS[n], n), 0, t, tmp, f"{tmp}/results"))
            for n in names
        }  # fmt: skip
        task_end = time_task_ends(sims)
        times: dict[str, list[float]] = {n: [] for n in names}
        start = time.perf_counter()
        for rnd in range(1, 2 * a.rounds + 1):
            for n, sim in sims.items():
                ends = len(task_end[n])
                t0 = time.perf_counter()
                sim.run_round(rnd, start)
                dt = time.perf_counter() - t0 - sum(task_end[n][ends:])
                if rnd > a.rounds:
                    times[n].append(dt)
    result = {"setting": setting, "s_per_round": {}}
    ref = statistics.median(times["fedavg"]) if "fedavg" in times else None
    for n in sorted(names, key=lambda n: statistics.median(times[n])):
        ts = times[n]
        med = statistics.median(ts)
        r = {"median": med, "min": min(ts), "max": max(ts), "task_end_s": task_end[n][0]}
        if ref:
            r["vs_fedavg"] = med / ref
        result["s_per_round"][n] = r
        rel = f"  x{med / ref:.2f} of fedavg" if ref else ""
        print(f"{n:10s} {med * 1e3:8.1f} ms/round (min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f}){rel}"
              f"  task end {task_end[n][0] * 1e3:.1f} ms")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
