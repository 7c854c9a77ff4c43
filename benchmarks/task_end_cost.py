"""What the task ends of the paper configs' continual methods cost (issue 32; the estimate's
gap ``benchmarks/paper_runtime.py`` listed until the twelfth session of 2026-12-05): the
clients' TASK_END (and AFTER_TASK) replies and the server's collects, measured on this
machine at each paper run's model, input shape, method parameters, clients and rows per
client, and stated as the training inputs the same machine processes in that time
(``task_end_rows``), the unit ``paper_runtime.py --task-end-cost`` times on a GPU.

Which runs: every run of config/experiments/paper whose method (or, for FedGP, its base)
declares the TASK_END exchange (FedProTIP's core bases and references, GPM's and FOT's
bases, iCaRL's, GLFC's and LGA's exemplars), except the methods with a synthesizer (TARGET,
Tar+LODE, LANDER), whose task ends ``paper_runtime.synthesis_flops`` counts. Runs that differ
only in ``threshold`` / ``threshold_step`` (the energy thresholds: the ranks kept, not the
work) share a setting [D].

Per setting (``measure``), on synthetic uint8 images of the run's input shape (``bench_images``,
uniform noise, balanced classes; no download):

* the stream: split, 2 tasks of the run's classes per task (a split stream's, else every
  class of the dataset), its ``heads``; one round per task;
* the partition: iid over ``clients_bench`` clients, each holding ``rows_bench`` rows of a
  task: the clients whose work makes the run's task end (``paper_runtime.end_clients``: every
  client, or for FOT's local sketch a round's sampled clients) and the run's rows per client
  and task (``paper_runtime.rows_per_task`` / clients), at most ``--max-clients`` and ``--cap``
  (``BENCH_CAPS``: 2 clients of 512 rows at inputs above 64 px, where a client's 512 inputs
  take a minute on two CPU cores; every client, 4,096 rows below);
* the stream's ``incremental`` is ``class`` and the unit's batch ``TRAIN_BATCH`` (64) whatever
  the run's (neither changes a task end's work) [D];
* no local training [D]: the rounds' ``train_round`` returns no upload, so the task end runs
  on the initial global model. The work of a task end (forward passes over the rows a client
  reads, its SVDs or herding, the server's merge) does not depend on training; the ranks
  kept do, and with them the server's merge and the projections of later tasks;
* FOT's local sketch, made in a task's last round with the clients' last uploads, is timed as
  its global variant's, the same sketch made at the task end (``AT_TASK_END``) [D];
* timed: the first task end (``Simulation.end_task``: every client holding the task replies,
  the server collects; AFTER_TASK likewise), ``--repeats`` times on fresh simulations, the
  median; ``rows_read``: the rows a client's replies drew from its task data
  (``TaskView.sample`` / ``all``, counted; ``ReadCounter``), the mean over clients;
* scaled: the clients' part (``clients_s``: the trainer's ``client_pass`` calls) by
  ``end_clients`` / bench clients, and by the rows the same reads draw at the run's rows per client
  over those they drew here (``rows_read_at_run`` / ``rows_read``): a read of every row
  (``TaskView.all``: FOT with ``samples: 0``, iCaRL's and GLFC's herding; ``reads_all``)
  grows with the rows, ``sample(m)`` (FedProTIP's, GPM's ``samples``) to min(m, rows) [D:
  the clients' work taken as proportional to their rows]. The server's part (``server_s``,
  the rest) as measured [D: on the bench clients' replies; its d x d decompositions do not
  grow with clients, its products do];
* the unit: ``train_samples_per_s``, a plain training loop of the same model (SGD, train
  mode, ``--train-steps`` batches of ``TRAIN_BATCH`` after one untimed) on this
  machine; ``task_end_rows`` = scaled seconds x that rate.

``paper_runtime.py`` times a run's task ends (one per task: ``Scenario.ends_task`` holds at
the last round of each, the last task's too) as ``task_end_rows`` training inputs each at the
run's training rate on the GPU [D: the ratio of a task end to training measured on this
machine taken to hold on the GPU, as the methods' ratios m are].

A time box: ``--budget`` seconds (the settings left, the rarest, get an error row: their runs'
task ends count as unmeasured), ``--skip`` earlier files (their settings are not measured
again: a later call goes on where one stopped), ``--min-size`` / ``--max-size`` to give the
224 px settings smaller caps.

    python benchmarks/task_end_cost.py --list
    python benchmarks/task_end_cost.py --json benchmarks/results/<device>-<date>/task_end_cost.json
    python benchmarks/task_end_cost.py --only fedprotip --max-size 64 --json out.json
    python benchmarks/task_end_cost.py --skip out.json --min-size 65 --cap 64 --max-clients 1 --json more.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedforget.clientdata import TaskView
from fedforget.config import DatasetSpec, MethodSpec, OptimizerSpec, RunConfig, TrainSpec
from fedforget.data import DATASETS, DatasetInfo, prepare_dataset
from fedforget.data.base import Arrays
from fedforget.data.scenario import resolve_scenario
from fedforget.engine import Simulation
from fedforget.models import build_model
from fedforget.partition import PartitionSpec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from paper_runtime import config_runs, has_task_end, task_end_key, task_end_rates, task_end_setting  # noqa: E402

IMAGES = "bench_images"


def paper_settings() -> list[dict[str, Any]]:
    """The distinct task-end settings of config/experiments/paper, most runs first."""
    count: collections.Counter = collections.Counter()
    first: dict[str, dict[str, Any]] = {}
    for path in sorted((REPO / "config/experiments/paper").glob("*.yaml")):
        for rc in config_runs(path):
            if has_task_end(rc.method.name, dict(rc.method.params)):
                s = task_end_setting(rc)
                count[task_end_key(s)] += 1
                first.setdefault(task_end_key(s), s)
    return [{**first[k], "paper_runs": n} for k, n in count.most_common()]


def build_images(num_train: int, num_test: int, channels: int, size: int, classes: int, seed: int = 0) -> Arrays:
    """Uniform uint8 noise images, balanced labels (a task end's work depends on the
    shapes, not the pixels)."""
    rng = np.random.default_rng(seed)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        return rng.integers(0, 256, size=(n, channels, size, size), dtype=np.uint8), np.arange(n) % classes

    return Arrays(*draw(num_train), *draw(num_test), [str(i) for i in range(classes)])


def images_dataset(classes: int) -> str:
    """``bench_images`` with ``classes`` classes, registered in this process only."""
    name = f"{IMAGES}_{classes}"
    if name not in DATASETS:
        DATASETS.register(name)(DatasetInfo(
            name=name, description="uniform uint8 noise images (benchmarks/task_end_cost.py)",
            build=lambda **o: build_images(classes=classes, **o),
            defaults={"num_train": 1000, "num_test": 10, "channels": 3, "size": 32, "seed": 0},
            input_shape=lambda o: (int(o["channels"]), int(o["size"]), int(o["size"])), num_classes=classes,
            sizes=lambda o: (int(o["num_train"]), int(o["num_test"])), uint8_images=lambda o: True,
        ))  # fmt: skip
    return name


LARGE = 64  # px: above, a client's task end reads costly inputs (BENCH_CAPS)
BENCH_CAPS = {"large": (512, 2), "small": (4096, None)}  # (rows per client, clients) at most; None: all


def bench_size(s: dict[str, Any], a: argparse.Namespace) -> tuple[int, int]:
    """(rows per client, clients) of the benchmark's task: the run's, at most ``--cap`` /
    ``--max-clients`` (defaults ``BENCH_CAPS``: 512 rows and 2 clients at inputs above 64 px,
    4,096 rows and every client below)."""
    rows, clients = BENCH_CAPS["large" if s["shape"][-1] > LARGE else "small"]
    rows, clients = a.cap or rows, a.max_clients or clients or s["end_clients"]
    return min(s["rows_per_client"], rows), min(s["end_clients"], clients)


# a method whose task-end work a run does in its task's last round, timed as the variant that
# does the same work at the task end: FOT's local sketch (each trained client's sketch of all
# its task data, on its model just trained, sent with its last upload) as its global one (the
# same sketch on the final global model, from every client holding the task: here the bench's
# clients, as many as the run's sampled ones, ``end_clients``) [D]
AT_TASK_END = {"fot": {"sketch_model": "global"}}


def run_config(s: dict[str, Any], rows: int, clients: int, root: str, threads: int) -> RunConfig:
    classes = 2 * s["classes"]
    name = images_dataset(classes)
    options = {"num_train": 2 * clients * rows, "num_test": 10, "channels": s["shape"][0], "size": s["shape"][-1]}
    stream = {"kind": "split", "tasks": 2, "classes_per_task": s["classes"], "incremental": "class",
              "heads": s["heads"], "rounds_per_task": 1}  # fmt: skip
    sc = resolve_scenario(stream, classes, tuple(s["shape"]), "scenario")
    ds = DatasetSpec(name, options, s["model"], s["options"], None, name, sc)
    t = TrainSpec(rounds=2, local_epochs=1, batch_size=TRAIN_BATCH, sample_rate=1.0, eval_local_models=False,
                  eval_every=10**9, threads=threads, device="cpu", client_engine="sequential",
                  optimizer=OptimizerSpec(lr=0.01), checkpoint_every=10**9)  # fmt: skip
    part = PartitionSpec("iid", clients=clients, seed=0)
    method = MethodSpec(s["method"], {**s["params"], **AT_TASK_END.get(s["method"], {})}, s["method"])
    return RunConfig("task_end", ds, part, method, 0, t, root, f"{root}/results")


class ReadCounter:
    """Records the rows clients draw from their task data (``TaskView.sample`` / ``all``)
    while active: each call's rows and what it asked for (m, or None for all)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int | None, int]] = []  # (m asked, or None for every row; rows drawn)
        self.saved: tuple = ()

    def __enter__(self) -> ReadCounter:
        sample, every = TaskView.sample, TaskView.all
        calls = self.calls

        def counted_sample(view, m, generator):
            out = sample(view, m, generator)
            calls.append((int(m), len(out[1])))
            return out

        def counted_all(view):
            out = every(view)
            calls.append((None, len(out[1])))
            return out

        self.saved = (sample, every)
        TaskView.sample, TaskView.all = counted_sample, counted_all
        return self

    def __exit__(self, *exc: Any) -> None:
        TaskView.sample, TaskView.all = self.saved

    def drawn(self) -> int:
        return sum(n for _, n in self.calls)

    def at(self, rows: int) -> int:
        """The rows the same calls draw from ``rows`` rows a client: every row for ``all``,
        min(m, rows) for ``sample(m)``."""
        return sum(rows if m is None else min(m, rows) for m, _ in self.calls)


def time_task_end(rc: RunConfig) -> tuple[float, float, ReadCounter]:
    """(seconds of the first task end, of them the clients' replies (``trainer.client_pass``),
    the rows the clients drew in it) of a fresh simulation that trains nothing (module
    docstring)."""
    sim = Simulation(rc, device=torch.device("cpu"))
    sim.global_metrics = lambda rnd: ({}, [])
    sim.trainer.train_round = lambda rnd, lr, views: ([], [], {}, {}, 0.0)
    timed: list[float] = []
    replies: list[float] = []
    ending = [False]  # within the task end: its client passes count (a ROUND_END pass after it does not)
    inner, client_pass = sim.end_task, sim.trainer.client_pass

    def end(rnd: int, lr: float) -> None:
        t0 = time.perf_counter()
        ending[0] = True
        try:
            inner(rnd, lr)
        finally:
            ending[0] = False
        timed.append(time.perf_counter() - t0)

    def passes(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = client_pass(*args, **kwargs)
        if ending[0]:
            replies.append(time.perf_counter() - t0)
        return out

    sim.end_task, sim.trainer.client_pass = end, passes
    with ReadCounter() as reads:
        sim.run_round(1, time.perf_counter())
    return timed[0], sum(replies), reads


TRAIN_BATCH = 64  # the unit's batch (the paper runs': 32 to 128, most 64) [D]
_RATES: dict[str, float] = {}


def train_rate(s: dict[str, Any], steps: int) -> float:
    """Training inputs per second of a plain loop of the setting's model on this machine
    (SGD, train mode, batches of ``TRAIN_BATCH``, one untimed first); once per model,
    options, shape and classes."""
    classes = 2 * s["classes"]
    key = json.dumps([s["model"], s["options"], s["shape"], classes])
    if key in _RATES:
        return _RATES[key]
    model = build_model(s["model"], tuple(s["shape"]), classes, s["options"])
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    x = torch.rand((TRAIN_BATCH, *s["shape"]), generator=g)
    y = torch.randint(0, classes, (TRAIN_BATCH,), generator=g)
    t0 = 0.0
    for i in range(steps + 1):
        if i == 1:
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    _RATES[key] = steps * TRAIN_BATCH / (time.perf_counter() - t0)
    return _RATES[key]


def measure(s: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    rows, clients = bench_size(s, a)
    with tempfile.TemporaryDirectory(dir=a.data) as root:
        rc = run_config(s, rows, clients, root, a.threads)
        prepare_dataset(rc.dataset.name, rc.dataset.options, root)
        runs = [time_task_end(rc) for _ in range(a.repeats)]
    seconds, replies = (statistics.median(r[i] for r in runs) for i in range(2))
    reads = runs[0][2]
    drawn, at_run = reads.drawn(), reads.at(s["rows_per_client"])
    scale = (at_run / drawn if drawn else 1.0) * s["end_clients"] / clients
    scaled = replies * scale + (seconds - replies)
    rate = train_rate(s, a.train_steps)
    return {**s, "rows_bench": rows, "clients_bench": clients, "rows_read": drawn / clients,
            "rows_read_at_run": at_run / clients, "reads_all": any(m is None for m, _ in reads.calls), "scale": scale,
            "task_end_s": seconds, "clients_s": replies, "server_s": seconds - replies,
            "task_end_s_all": [r[0] for r in runs], "task_end_s_scaled": scaled,
            "train_samples_per_s": rate, "task_end_rows": scaled * rate}  # fmt: skip


def selected(settings: list[dict[str, Any]], a: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """The settings to measure: of ``--only``'s methods, between ``--min-size`` and
    ``--max-size``, not measured in a ``--skip`` file."""
    done = set(task_end_rates(a.skip))  # the settings measured there (rows with an error left out)
    for s in settings:
        if a.only and s["method"] not in a.only:
            continue
        if (a.max_size and s["shape"][-1] > a.max_size) or (a.min_size and s["shape"][-1] < a.min_size):
            continue
        if task_end_key(s) not in done:
            yield s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="task ends timed per setting (fresh simulations)")
    ap.add_argument("--train-steps", type=int, default=2, help="timed steps of the plain training loop")
    ap.add_argument("--cap", type=int, default=None, help="rows per client at most (default 512 above 64 px, 4096 below)")
    ap.add_argument("--max-clients", type=int, default=None, help="clients at most (default 2 above 64 px, all below)")
    ap.add_argument("--only", nargs="*", help="methods to measure (default: all)")
    ap.add_argument("--max-size", type=int, default=None, help="skip settings whose inputs are larger (px)")
    ap.add_argument("--min-size", type=int, default=None, help="skip settings whose inputs are smaller (px)")
    ap.add_argument("--skip", nargs="*", default=[],
                    help="earlier --json outputs: the settings they measured are not measured again (their rows "
                         "are not repeated; paper_runtime.py --task-end-cost reads every file)")
    ap.add_argument("--budget", type=float, default=float("inf"),
                    help="seconds: start no setting after this (those left get an error row, the rarest settings)")
    ap.add_argument("--list", action="store_true", help="print the settings and stop")
    ap.add_argument("--data", default=tempfile.gettempdir())
    ap.add_argument("--json", help="write the rows here (after every setting)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    settings = list(selected(paper_settings(), a))
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for i, s in enumerate(settings):
        what = (f"[{i + 1}/{len(settings)}] {s['method']} {json.dumps(s['params'])} {s['model']} {tuple(s['shape'])} "
                f"{s['clients']} clients ({s['end_clients']} at a task end) x {s['rows_per_client']} rows "
                f"({s['paper_runs']} runs)")  # fmt: skip
        if a.list:
            print(what)
            continue
        try:
            if time.perf_counter() - start > a.budget:
                raise TimeoutError("not measured: --budget spent")
            rows.append(measure(s, a))
        except Exception as e:  # noqa: BLE001  (one setting's failure is reported, the others run)
            rows.append({**s, "error": f"{type(e).__name__}: {e}"})
        r = rows[-1]
        if "error" in r:
            print(f"{what}: {r['error']}", flush=True)
        else:
            scaled = f", x{r['scale']:.2f}" if r["scale"] != 1 else ""
            print(f"{what}: {r['task_end_s']:.2f} s (clients {r['clients_s']:.2f} s{scaled}), {r['clients_bench']} x "
                  f"{r['rows_bench']} rows (read {r['rows_read']:.0f}), training {r['train_samples_per_s']:.0f}/s: "
                  f"{r['task_end_rows']:.0f} training rows", flush=True)  # fmt: skip
        if a.json:
            meta = {"device": "cpu", "threads": a.threads, "torch": torch.__version__, "repeats": a.repeats,
                    "train_steps": a.train_steps, "train_batch": TRAIN_BATCH, "cap": a.cap,
                    "max_clients": a.max_clients, "caps": BENCH_CAPS, "large_px": LARGE, "cpus": os.cpu_count()}  # fmt: skip
            Path(a.json).write_text(json.dumps({"setting": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
