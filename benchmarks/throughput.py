"""FedAvg local-training throughput vs. a plain centralized PyTorch loop (samples/s).

FedAvg is the real engine, ``Simulation.run_round`` (fedavg, iid, local-model evaluation
off). The centralized loop trains the same architecture and initial weights with SGD at the
same settings on the engine's own training tensors (same device and torch threads), batches
by ``torch.randperm`` + index gather, for exactly the samples FedAvg processes (sum over
rounds and sampled clients of local_epochs * client size). Rows: centralized in full batches
("plain"); centralized with FedAvg's own batch sizes (each client's last batch per epoch is
partial; "vs FedAvg batches" thus isolates engine overhead from per-client batching); summed
``Simulation.train_client`` time; the engine's ``train_time_s`` (local training +
aggregation); ``run_round`` wall time (adds the global test evaluation, every round).
One warm-up, then ``--repeats`` repetitions that interleave centralized and FedAvg round by
round (both see the same machine load). Reported: the median over repetitions, and "best"
(each round's fastest repetition, summed), which resists bursts of load on a shared machine.

    python benchmarks/throughput.py --dataset digits --model cnn2d
    python benchmarks/throughput.py --dataset mnist1d --model cnn1d --json mnist1d.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from fedforget.config import DatasetSpec, MethodSpec, OptimizerSpec, RunConfig, TrainSpec
from fedforget.data import prepare_dataset
from fedforget.engine import Simulation, sample_clients
from fedforget.models import build_model
from fedforget.partition import PartitionSpec

ROWS = {
    "central": "centralized (plain)",
    "central_fb": "centralized (FedAvg batches)",
    "local": "FedAvg local training",
    "round": "FedAvg round (+aggregation)",
    "round_eval": "FedAvg round + global eval",
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, typ, default in [
        ("dataset", str, "digits"), ("model", str, "cnn2d"), ("clients", int, 20), ("sample-rate", float, 0.5),
        ("local-epochs", int, 2), ("batch-size", int, 32), ("rounds", int, 5), ("lr", float, 0.01),
        ("momentum", float, 0.0), ("threads", int, 2), ("device", str, "cpu"), ("repeats", int, 5),
    ]:  # fmt: skip
        p.add_argument(f"--{name}", type=typ, default=default, help=f"default: {default}")
    p.add_argument("--json", metavar="PATH", help="also write the numbers to this file")
    return p.parse_args()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Centralized:
    """Plain loop: zero_grad, forward, cross-entropy, backward, step; no engine code."""

    def __init__(self, sim: Simulation, init: dict[str, torch.Tensor]) -> None:
        cfg, self.dev, self.init = sim.cfg, sim.device, init
        self.x, self.y = sim.clients.x, sim.clients.y  # the engine's training tensors
        ds, shape = cfg.dataset, tuple(self.x.shape[1:])
        self.model = build_model(ds.model, shape, sim.num_classes, ds.model_options).to(self.dev)
        self.opt_spec = cfg.train.optimizer

    def reset(self) -> None:
        self.model.load_state_dict(self.init)
        self.model.train()
        o, params = self.opt_spec, self.model.parameters()
        self.opt = torch.optim.SGD(
            params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay
        )
        self.pos = len(self.y)  # forces a fresh permutation

    def run(self, batch_sizes: list[int]) -> float:
        """Seconds to train on minibatches of these sizes, drawn from reshuffled passes."""
        model, opt, x, y, n = self.model, self.opt, self.x, self.y, len(self.y)
        sync(self.dev)
        t0 = time.perf_counter()
        for bs in batch_sizes:
            if self.pos + bs > n:
                self.perm, self.pos = torch.randperm(n, device=self.dev), 0
            idx = self.perm[self.pos : self.pos + bs]
            self.pos += bs
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        sync(self.dev)
        return time.perf_counter() - t0


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    tmp = tempfile.TemporaryDirectory(prefix="fedforget-bench-")
    prepare_dataset(a.dataset, {}, tmp.name)
    opt = OptimizerSpec("sgd", lr=a.lr, momentum=a.momentum)
    train = TrainSpec(a.rounds, a.local_epochs, a.batch_size, a.sample_rate, opt)
    # local-model evaluation off; global evaluation every round (timed in its own row only)
    train = replace(
        train, eval_local_models=False, eval_every=1, device=a.device, threads=a.threads
    )
    ds = DatasetSpec(a.dataset, {}, a.model, {}, None, a.dataset)
    part, method = PartitionSpec("iid", a.clients), MethodSpec("fedavg", {}, "fedavg")
    cfg = RunConfig("throughput", ds, part, method, 0, train, tmp.name, tmp.name)
    sim = Simulation(cfg)
    init = {k: v.clone() for k, v in sim.global_params.items()}

    local_s, train_client = [0.0], sim.trainer.train_client

    def timed_train_client(cid: int, rnd: int, lr: float, view=None, **kw):
        t0 = time.perf_counter()
        out = train_client(cid, rnd, lr, view, **kw)
        sync(sim.device)
        local_s[0] += time.perf_counter() - t0
        return out

    sim.trainer.train_client = timed_train_client  # the sequential trainer calls it per client: time each

    # FedAvg's exact minibatch sizes per round; the same number of samples in full batches
    bs, fed = a.batch_size, []
    for rnd in range(1, a.rounds + 1):
        sampled = sample_clients(cfg.seed, rnd, a.clients, a.sample_rate)
        sizes = [sim.clients.size(c) for c in sampled for _ in range(a.local_epochs)]
        fed.append([min(bs, n - s) for n in sizes for s in range(0, n, bs)])
    samples = sum(map(sum, fed))
    flat = [bs] * (samples // bs) + ([samples % bs] if samples % bs else [])
    cut = [round(i * len(flat) / a.rounds) for i in range(a.rounds + 1)]
    plain = [flat[cut[r] : cut[r + 1]] for r in range(a.rounds)]
    steps = dict.fromkeys(ROWS, sum(map(len, fed))) | {"central": len(flat)}
    central, central_fb = Centralized(sim, init), Centralized(sim, init)

    def repeat() -> dict[str, list[float]]:
        """Seconds per round of every row, centralized and FedAvg interleaved round by round."""
        sim.global_params = sim.server.global_params = {k: v.clone() for k, v in init.items()}
        sim.client_state.clear()
        central.reset(), central_fb.reset()
        t: dict[str, list[float]] = {k: [] for k in ROWS}
        for r in range(a.rounds):
            t["central"].append(central.run(plain[r]))
            local_s[0], t0 = 0.0, time.perf_counter()
            row = sim.run_round(r + 1, t0)
            t["round_eval"].append(time.perf_counter() - t0)
            t["local"].append(local_s[0]), t["round"].append(row["train_time_s"])
            t["central_fb"].append(central_fb.run(fed[r]))
        return t

    load = os.getloadavg()[0]
    repeat()  # warm-up
    reps = [repeat() for _ in range(a.repeats)]
    seconds = {k: [r[k] for r in reps] for k in ROWS}  # [repeat][round]
    sps = {k: samples / statistics.median(map(sum, v)) for k, v in seconds.items()}
    # best: each round's fastest repetition, summed; robust to bursts of load on a shared machine
    best = {k: samples / sum(map(min, zip(*v))) for k, v in seconds.items()}
    ratio = {k: sps[k] / sps["central"] for k in ROWS}
    ratio_best = {k: best[k] / best["central"] for k in ROWS}

    print(f"{a.dataset}/{a.model}, {sim.device}, {torch.get_num_threads()} threads, torch {torch.__version__}: "
          f"{a.clients} clients x {a.sample_rate}, {a.local_epochs} local epochs, batch {bs}, {a.rounds} rounds "
          f"= {samples} samples per run; {a.repeats} repeats; load avg {load:.2f} -> {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"{'':<35}{'samples/s':^18}{'ratio vs plain':^20}{'vs FedAvg':>11}")
    print(f"{'':<29}{'steps':>6}{'median':>9}{'best':>9}{'median':>11}{'best':>9}{'batches':>11}")
    for k, label in ROWS.items():
        vs_fb = best[k] / best["central_fb"]
        print(f"{label:<29}{steps[k]:>6}{sps[k]:>9.0f}{best[k]:>9.0f}{ratio[k]:>11.3f}{ratio_best[k]:>9.3f}{vs_fb:>11.3f}")  # fmt: skip
    if a.json:
        out = {"args": vars(a), "torch": torch.__version__, "samples": samples, "steps": steps,
               "samples_per_s_median": sps, "samples_per_s_best": best, "ratio_vs_plain_median": ratio,
               "ratio_vs_plain_best": ratio_best, "seconds_per_round": seconds}  # fmt: skip
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    tmp.cleanup()


if __name__ == "__main__":
    main()
