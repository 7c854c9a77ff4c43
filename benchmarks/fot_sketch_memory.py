"""What FOT's clients' sketches hold in memory until the server reads their sum (issue 32:
the memory each job needs), with the trainers folding each client's sketches into one running
total as its report arrives (``methods.base.Summed``, ``fold_summed``) and, for comparison,
without (``--fold off``: the fold made a no-op, every client's report held until the server
sums them, as the code did before the fold; the same bits either way,
tests/methods/test_protocol.py).

Setting: FOT of the paper configs' CIFAR ResNet-18 (FedProTIP Tables 1-3: 32 px, 10 classes a
task; ``task_end_cost.paper_settings``), sketch factor 5 (s_l = 5 d_l), ``--clients`` K
clients sketching at a task end, ``--rows`` rows each (a sketch's size does not depend on the
rows: d_l x s_l a layer), on synthetic uint8 images (``task_end_cost.run_config``: 2 tasks,
one round each, iid). ``sketch_model`` local (the paper default: the clients trained in the
task's last round sketch their local models, in the training phase) or global (every client
holding the task sketches the final global model, in the task-end exchange).

Measured, each (mode, K, fold) in a fresh process (``--one``; a process's peak resident
memory does not come down): the process's resident memory (``VmRSS``) before round 1 and the
round's peak (``fedforget.memory.PhaseMemory``: ``VmHWM``), or with ``--device cuda`` the GPU
memory torch allocated before it and the round's peak (``torch.cuda.max_memory_allocated``: the
sketches are made and summed on the GPU). At the task end the server reads the sum, layer by
layer, as ``FOT.server_collect`` reads it (``summed_total``, ``SummedTotal.part``); the rest of
its task-end step is not run (its decompositions are timed by ``task_end_cost.py``; here they
would add their own workspace), nor is evaluation. ``held_mb`` =
peak - before, in MB (2^20 bytes); ``share_mb``: one client's sketches, sum_l d_l s_l float32
values (``fot.sketch_width`` over ``shared.projected_layers``), computed; the shares and
totals the server was handed are counted (``totals``: distinct Summed objects, ``shares``:
the clients in them).

    python benchmarks/fot_sketch_memory.py --clients 1 2 5 --json out.json
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
from fedforget.activations import layer_dim  # noqa: E402
from fedforget.data import prepare_dataset  # noqa: E402
from fedforget.engine import Simulation  # noqa: E402
from fedforget.memory import STATUS, PhaseMemory  # noqa: E402
from fedforget.methods.base import Summed, SummedTotal, summed_total  # noqa: E402
from fedforget.methods.fot import sketch_width  # noqa: E402
from fedforget.methods.shared import projected_layers  # noqa: E402

MB = 2**20


def status_mb(field: str) -> float:
    """The process's ``field`` of /proc/self/status (VmRSS: its resident memory now), in MB (2^20)."""
    for line in STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in {STATUS}")


def fot_setting() -> dict[str, Any]:
    """The paper configs' FOT task-end setting on the 32 px ResNet-18 with the most runs."""
    for s in paper_settings():
        if s["method"] == "fot" and s["model"] == "resnet18" and s["shape"][-1] == 32:
            return s
    raise RuntimeError("no FOT run on a 32 px ResNet-18 in config/experiments/paper")


def found(message: Any, into: list[Summed | SummedTotal]) -> None:
    if isinstance(message, dict):
        for v in message.values():
            found(v, into)
    elif isinstance(message, (Summed, SummedTotal)):
        into.append(message)


def one(mode: str, clients: int, rows: int, fold: bool, threads: int, device: str) -> dict[str, Any]:
    """One measurement (module docstring), in this process."""
    torch.set_num_threads(threads)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if not fold:
        trainers.fold_summed = lambda totals, message, at=(): None
    s = fot_setting()
    with tempfile.TemporaryDirectory() as root:
        rc = run_config(s, rows, clients, root, threads)  # (which times the sketch as the global variant's)
        rc = dataclasses.replace(rc, method=dataclasses.replace(rc.method, params={**rc.method.params, "sketch_model": mode}),
                                 train=dataclasses.replace(rc.train, device=device))  # fmt: skip
        prepare_dataset(rc.dataset.name, rc.dataset.options, root)
        sim = Simulation(rc, device=dev)
        sim.global_metrics = lambda rnd: ({}, [])
        seen: dict[str, Any] = {}

        def collect(exchange: str, replies: dict[int, Any]) -> None:
            reports = replies if mode == "global" else sim.server.state.get("fot_pending", {})
            got: list[Summed | SummedTotal] = []
            found(reports, got)
            distinct = {id(v): v for v in got}.values()
            seen["totals"], seen["shares"] = len(distinct), sum(getattr(v, "clients", 1) for v in distinct)
            total = summed_total(reports[c]["y"] for c in sorted(reports))
            for name in total.names():  # the server's read of the sum, a layer at a time (FOT.server_collect)
                total.part(name)

        sim.collect = collect
        model = sim.server.model
        share = sum(layer_dim(m) * sketch_width(layer_dim(m), float(rc.method.params["sketch_factor"])) * 4
                    for m in projected_layers(model).values()) / MB  # fmt: skip
        memory = PhaseMemory(dev)  # the round's peak: GPU memory allocated, or resident memory
        if not (cuda or memory.cpu_ok):
            raise SystemExit("this system does not let a process reset its peak resident memory (fedforget.memory)")
        before = torch.cuda.memory_allocated(dev) / MB if cuda else status_mb("VmRSS")
        t0 = time.perf_counter()
        with memory.phase("round"):
            sim.run_round(1, t0)
        seconds = time.perf_counter() - t0
        seen["peak_mb"] = memory.peaks["round"]
    return {"mode": mode, "clients": clients, "rows": rows, "fold": fold, "threads": threads, "device": device,
            "memory": "torch.cuda.max_memory_allocated" if cuda else "VmHWM",
            "model": s["model"], "shape": s["shape"], "sketch_factor": rc.method.params["sketch_factor"],
            "share_mb": share, "before_mb": before, "peak_mb": seen["peak_mb"],
            "held_mb": seen["peak_mb"] - before, "held_shares": (seen["peak_mb"] - before) / share,
            "totals": seen["totals"], "shares": seen["shares"], "seconds": seconds}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 5])
    ap.add_argument("--modes", nargs="+", default=["local", "global"], choices=["local", "global"])
    ap.add_argument("--folds", nargs="+", default=["on", "off"], choices=["on", "off"])
    ap.add_argument("--rows", type=int, default=16, help="rows a client (a sketch's size does not depend on them)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu (peak resident memory) or cuda (peak GPU memory allocated)")
    ap.add_argument("--max-held-gb", type=float, default=None,
                    help="skip a run without the fold whose computed hold (K shares) is above this (default: 12 on "
                         "the CPU, this 24 GB machine's host memory; 40 on a GPU)")
    ap.add_argument("--one", nargs=3, metavar=("MODE", "K", "FOLD"), help=argparse.SUPPRESS)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.one:
        mode, k, fold = a.one
        print(json.dumps(one(mode, int(k), a.rows, fold == "on", a.threads, a.device)))
        return
    rows: list[dict[str, Any]] = []
    for mode in a.modes:
        for k in a.clients:
            for fold in a.folds:
                limit = a.max_held_gb or (40.0 if a.device.startswith("cuda") else 12.0)
                if fold == "off" and k * 1.9 > limit:  # ~1.85 GB a share (module docstring)
                    continue
                cmd = [sys.executable, __file__, "--one", mode, str(k), fold, "--rows", str(a.rows),
                       "--threads", str(a.threads), "--device", a.device]  # fmt: skip
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode:
                    row = {"mode": mode, "clients": k, "fold": fold == "on", "error": out.stderr.strip()[-500:]}
                else:
                    row = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(json.dumps(row), flush=True)
                if a.json:
                    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
                    Path(a.json).write_text(json.dumps({"rows": rows, "argv": sys.argv[1:]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
