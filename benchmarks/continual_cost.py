"""What the continual baselines cost (issue 16): time per round and peak memory of each
method relative to FedAvg on one task stream, and the per-task cost of their task ends
(TARGET's and LANDER's server-side generator training, iCaRL's herding, GLFC's proxy
server, FedProTIP's bases). The FedProTIP paper (Sec. 6.5, Figs. 6-7) reports TARGET and
LANDER as the slowest methods and FedProTIP as the fastest after FedAvg.

Setting (printed and written to ``--json``): split digits 5 x 2, class-incremental, one
shared head (``--heads per_task`` for one head per task), cnn2d, Dirichlet 0.5 over 5
clients, all sampled, 5 local epochs, batch 64, SGD lr 0.1, wd 5e-4 (the FedProTIP Table 1
layout of config/experiments/fedprotip_table1.yaml); every method with its default
hyperparameters (the papers'), one client after another, ``--threads`` torch threads. A
surrogate set (8x8 ``blobs``, no digit classes) is declared for every run, so CFeD runs
too; the others ignore it. ``target_code``: TARGET with ``replay_rule: code`` (the authors'
code's synthetic rows per step and cut epochs). ``<method>@vectorized``: that method on the
stacked trainer (``--methods fedavg@vectorized,fedprotip@vectorized``: FedAvg and FedProTIP(-t)
batched, issue 32; vs_fedavg stays against the sequential FedAvg); ``<method>[@<engine>]~<n>``:
on n lanes (``train.concurrent_clients``: clients trained, and the task end's replies made, n
at a time; ``--methods fedprotip@vectorized,fedprotip@vectorized~2`` times FedProTIP's task
end both ways). ``<method>+<base>``: a method over a base (FedGP's ``base``, with
``base_params`` the base's ``PARAMS``), the ratio ``benchmarks/paper_runtime.py`` takes for
that pairing (``--methods fedavg,der,fedgp,fedgp+der``). L2P is not in the default list: it is defined on a ViT, another model
(``--methods l2p`` runs it on a tiny ViT). ``--model vit``: every method on one ViT
(``--vit``, a JSON of the ``vit`` model's shape; default ``COST_VIT``: 112 px in patches of 8,
the 197 tokens of FedGP's ViT-B/16 at 224 px, so that L2P's 25 prompt tokens add the same
share, at 2 blocks of ViT-Tiny's width), FedAvg training the whole ViT: the ratio
``benchmarks/paper_runtime.py`` needs for L2P (its frozen backbone, the query pass and the
prompts) and for FedGP over it (``fedgp+l2p``).

Each method runs the first task (``--rounds`` rounds) and the rounds of the second; the
timed rounds are the second task's (everything a method keeps from the first exists:
exemplars, generators, bases), without evaluation. ``task_end_s``: the engine's end of the
first task (clients' and server's task-end hooks, after-task passes), apart from the
rounds. Rounds of all methods are interleaved so all see the same load; medians with
min-max. Peak memory: on a GPU, ``torch.cuda.max_memory_allocated`` over each method's own
rounds and task end; on a CPU, the peak resident memory of a separate process running the
method alone over the same rounds (Linux: VmHWM, reset after data preparation and model
building), less that of the same process running FedAvg (``peak_rss_over_fedavg_mib``).

    python benchmarks/continual_cost.py --json out.json
    python benchmarks/continual_cost.py --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from task_timing import time_task_ends

from fedforget.config import DatasetSpec, MethodSpec, OptimizerSpec, RunConfig, TrainSpec
from fedforget.data import DATASETS, prepare_dataset
from fedforget.data.scenario import resolve_scenario
from fedforget.engine import Simulation
from fedforget.memory import process_peak_mb, reset_process_peak
from fedforget.partition import PartitionSpec

METHODS = ("fedavg", "fedprotip", "fot", "icarl", "cfed", "glfc", "lga", "target", "target_lode", "lander", "scr")
# the hyperparameters of config/experiments/fedprotip_table1.yaml (the from-scratch eps;
# GLFC's and LGA's proxy inversion lightened for 8x8 digits; LANDER with TARGET's synthesis)
PROXY = {"memory_size": 60, "recon_iters": 20, "recon_inner": 5, "recon_keep": 5}
PARAMS = {
    "fedprotip": {"threshold": 0.95}, "glfc": PROXY,  # shared head: FedProTIP(-t), tip none (main) "lga": {**PROXY, "proxy_init": 3},
    "lander": {"syn_rounds": 10, "g_steps": 10, "warmup": 0, "syn_size": 2560},
    "scr": {"buffer_size": 60},  # Fed+SCR: fedprotip_table1.yaml's buffer (its code's memory batch 100)
}  # fmt: skip
# a method run under another name, with its own hyperparameters: TARGET under its code's
# replay rule (issue 36; ``target`` is the default rule)
VARIANTS = {"target_code": ("target", {"replay_rule": "code"})}
PUBLIC = {"source": "dataset", "dataset": "blobs", "options": {"size": 8, "num_train": 2000, "num_test": 10}}
TINY_VIT = {"image_size": 8, "patch_size": 4, "layers": 1, "heads": 2, "hidden_dim": 16, "mlp_dim": 32}
COST_VIT = {"image_size": 112, "patch_size": 8, "layers": 2, "heads": 3, "hidden_dim": 192, "mlp_dim": 768}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--heads", default="shared", choices=["shared", "per_task"])
    p.add_argument("--rounds", type=int, default=3, help="rounds per task; the second task's are timed")
    p.add_argument("--model", default="cnn2d", choices=["cnn2d", "vit"],
                   help="cnn2d: every method but L2P on the small CNN (L2P: a tiny ViT); vit: every method on --vit")
    p.add_argument("--vit", type=json.loads, default=COST_VIT, help="the vit model's options (JSON), with --model vit")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)
    p.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)  # child: one method's peak RSS
    return p.parse_args()


def build(a: argparse.Namespace, root: str, name: str) -> Simulation:
    info = DATASETS.get("digits")
    shape = tuple(info.input_shape(info.resolve({})))
    stream = {"kind": "split", "tasks": 5, "classes_per_task": 2, "incremental": "class",
              "rounds_per_task": a.rounds, "heads": a.heads}  # fmt: skip
    sc = resolve_scenario(stream, info.num_classes, shape, "scenario")
    name, _, lanes = name.partition("~")  # <method>[@<engine>][~<lanes>]
    name, _, engine = name.partition("@")
    if a.model == "vit":
        model, mopts = "vit", a.vit
    else:
        model, mopts = ("vit", TINY_VIT) if name.endswith("l2p") else ("cnn2d", {})
    method, _, base = name.partition("+")  # <method>+<base>: FedGP over a base, its params PARAMS's
    if base:
        params = {**PARAMS.get(method, {}), "base": base, "base_params": PARAMS.get(base, {})}
    else:
        method, params = VARIANTS.get(name, (name, PARAMS.get(name, {})))
    if name == "fedprotip" and a.heads == "shared":
        params = {**params, "tip": "none"}  # FedProTIP(-t): TIP routes to per-task heads
    ds = DatasetSpec("digits", {}, model, mopts, PUBLIC, "digits", sc)
    t = TrainSpec(
        rounds=5 * a.rounds, local_epochs=5, batch_size=64, sample_rate=1.0, eval_local_models=False,
        eval_every=10**6, threads=a.threads, device=a.device, client_engine=engine or "sequential",
        optimizer=OptimizerSpec(lr=0.1, weight_decay=5e-4), checkpoint_every=10**6,
        concurrent_clients=int(lanes or 1),
    )  # fmt: skip
    part = PartitionSpec("dirichlet", clients=5, alpha=0.5, min_size=10, seed=0)
    rc = RunConfig("bench", ds, part, MethodSpec(method, params, name), 0, t, root, f"{root}/results")
    return Simulation(rc, device=torch.device(a.device))


def prepare(root: str) -> None:
    prepare_dataset("digits", {}, root)
    prepare_dataset("blobs", PUBLIC["options"], root)


def child_peak(a: argparse.Namespace) -> None:
    """Run one method's two tasks' rounds alone; print the process's peak RSS (KiB) over
    those rounds (the data preparation and model building before them are not counted
    where the peak can be reset: fedforget.memory.reset_process_peak)."""
    with tempfile.TemporaryDirectory() as root:
        prepare(root)
        sim = build(a, root, a.memory_of)
        sim.global_metrics = lambda rnd: ({}, [])
        reset_process_peak()
        start = time.perf_counter()
        for rnd in range(1, 2 * a.rounds + 1):
            sim.run_round(rnd, start)
        print(round(process_peak_mb() * 1024))  # KiB


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    if a.memory_of:
        child_peak(a)
        return
    names = a.methods.split(",")
    cuda = a.device.startswith("cuda")
    setting = {
        "dataset": "digits", "stream": "split 5x2 class-IL", "heads": a.heads, "model": a.model,
        **({"vit": a.vit} if a.model == "vit" else {}), "clients": 5,
        "partition": "dirichlet 0.5", "sample_rate": 1.0, "local_epochs": 5, "batch_size": 64,
        "optimizer": "sgd lr 0.1 wd 5e-4", "rounds_per_task": a.rounds, "timed": "rounds of task 2",
        "threads": a.threads, "device": a.device, "torch": torch.__version__,
    }  # fmt: skip
    print("setting:", json.dumps(setting))
    with tempfile.TemporaryDirectory() as root:
        prepare(root)
        sims, errors = {}, {}
        for n in names:
            try:
                sims[n] = build(a, root, n)
            except Exception as e:  # noqa: BLE001 - reported, the others still run
                errors[n] = f"{type(e).__name__}: {e}"
        task_end = time_task_ends(sims)
        peak: dict[str, int] = {n: 0 for n in sims}
        times: dict[str, list[float]] = {n: [] for n in sims}
        start = time.perf_counter()
        for rnd in range(1, 2 * a.rounds + 1):
            for n, sim in list(sims.items()):
                ends = len(task_end[n])
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                try:
                    sim.run_round(rnd, start)
                except Exception as e:  # noqa: BLE001
                    errors[n] = f"{type(e).__name__}: {e}"
                    del sims[n]
                    continue
                if cuda:
                    torch.cuda.synchronize()
                    peak[n] = max(peak[n], torch.cuda.max_memory_allocated())
                dt = time.perf_counter() - t0 - sum(task_end[n][ends:])
                if rnd > a.rounds:
                    times[n].append(dt)
    if not cuda:  # peak RSS of each method alone, in its own process
        for n in sims:
            cmd = [sys.executable, __file__, "--memory-of", n, "--rounds", str(a.rounds),
                   "--threads", str(a.threads), "--heads", a.heads, "--model", a.model, "--vit", json.dumps(a.vit)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            peak[n] = int(out.stdout.strip().splitlines()[-1]) * 1024 if out.returncode == 0 else 0
    result = {"setting": setting, "methods": {}, "errors": errors}
    ref = statistics.median(times["fedavg"]) if times.get("fedavg") else None
    base_peak = peak.get("fedavg", 0)
    for n in sorted(sims, key=lambda n: statistics.median(times[n])):
        ts = times[n]
        med = statistics.median(ts)
        r = {"s_per_round": {"median": med, "mean": statistics.mean(ts), "min": min(ts), "max": max(ts)},
             "task_end_s": task_end[n][0] if task_end[n] else None}  # fmt: skip
        if ref:
            r["vs_fedavg"] = med / ref
        if cuda:
            r["peak_gpu_mib"] = peak[n] / 2**20
            r["peak_gpu_vs_fedavg"] = peak[n] / base_peak if base_peak else None
        else:
            r["peak_rss_mib"] = peak[n] / 2**20
            r["peak_rss_over_fedavg_mib"] = (peak[n] - base_peak) / 2**20 if base_peak and peak[n] else None
        result["methods"][n] = r
        mem = (f"peak {r['peak_gpu_mib']:.0f} MiB" if cuda
               else f"peak RSS {(r['peak_rss_over_fedavg_mib'] or 0):+.1f} MiB over fedavg")  # fmt: skip
        rel = f" x{med / ref:.2f} of fedavg" if ref else ""
        end = f"task end {r['task_end_s']:.2f} s" if r["task_end_s"] is not None else ""
        print(f"{n:10s} {med * 1e3:8.1f} ms/round (mean {statistics.mean(ts) * 1e3:.1f}, min {min(ts) * 1e3:.1f}, "
              f"max {max(ts) * 1e3:.1f}){rel}  {end}  {mem}")
    for n, e in errors.items():
        print(f"{n:10s} error: {e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
