"""What FedGP costs: time per round of FedGP over a base method against the base alone
(the paper reports +7.2 % over FedAvg for 200 epochs of split CIFAR-100 on ResNet-18,
papers/fedgp.md Sec. 5.2, "Effect of computation overhead").

Setting (printed with every figure and written to ``--json``): a task stream (default
rotated digits, 5 tasks, cnn2d, two shards per client over 10 clients, all sampled), 1
local epoch, batch 32, SGD lr 0.1, buffer ``--buffer`` rows, ``--rounds`` timed rounds
after ``--warmup`` untimed ones, all in the first task (g_ref exists from round 2 on), on
``--threads`` torch threads, one client after another (FedGP's engine; the bases are timed
on the same engine). A round's time is local training, aggregation and FedGP's round-end
pass (each client's buffer gradient at the new global model); no evaluation. Medians with
min-max over the timed rounds, runs interleaved round by round so all see the same load.
``proj_share``: FedGP's share of projected steps in the timed rounds. ``round_end_share``: the
share of a round spent in the ROUND_END exchange (the trainer's ``client_pass``: FedGP's
buffer gradients, client by client on the sequential trainer, a stack at a time on the
stacked one since the first session of 2026-12-04), the median over the timed rounds.
``round_end_s``: that exchange's seconds, the median over the timed rounds.
``--model``: the model on digits (default cnn2d; e.g. mlp, whose stacks run as batched
matmuls on a CPU too, where a Conv2d model's stacks of 16 or more rows run client by client).

``--engines sequential,vectorized`` times every method on both local trainers (names
``<method>@<engine>``; the stacked trainer takes FedGP over a stacked base, FedAvg or FedProx,
issue 32); ``vs_sequential``: a stacked run's median against the same method's sequential one.

    python benchmarks/fedgp_overhead.py
    python benchmarks/fedgp_overhead.py --stream split --json fedgp_overhead.json
    python benchmarks/fedgp_overhead.py --bases fedavg,fedprox --engines sequential,vectorized
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from fedforget.config import DatasetSpec, MethodSpec, OptimizerSpec, RunConfig, TrainSpec
from fedforget.data import DATASETS, prepare_dataset
from fedforget.data.scenario import resolve_scenario
from fedforget.engine import Simulation
from fedforget.partition import PartitionSpec

STREAMS = {
    "rotated": ({"kind": "rotated", "tasks": 5}, PartitionSpec("shards", clients=10, shards_per_client=2, seed=0)),
    "split": (
        {"kind": "split", "tasks": 5, "classes_per_task": 2},
        PartitionSpec("dirichlet", clients=10, alpha=0.3, min_size=10, seed=0),
    ),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stream", default="rotated", choices=sorted(STREAMS))
    p.add_argument("--bases", default="fedavg,fedprox,agem,der")
    p.add_argument("--buffer", type=int, default=20)
    p.add_argument("--rounds", type=int, default=10, help="timed rounds per method")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engines", default="sequential", help="local trainers, comma-separated: sequential,vectorized")
    p.add_argument("--model", default="cnn2d", help="a registered model name, default options")
    p.add_argument("--json", default=None)
    return p.parse_args()


def methods(bases: list[str], buffer: int) -> dict[str, MethodSpec]:
    out = {}
    for b in bases:
        bp = {"buffer_size": buffer} if b in ("agem", "der") else ({"mu": 0.01} if b == "fedprox" else {})
        out[b] = MethodSpec(b, bp, b)
        gp = {"base": b, "base_params": bp} | ({} if "buffer_size" in bp else {"buffer_size": buffer})
        out[f"{b}+fedgp"] = MethodSpec("fedgp", gp, f"{b}+fedgp")
    return out


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    info = DATASETS.get("digits")
    shape = tuple(info.input_shape(info.resolve({})))
    scen, part = STREAMS[a.stream]
    rounds = a.warmup + a.rounds
    specs = methods(a.bases.split(","), a.buffer)
    engines = a.engines.split(",")
    setting = {
        "dataset": "digits", "model": a.model, "stream": a.stream, "partition": part.setting,
        "clients": part.clients, "sample_rate": 1.0, "local_epochs": 1, "batch_size": 32, "optimizer": "sgd lr 0.1",
        "buffer": a.buffer, "threads": a.threads, "client_engine": ",".join(engines), "timed_rounds": a.rounds,
        "warmup": a.warmup, "device": "cpu", "torch": torch.__version__,
    }  # fmt: skip
    print("setting:", json.dumps(setting))
    with tempfile.TemporaryDirectory() as tmp:
        prepare_dataset("digits", {}, tmp)
        s = resolve_scenario({**scen, "rounds_per_task": rounds}, info.num_classes, shape, "scenario")
        def train(engine: str) -> TrainSpec:
            return TrainSpec(
                rounds=5 * rounds, local_epochs=1, batch_size=32, sample_rate=1.0, eval_local_models=False,
                eval_every=10**6, threads=a.threads, device="cpu", client_engine=engine,
                optimizer=OptimizerSpec(lr=0.1),
            )  # fmt: skip

        ds = DatasetSpec("digits", {}, a.model, {}, None, "digits", s)
        sims = {
            name if len(engines) == 1 else f"{name}@{e}": Simulation(RunConfig("bench", ds, part, m, 0, train(e), tmp, f"{tmp}/results"))
            for e in engines for name, m in specs.items()
        }  # fmt: skip
        times: dict[str, list[float]] = {n: [] for n in sims}
        proj: dict[str, list[float]] = {n: [] for n in sims}
        in_pass: dict[str, list[float]] = {n: [0.0] for n in sims}  # this round's ROUND_END time so far
        for name, sim in sims.items():
            def timed(*args, _inner=sim.trainer.client_pass, _acc=in_pass[name], **kw):
                t0 = time.perf_counter()
                try:
                    return _inner(*args, **kw)
                finally:
                    _acc[0] += time.perf_counter() - t0

            sim.trainer.client_pass = timed
        end_s: dict[str, list[float]] = {n: [] for n in sims}
        start = time.perf_counter()
        for rnd in range(1, rounds + 1):
            for name, sim in sims.items():
                in_pass[name][0] = 0.0
                t0 = time.perf_counter()
                row = sim.run_round(rnd, start)
                if rnd > a.warmup:
                    times[name].append(time.perf_counter() - t0)
                    end_s[name].append(in_pass[name][0])
                    if "fedgp_proj_share" in row:
                        proj[name].append(row["fedgp_proj_share"])
    result = {"setting": setting, "s_per_round": {}}
    for name, ts in times.items():
        method, _, engine = name.partition("@")
        base = method.split("+")[0] + (f"@{engine}" if engine else "")
        med, bmed = statistics.median(ts), statistics.median(times[base])
        r = {"median": med, "min": min(ts), "max": max(ts), "vs_base": med / bmed}
        if engine and engine != "sequential" and f"{method}@sequential" in times:
            r["vs_sequential"] = med / statistics.median(times[f"{method}@sequential"])
            r["client_engine"] = sims[name].engine_info["client_engine"]
        if proj[name]:
            r["proj_share"] = statistics.mean(proj[name])
        if any(end_s[name]):
            r["round_end_share"] = statistics.median(e / t for e, t in zip(end_s[name], ts))
            r["round_end_s"] = statistics.median(end_s[name])
        result["s_per_round"][name] = r
        extra = f"  proj_share {r['proj_share']:.2f}" if "proj_share" in r else ""
        extra += f"  round end {r['round_end_share']:.0%} of a round ({r['round_end_s'] * 1e3:.1f} ms)" if "round_end_share" in r else ""
        if "vs_sequential" in r:
            extra += f"  x{r['vs_sequential']:.2f} of sequential ({r['client_engine']} ran)"
        print(f"{name:26s} {med * 1e3:8.1f} ms/round (min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f})  x{med / bmed:.3f} of {base}{extra}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
