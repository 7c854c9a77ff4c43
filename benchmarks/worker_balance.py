"""How evenly the batched engine's CPU workers share a round's clients: the makespan (the
busiest worker's rows) over a perfect split (all rows / workers), per round, for the split
the engine makes (its workers take the clients longest first, each the next one as it
finishes one: with times proportional to rows, ``balance`` below) and for
the split it used before (client i on worker i mod workers, clients sorted by size). A
count, not a timing: on the wide client-by-client steps a worker's time is proportional to
its rows (1 local epoch, every step wide), so this is the time lost to imbalance.

Setting (printed): a preset of benchmarks/simulation.py, its clients IID or Dirichlet 0.5,
the engine's client sampling for ``--rounds`` rounds, ``--workers`` workers.

    python benchmarks/worker_balance.py                      # mcmahan, Dirichlet 0.5, 2 workers
    python benchmarks/worker_balance.py --partition iid --workers 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections.abc import Sequence

import simulation as S

from fedforget.data import prepare_dataset
from fedforget.engine import Simulation, sample_clients


def balance(costs: Sequence[float], workers: int) -> list[list[int]]:
    """Clients (indices of ``costs``) onto ``workers`` lists: longest first onto the least
    loaded worker (ties: the lower index), each list in ascending client order (LPT: within
    4/3 of the best makespan): the engine's split when a client's time is its cost."""
    load, out = [0.0] * workers, [[] for _ in range(workers)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        j = min(range(workers), key=lambda j: (load[j], j))
        load[j] += costs[i]
        out[j].append(i)
    return [sorted(x) for x in out]


def makespan(loads: list[float], total: float) -> float:
    return max(loads) / (total / len(loads))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(S.PRESETS), default="mcmahan")
    ap.add_argument("--partition", choices=["iid", "dirichlet0.5"], default="dirichlet0.5")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "fedforget-bench-data"))
    a = ap.parse_args()
    p = S.PRESETS[a.preset]
    prepare_dataset(p["dataset"], p["options"], a.data)
    args = argparse.Namespace(preset=a.preset, partition=a.partition, rounds=a.rounds, warmup=0, epochs=1,
                              eval="none", device="cpu", threads=a.workers, memory=0, data=a.data, method="fedavg")  # fmt: skip
    rc = S.run_config(args, "auto")
    sim = Simulation(rc)
    ratios: dict[str, list[float]] = {"i mod workers": [], "balance (LPT)": []}
    for rnd in range(1, a.rounds + 1):
        sampled = sample_clients(rc.seed, rnd, rc.partition.clients, rc.train.sample_rate)
        rows = sorted((sim.clients.size(c) for c in sampled), reverse=True)  # the engine stacks by size
        total = sum(rows)
        ratios["i mod workers"].append(makespan([sum(rows[j :: a.workers]) for j in range(a.workers)], total))
        lpt = [sum(rows[i] for i in w) for w in balance(rows, a.workers)]
        ratios["balance (LPT)"].append(makespan(lpt, total))
    setting = {"preset": a.preset, "partition": a.partition, "clients": rc.partition.clients,
               "sample_rate": rc.train.sample_rate, "workers": a.workers, "rounds": a.rounds}  # fmt: skip
    print("setting:", json.dumps(setting))
    for name, r in ratios.items():
        print(f"{name:14s} makespan / perfect split: median {statistics.median(r):.3f}, mean {statistics.mean(r):.3f}, "
              f"min {min(r):.3f}, max {max(r):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
