"""What the clients' sketches hold in memory until the server reads their sum (issue 32: the
memory each job needs): FOT's and FedProTIP's (Table 19), with the trainers folding each
client's sketches into one running total as its report arrives (``methods.base.Summed``,
``fold_summed``) and, for comparison, without (``--fold off``: the fold made a no-op, every
client's report held until the server sums them, as the code did before the fold, FedProTIP's
server then stacking a layer's shares as float64 before summing them, as it did; the same
bits either way, tests/methods/test_protocol.py, tests/methods/test_fedprotip.py).

Settings (``--method``), the paper configs' ResNet-18 at 32 px (``task_end_cost.paper_settings``):
* ``fot``: FOT of FedGP Table 15 (the CIFAR ResNet-18, ``resnet18``), sketch factor 5
  (s_l = 5 d_l); ``--modes``:
  ``sketch_model`` local (the paper default: the clients trained in the task's last round
  sketch their local models, in the training phase) or global (every client holding the task
  sketches the final global model, in the task-end exchange);
* ``fedprotip``: FedProTIP's weighted Gaussian sketches of Table 19 (``resnet18_imagenet``,
  10 classes a task, per-task heads; ``--sketch``: full,
  s_l = d_l, or a column count), made at the task end (mode ``task_end``) after each client's
  core bases of its ``--rows`` rows (their decompositions are in the peak too).
``--clients`` K clients sketching at a task end, ``--rows`` rows each (a sketch's size does
not depend on the rows: d_l x s_l a layer), on synthetic uint8 images
(``task_end_cost.run_config``: 2 tasks, one round each, iid).

Measured, each (method, mode, K, fold) in a fresh process (``--one``; a process's peak
resident memory does not come down): the process's resident memory (``VmRSS``) before round 1
and the round's peak (``fedforget.memory.PhaseMemory``: ``VmHWM``), or with ``--device cuda``
the GPU memory torch allocated before it and the round's peak
(``torch.cuda.max_memory_allocated``: the sketches are made and summed on the GPU). At the task
end the server reads the sum, layer by layer, as the methods' ``server_collect`` read it
(``summed_total``, ``SummedTotal.part``); the rest of their task-end step is not run (its
decompositions are timed by ``task_end_cost.py``; here they would add their own workspace),
nor is evaluation or FedProTIP's second exchange (its references against the new bases).
``held_mb`` = peak - before, in MB (2^20 bytes); ``share_mb``: one client's
sketches (the float32 size of the total's parts); the shares and totals the server was handed
are counted (``totals``: distinct Summed objects, ``shares``: the clients in them).

    python benchmarks/sketch_memory.py --method fot --clients 1 2 5 --json out.json
    python benchmarks/sketch_memory.py --method fedprotip --clients 5 10 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from task_end_cost import paper_settings, run_config  # noqa: E402

from fedforget import trainers  # noqa: E402
from fedforget.data import prepare_dataset  # noqa: E402
from fedforget.engine import Simulation  # noqa: E402
from fedforget.memory import PhaseMemory, status_mb  # noqa: E402
from fedforget.methods.base import TASK_END, Summed, SummedTotal, summed_total  # noqa: E402
from fedforget.methods.shared import float32_mb  # noqa: E402

MB = 2**20


SUMMED = {"fot": "y", "fedprotip": "bases"}  # where a method's report carries its Summed sketches
MODES = {"fot": ("local", "global"), "fedprotip": ("task_end",)}
SHARE_GB = {"fot": 1.9, "fedprotip": 0.4}  # a client's sketches at most (FOT's 1.85 GB, FedProTIP's full 0.37)


def setting(method: str, sketch: str) -> dict[str, Any]:
    """The paper configs' 32 px task-end setting of ``method`` with the most runs: FOT's on
    the CIFAR ResNet-18 (FedGP Table 15), FedProTIP's Table 19 run with ``sketch``."""
    model = {"fot": "resnet18", "fedprotip": "resnet18_imagenet"}[method]
    for s in paper_settings():
        if s["method"] == method and s["model"] == model and s["shape"][-1] == 32:
            if method == "fot" or str(s["params"].get("sketch")) == sketch:
                return s
    raise RuntimeError(f"no {method} run (sketch {sketch}) on a 32 px {model} in config/experiments/paper")


def found(message: Any, into: list[Summed | SummedTotal]) -> None:
    if isinstance(message, dict):
        for v in message.values():
            found(v, into)
    elif isinstance(message, (Summed, SummedTotal)):
        into.append(message)


def one(method: str, mode: str, clients: int, rows: int, fold: bool, threads: int, device: str,
        sketch: str) -> dict[str, Any]:  # fmt: skip
    """One measurement (module docstring), in this process."""
    torch.set_num_threads(threads)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if not fold:
        trainers.fold_summed = lambda totals, message, at=(): None
    s = setting(method, sketch)
    with tempfile.TemporaryDirectory() as root:
        rc = run_config(s, rows, clients, root, threads)
        params = {**rc.method.params, "sketch_model": mode} if method == "fot" else rc.method.params
        rc = dataclasses.replace(rc, method=dataclasses.replace(rc.method, params=params),
                                 train=dataclasses.replace(rc.train, device=device))  # fmt: skip
        prepare_dataset(rc.dataset.name, rc.dataset.options, root)
        sim = Simulation(rc, device=dev)
        sim.global_metrics = lambda rnd: ({}, [])
        seen: dict[str, Any] = {}

        def collect(exchange: str, replies: dict[int, Any]) -> None:
            reports = sim.server.state.get("fot_pending", {}) if mode == "local" else replies
            got: list[Summed | SummedTotal] = []
            found(reports, got)
            distinct = {id(v): v for v in got}.values()
            seen["totals"], seen["shares"] = len(distinct), sum(getattr(v, "clients", 1) for v in distinct)
            order = sorted(reports)
            total = summed_total(reports[c][SUMMED[method]] for c in order)
            seen["share_mb"] = float32_mb(total.shape(k) for k in total.names()) * 1e6 / MB
            for name in total.names():  # the server's read of the sum, a layer at a time (server_collect)
                if method == "fedprotip" and not fold:  # its read before the fold: the shares stacked
                    torch.stack([reports[c][SUMMED[method]].parts[name].double() for c in order]).sum(0)
                else:
                    total.part(name)

        sim.collect = collect
        sim.method.exchanges = (TASK_END,)  # FedProTIP's references: against no new bases here
        memory = PhaseMemory(dev)  # the round's peak: GPU memory allocated, or resident memory
        if not (cuda or memory.cpu_ok):
            raise SystemExit("this system does not let a process reset its peak resident memory (fedforget.memory)")
        before = torch.cuda.memory_allocated(dev) / MB if cuda else status_mb("VmRSS")
        if before is None:
            raise SystemExit("VmRSS is not in /proc/self/status (fedforget.memory.status_mb)")
        t0 = time.perf_counter()
        with memory.phase("round"):
            sim.run_round(1, t0)
        seconds = time.perf_counter() - t0
        seen["peak_mb"] = memory.peaks["round"]
    return {"method": method, "mode": mode, "clients": clients, "rows": rows, "fold": fold, "threads": threads,
            "device": device, "memory": "torch.cuda.max_memory_allocated" if cuda else "VmHWM",
            "model": s["model"], "shape": s["shape"], "sketch": params.get("sketch", params.get("sketch_factor")),
            "share_mb": seen["share_mb"], "before_mb": before, "peak_mb": seen["peak_mb"],
            "held_mb": seen["peak_mb"] - before, "held_shares": (seen["peak_mb"] - before) / seen["share_mb"],
            "totals": seen["totals"], "shares": seen["shares"], "seconds": seconds}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="fot", choices=sorted(SUMMED))
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 5])
    ap.add_argument("--modes", nargs="+", default=None, choices=sorted({m for v in MODES.values() for m in v}),
                    help="fot: local global (default both); fedprotip: task_end")
    ap.add_argument("--sketch", default="full", help="fedprotip: the sketch of Table 19's run (full, 128, 64)")
    ap.add_argument("--folds", nargs="+", default=["on", "off"], choices=["on", "off"])
    ap.add_argument("--rows", type=int, default=16, help="rows a client (a sketch's size does not depend on them)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu (peak resident memory) or cuda (peak GPU memory allocated)")
    ap.add_argument("--max-held-gb", type=float, default=None,
                    help="skip a run without the fold whose hold (K shares, at most SHARE_GB each) is above this "
                         "(default: 12 on the CPU, this 24 GB machine's host memory; 40 on a GPU)")
    ap.add_argument("--one", nargs=3, metavar=("MODE", "K", "FOLD"), help=argparse.SUPPRESS)
    ap.add_argument("--json")
    a = ap.parse_args()
    modes = a.modes or list(MODES[a.method])
    if any(m not in MODES[a.method] for m in modes):
        ap.error(f"--modes {' '.join(modes)}: allowed for --method {a.method}: {' '.join(MODES[a.method])}")
    if a.one:
        mode, k, fold = a.one
        print(json.dumps(one(a.method, mode, int(k), a.rows, fold == "on", a.threads, a.device, a.sketch)))
        return
    rows: list[dict[str, Any]] = []
    for mode in modes:
        for k in a.clients:
            for fold in a.folds:
                limit = a.max_held_gb or (40.0 if a.device.startswith("cuda") else 12.0)
                if fold == "off" and k * SHARE_GB[a.method] > limit:
                    continue
                cmd = [sys.executable, __file__, "--method", a.method, "--one", mode, str(k), fold, "--rows",
                       str(a.rows), "--threads", str(a.threads), "--device", a.device, "--sketch", a.sketch]  # fmt: skip
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode:
                    row = {"method": a.method, "mode": mode, "clients": k, "fold": fold == "on",
                           "error": out.stderr.strip()[-500:]}  # fmt: skip
                else:
                    row = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(json.dumps(row), flush=True)
                if a.json:
                    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
                    Path(a.json).write_text(json.dumps({"rows": rows, "argv": sys.argv[1:]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
