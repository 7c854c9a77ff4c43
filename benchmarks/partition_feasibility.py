"""How fast an impossible Dirichlet partition ends with its error (issue 20 item 7: within
5 s also at 1000 clients): prints numbers, not a test.

For each request, the time of ``make_partition`` (the up-front size check, then at most
``max_redraws`` draws that only count sizes) and of the same draws building every client's
index lists, as the partitioner did before (``--before``; about 12 s at 1000 clients). The
labels are mnist1d's and digits' training splits, prepared into a temporary directory.

    python benchmarks/partition_feasibility.py [--before]
"""

from __future__ import annotations

import sys
import tempfile
import time

import numpy as np

from fedforget.data import load_dataset, prepare_dataset
from fedforget.partition import PartitionSpec, make_partition
from fedforget.utils import FedForgetError

# (dataset, clients, alpha, min_size): each passes min_size x clients <= N, none is met
CASES = [
    ("mnist1d", 1000, 0.1, 4),  # 4 x 1000 = N: every client exactly N/K
    ("mnist1d", 1000, 0.1, 1),
    ("mnist1d", 1000, 100.0, 4),  # the best draw's smallest client: 2
    ("digits", 1000, 0.1, 1),
    ("mnist1d", 1000, 0.1, 5),  # 5 x 1000 > N: decided up front
]


def by_lists():
    """The draws as they were, each building every client's index lists: the reference loop
    of tests/test_partition.py (which checks that the new draws equal it), not a copy."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tests" / "test_partition.py"
    spec = importlib.util.spec_from_file_location("_partition_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._dirichlet_by_lists


def main(argv: list[str]) -> None:
    before = by_lists() if "--before" in argv else None
    root = tempfile.mkdtemp()
    labels = {}
    for name in sorted({c[0] for c in CASES}):
        prepare_dataset(name, {}, root)
        labels[name] = load_dataset(name, root).y_train
    for name, k, alpha, min_size in CASES:
        y = labels[name]
        spec = PartitionSpec("dirichlet", clients=k, alpha=alpha, min_size=min_size, seed=0)
        t0 = time.perf_counter()
        try:
            make_partition(y, spec)
            msg = "no error"
        except FedForgetError as e:
            msg = str(e)
        took = time.perf_counter() - t0
        line = f"{name} N={len(y)} clients={k} alpha={alpha} min_size={min_size}: {took:.2f} s"
        if before and min_size * k <= len(y):
            rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 0x5A17]))  # partition.py's stream
            t0 = time.perf_counter()
            before(y, spec, rng)
            line += f" (before: {time.perf_counter() - t0:.2f} s)"
        print(f"{line}\n  {msg}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
