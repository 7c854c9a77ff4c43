"""Simulation speed against the centralized limit: prints numbers, not a test.

For one configuration (dataset, model, clients, sample rate, local epochs, batch size,
threads) it measures, each in its own fresh process (so peak memory is per mode; with
``--interleave`` all in one process instead, a round of each mode in turn, which is more
robust when the machine's speed drifts):

  (a) central     a plain in-memory PyTorch loop: the same model, batch size and number of
                  samples per "round" as the sampled clients hold together, times the local
                  epochs (SGD, one optimizer, tensors already on the device);
  (b) sequential  fedforget's engine, clients one after another;
  (c) vectorized  fedforget's engine, clients trained together (fedforget.vectorized: one
                  stacked forward/backward for all clients per step; on a CPU, Conv2d
                  models' wide steps client by client on the stacked weights);
  (d) limit       (CPU) the limit of client-by-client training on --threads workers: as
                  many single-thread copies of the central loop as workers, at once, each on
                  an equal share of the round's samples;
  (d') limit-clients  (CPU) the same limit with the clients' own minibatches: the same
                  workers, each a plain loop over whole clients of the round (the same
                  sampled clients, taken longest first, each worker the next one as it
                  finishes one, as the batched engine's workers do), a client's rows in
                  minibatches of the batch size, its last one short: the bound of any
                  client-by-client schedule, which (d) exceeds where clients' last batches
                  add steps;
  (e) concurrent  fedforget's engine, clients one after another on --lanes lanes at once
                  (train.concurrent_clients: a copy of the model, a thread and, on a GPU, a
                  CUDA stream per lane; on a CPU each lane on --threads / --lanes threads);
  (f) vectorized-lanes  the batched engine with its exchanges' replies on --lanes lanes (the
                  task end's, the round end's: FedGP, GPM, FedProTIP, ...).
  (g) vectorized@N  the batched engine in groups of at most N clients
                  (train.max_parallel_clients: N); vectorized@1 trains one client at a time
                  through the batched step, so on a GPU its steps replay as CUDA graphs: how
                  much of the plain loop's time is launching kernels, and which stack width
                  a model's stacked convolutions run best at.

Every figure gives its ratio to the references (a), (d) and (d').

Reported per mode: local-training throughput in samples/s (samples processed by local
training / time of the round, aggregation included; the median over rounds), seconds per
round (median), for a method with exchanges the median seconds of a round in them
(``exchange_s_per_round``: FedGP's round-end buffer gradients, task ends' replies; not in
``--interleave``), peak resident
memory of the process (and peak CUDA memory on a GPU), and the ratio of (b) and (c) to (a).
Evaluation settings: ``--eval none`` (no evaluation), ``global`` (global model on the full
test set after every round, counted in the round's time; the central loop evaluates its
model as often), ``local`` (each sampled client's local model on the test set after its
training, ``train.eval_local_models``, the configs' default; the engine modes only). The modes run in A/B order ``--repeats`` times, alternating, and the
median is reported, so slow drifts of machine load hit all modes alike.

Clients are IID (``--partition iid``, the default) or Dirichlet 0.5 (``--partition
dirichlet0.5``: unequal clients, which the batched engine's workers must balance); the
partition is printed with every figure.

Presets (``--preset``):
  mcmahan   blobs 1x28x28 (MNIST-shaped synthetic, 60000 train), cnn_mcmahan padding 0
            (582,026 parameters), 100 clients, 10% per round, batch 50
  digits    digits + cnn2d (embedded), 20 clients, 50% per round, batch 32
  mnist1d   mnist1d + cnn1d (embedded), 20 clients, 50% per round, batch 32
  digits-k100, mnist1d-k100   the embedded models with 100 clients, 10% per round, batch 50
            (the McMahan preset's client setup: 14 and 40 samples per client)
  resnet8   blobs 3x32x32 (4000 train), resnet8 (BatchNorm), 20 clients, 50% per round, batch 32

    python benchmarks/simulation.py --preset mcmahan --epochs 5
    python benchmarks/simulation.py --preset mcmahan --epochs 1 --eval global
    python benchmarks/simulation.py --preset digits --epochs 2 --device cuda
    python benchmarks/simulation.py --memory 1000     # peak memory with 1000 clients
    python benchmarks/simulation.py --preset digits --epochs 1 --interleave  # one process, A/B/C per round
    python benchmarks/simulation.py --preset mcmahan --method fedproj --public 0.1  # a method with a public set
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

PRESETS = {
    "mcmahan": dict(dataset="blobs", options={}, model="cnn_mcmahan", model_options={"padding": 0},
                    clients=100, rate=0.1, batch=50),
    "digits": dict(dataset="digits", options={}, model="cnn2d", model_options={}, clients=20, rate=0.5, batch=32),
    "mnist1d": dict(dataset="mnist1d", options={}, model="cnn1d", model_options={}, clients=20, rate=0.5, batch=32),
    # the embedded models with the McMahan preset's client setup (100 clients, 10%, batch 50)
    "digits-k100": dict(dataset="digits", options={}, model="cnn2d", model_options={}, clients=100, rate=0.1, batch=50),
    "mnist1d-k100": dict(dataset="mnist1d", options={}, model="cnn1d", model_options={}, clients=100, rate=0.1, batch=50),
    # ResNet-8 with BatchNorm on CIFAR-shaped synthetic images (issue 32's CPU target for
    # BatchNorm models: batched >= 1.2x sequential)
    "resnet8": dict(dataset="blobs", options={"num_train": 4000, "num_test": 1000, "channels": 3, "size": 32},
                    model="resnet8", model_options={}, clients=20, rate=0.5, batch=32),
    # issue 32's GPU setting: CIFAR-shaped blobs, the CIFAR-style ResNet-18 with BatchNorm,
    # 100 clients, 10 per round, batch 64
    "resnet18": dict(dataset="blobs", options={"channels": 3, "size": 32}, model="resnet18",
                     model_options={"norm": "batch"}, clients=100, rate=0.1, batch=64),
    # torchvision's ImageNet ResNet-18 (resnet18_imagenet: 7x7 stride-2 stem, max-pool), the
    # model of FedProTIP's tables (there pretrained, on CIFAR's 32x32), in the same setting,
    # with train.drop_last as those tables' configs: at 32 px its layer-4 maps are 1x1, and
    # BatchNorm cannot train on a one-row last minibatch (the preset's client 71 holds 641
    # rows and is sampled in round 1: gpu.sh's resnet18tv would fail in every engine mode,
    # as a CPU rehearsal of the script on fewer rows did, 2026-12-05)
    "resnet18-imagenet": dict(dataset="blobs", options={"channels": 3, "size": 32}, model="resnet18_imagenet",
                              model_options={}, clients=100, rate=0.1, batch=64, drop_last=True),
    # SL-ViT (FedSOL Table 3, its code's defaults) in FedSOL's CIFAR-10 setup: 100 clients, 10 %,
    # batch 50 (batched through stacked_forward since 2026-12-02, vmap before)
    "slvit": dict(dataset="blobs", options={"channels": 3, "size": 32}, model="slvit", model_options={},
                  clients=100, rate=0.1, batch=50),
    # torchvision's ViT-B/16 (FedProTIP Table 7's model, random weights) at 224 px on CIFAR-shaped
    # rows, Table 7's 5 clients, all sampled, batch 64 (batched through stacked_forward since
    # 2026-12-03, vmap before, which auto refused on a GPU)
    "vit": dict(dataset="blobs", options={"channels": 3, "size": 32}, model="vit", model_options={},
                clients=5, rate=1.0, batch=64),
    # VGG-11 (FedSOL Table 3) in the same setting: no BatchNorm, so on a GPU its batched steps
    # are full width (fedforget.vectorized: full_width) and the rounds that meet new step
    # shapes are what issue 32 measures (each round's seconds are in the JSON: s_rounds)
    "vgg11": dict(dataset="blobs", options={"channels": 3, "size": 32}, model="vgg11",
                  model_options={}, clients=100, rate=0.1, batch=64),
}  # fmt: skip


def public_spec(args) -> dict | None:
    """--public F: a held-out public set, F of the training rows (FedProj, FedDF, FedET, ...)."""
    f = getattr(args, "public", 0.0)
    return {"source": "holdout", "fraction": f, "seed": 0} if f > 0 else None


def preset(args) -> dict:
    """The preset ``args.preset``; with ``--train-rows N`` (a preset on blobs) its dataset of N
    training and N // 6 test rows (MNIST's ratio), e.g. to run a GPU preset on a CPU; with
    ``--uint8`` (a preset on blobs) its images stored as uint8, as CIFAR's and MNIST's are
    (the presets' blobs are float32 features: four times the bytes)."""
    p = PRESETS[args.preset]
    rows, uint8 = getattr(args, "train_rows", 0), getattr(args, "uint8", False)
    if not (rows or uint8):
        return p
    if p["dataset"] != "blobs":
        flag = f"--train-rows {rows}" if rows else "--uint8"
        raise SystemExit(f"{flag}: preset {args.preset!r} is not on blobs (its dataset: {p['dataset']})")
    options = dict(p["options"])
    if rows:
        options.update(num_train=rows, num_test=max(rows // 6, 1))
    if uint8:
        options["uint8"] = True
    return {**p, "options": options}


def run_config(args, engine: str):
    from fedforget.config import DatasetSpec, MethodSpec, OptimizerSpec, RunConfig, TrainSpec
    from fedforget.partition import PartitionSpec

    p = preset(args)
    rounds = args.rounds * getattr(args, "repeats", 1) + args.warmup + 1
    scenario, tasks = None, getattr(args, "tasks", 1)
    if tasks > 1:  # a class-incremental split: task 0 in the warm-up, the timed rounds in task 1
        from fedforget.data import DATASETS
        from fedforget.data.scenario import resolve_scenario

        info = DATASETS.get(p["dataset"])
        timed = args.rounds * (args.repeats if getattr(args, "interleave", False) else 1)  # in this process
        if timed >= args.warmup:
            raise SystemExit(f"--tasks {tasks}: the timed rounds must end within task 1, before its task end: "
                             f"--rounds (x --repeats with --interleave) < --warmup ({args.warmup})")  # fmt: skip
        shape = tuple(info.input_shape(info.resolve(p["options"])))
        classes = info.resolve(p["options"]).get("num_classes", info.num_classes)
        scenario = resolve_scenario({"kind": "split", "tasks": tasks, "classes_per_task": classes // tasks,
                                     "rounds_per_task": args.warmup, "leftover_classes": "drop",
                                     "heads": getattr(args, "heads", "shared")},
                                    classes, shape, "scenario")  # fmt: skip
        rounds = tasks * args.warmup
    ds = DatasetSpec(p["dataset"], p["options"], p["model"], p["model_options"], public_spec(args), p["dataset"], scenario)
    ts = TrainSpec(
        # one round more than any mode runs: the engine evaluates at its final round (and task
        # end) whatever eval_every says, which would put an evaluation in a timed round
        rounds=rounds, local_epochs=args.epochs, batch_size=p["batch"],
        sample_rate=getattr(args, "rate", 0.0) or p["rate"], optimizer=OptimizerSpec(lr=0.01, momentum=0.9),
        eval_local_models=args.eval == "local", eval_every=1 if args.eval == "global" else 10**9,
        device=args.device, threads=args.threads, client_engine=engine, checkpoint_every=10**9,
        precision=getattr(args, "precision", "fp32"), lr_decay=getattr(args, "lr_decay", 1.0),
        drop_last=p.get("drop_last", False),
    )  # fmt: skip
    clients = args.memory or getattr(args, "clients", 0) or p["clients"]
    method = getattr(args, "method", "fedavg")
    part = (PartitionSpec("iid", clients=clients, seed=0) if args.partition == "iid"
            else PartitionSpec("dirichlet", clients=clients, alpha=0.5, min_size=10, seed=0))  # fmt: skip
    params = json.loads(getattr(args, "params", None) or "{}")
    return RunConfig("bench", ds, part,
                     MethodSpec(method, params, method), 0, ts, args.data, os.path.join(args.data, "results"))  # fmt: skip (nothing is written there)


def prepare(args) -> None:
    """The preset's dataset and (--public) its held-out public slice, under --data."""
    from fedforget.data import prepare_dataset, prepare_public

    p = preset(args)
    prepare_dataset(p["dataset"], p["options"], args.data)
    public = public_spec(args)
    if public:  # the slice of the dataset as the preset's options make it: the id a run loads
        prepare_public(public, run_config(args, "sequential").dataset.id, args.data)


def peak_rss_mb() -> float:
    """This process's own peak resident memory (not its parent's: fedforget.memory.process_peak_mb)."""
    from fedforget.memory import process_peak_mb

    return process_peak_mb()


def engine_round(args, engine: str):
    """(device, fn): fn(rnd) runs round ``rnd`` of fedforget's engine (local training +
    aggregation, + global evaluation with --eval global) and returns (seconds, samples
    processed by local training). ``engine`` concurrent: the sequential one on ``lanes(args)``
    lanes; vectorized-lanes: the batched one, its replies on them; vectorized@N: the batched
    one in groups of at most N clients."""
    from dataclasses import replace

    from fedforget.engine import Simulation, sample_clients

    engine, _, group = engine.partition("@")
    on_lanes = {"concurrent": "sequential", "vectorized-lanes": "vectorized"}
    rc = run_config(args, on_lanes.get(engine, engine))
    if engine in on_lanes:
        rc = replace(rc, train=replace(rc.train, concurrent_clients=lanes(args)))
        engine = on_lanes[engine]
    if group:  # (mode_arg admits only vectorized@N)
        rc = replace(rc, train=replace(rc.train, max_parallel_clients=int(group)))
    sim = Simulation(rc)
    assert sim.engine_info["client_engine"] == engine, sim.engine_info
    t = rc.train
    # the seconds of each round in the exchanges' client passes (FedGP's round end, a task
    # end's replies), device work included: a sync either side of each pass
    exchange_s = [0.0]
    inner = sim.trainer.client_pass

    def timed_pass(*a, **kw):
        _sync(sim.device)
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            _sync(sim.device)
            exchange_s[0] += time.perf_counter() - t0

    sim.trainer.client_pass = timed_pass

    def one(rnd: int) -> tuple[float, int]:
        sampled = sample_clients(rc.seed, rnd, rc.partition.clients, t.sample_rate)
        _sync(sim.device)
        exchange_s[0] = 0.0
        t0 = time.perf_counter()
        sim.run_round(rnd, t0)
        _sync(sim.device)
        one.exchange_s.append(exchange_s[0])
        return time.perf_counter() - t0, sum(t.epoch_rows(sim.clients.size(c)) for c in sampled) * t.local_epochs

    one.graphs = getattr(sim.trainer, "step_graphs", None)  # CUDA graphs' counts for the JSON
    one.exchange_s = []
    return sim.device, one


def central_round(args):
    """(device, fn) for the limit: one model, one optimizer, the same samples per round in
    minibatches of the same size, data already on the device; evaluation as often as the
    engine's."""
    import torch
    import torch.nn.functional as F

    from fedforget.engine import Simulation
    from fedforget.metrics import evaluate

    rc = run_config(args, "sequential")
    sim = Simulation(rc)  # for identical data on the device and the same model
    model, x_all, y_all = sim.model, sim.clients.x, sim.clients.y
    t = rc.train
    n_round = round(t.sample_rate * rc.partition.clients) * (len(y_all) // rc.partition.clients)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(0)

    def one(rnd: int) -> tuple[float, int]:
        _sync(sim.device)
        t0 = time.perf_counter()
        for _ in range(t.local_epochs):
            perm = torch.randperm(len(y_all), generator=gen)[:n_round].to(sim.device)
            for s in range(0, n_round, t.batch_size):
                b = perm[s : s + t.batch_size]
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x_all[b]), y_all[b]).backward()
                opt.step()
        if args.eval == "global":
            evaluate(model, sim.evaluator.test.x, sim.evaluator.test.y, t.eval_batch_size)
        _sync(sim.device)
        return time.perf_counter() - t0, n_round * t.local_epochs

    return sim.device, one


def _limit_workers(args):
    """The CPU limits' shared set-up: the run's Simulation (rc, sim), one copy of its model and
    one generator per ``--threads`` worker, and ``timed(loop, *iterables)``: one round of
    ``loop(worker, ...)`` on every worker at once, each on one thread, then (``--eval
    global``) one model evaluated, as the engine does; its seconds."""
    import copy
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from fedforget.engine import Simulation
    from fedforget.metrics import evaluate

    rc = run_config(args, "sequential")
    sim = Simulation(rc)
    workers = args.threads
    models = [copy.deepcopy(sim.model).train() for _ in range(workers)]
    gens = [torch.Generator().manual_seed(j) for j in range(workers)]
    pool = ThreadPoolExecutor(workers)

    def timed(loop, *iterables) -> float:
        t0 = time.perf_counter()
        try:
            list(pool.map(loop, range(workers), *iterables))
        finally:
            torch.set_num_threads(workers)
        if args.eval == "global":
            evaluate(models[0], sim.evaluator.test.x, sim.evaluator.test.y, rc.train.eval_batch_size)
        return time.perf_counter() - t0

    return rc, sim, models, gens, timed


def _sgd_steps(model, opt, x, y, perm, batch_size: int) -> None:
    """The plain loop's steps over the rows ``perm`` of (``x``, ``y``), a minibatch of
    ``batch_size`` rows each (the last one short)."""
    import torch.nn.functional as F

    for s in range(0, len(perm), batch_size):
        b = perm[s : s + batch_size]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[b]), y[b]).backward()
        opt.step()


def limit_round(args):
    """(device, fn) for the CPU limit of client-by-client training on ``--threads`` workers:
    as many independent copies of the central loop as workers, each on one thread with its
    own model and optimizer, run at once on an equal share of the round's samples (what the
    batched engine's workers do, without any engine around them)."""
    import torch

    rc, sim, models, gens, timed = _limit_workers(args)
    x_all, y_all, t, workers = sim.clients.x, sim.clients.y, rc.train, args.threads
    opts = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in models]
    share = round(t.sample_rate * rc.partition.clients) * (len(y_all) // rc.partition.clients) // workers

    def loop(j: int) -> None:
        torch.set_num_threads(1)
        for _ in range(t.local_epochs):
            perm = torch.randperm(len(y_all), generator=gens[j])[:share]
            _sgd_steps(models[j], opts[j], x_all, y_all, perm, t.batch_size)

    def one(rnd: int) -> tuple[float, int]:
        return timed(loop), share * workers * t.local_epochs

    return sim.device, one


def limit_clients_round(args):
    """(device, fn) for the CPU limit with the clients' own minibatches (mode limit-clients):
    ``--threads`` single-thread plain loops, each taking the round's next client (longest
    first) from a shared queue and training it as a client would: the global weights loaded,
    a fresh optimizer, each local epoch a permutation of its rows in minibatches of the batch
    size (its last one short). The clients' data are sliced once, before any timing, so the
    loops do no gathering (an upper bound: the engine gathers each minibatch)."""
    import copy
    import queue

    import torch

    from fedforget.engine import sample_clients

    rc, sim, models, gens, timed = _limit_workers(args)
    t, workers = rc.train, args.threads
    data = [sim.clients.slice(k) for k in range(rc.partition.clients)]
    start = copy.deepcopy(sim.model.state_dict())

    def loop(j: int, todo: queue.SimpleQueue) -> None:
        torch.set_num_threads(1)
        model = models[j]
        while True:
            try:
                x, y = data[todo.get_nowait()]
            except queue.Empty:
                return
            model.load_state_dict(start)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            for _ in range(t.local_epochs):
                _sgd_steps(model, opt, x, y, torch.randperm(len(y), generator=gens[j]), t.batch_size)

    def one(rnd: int) -> tuple[float, int]:
        sampled = sample_clients(rc.seed, rnd, rc.partition.clients, t.sample_rate)
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for k in sorted(sampled, key=lambda k: -len(data[k][1])):
            todo.put(k)
        return timed(loop, [todo] * workers), sum(len(data[k][1]) for k in sampled) * t.local_epochs

    return sim.device, one


def lanes(args) -> int:
    """The concurrent mode's lanes: --lanes, else one per thread on a CPU, 4 on a GPU."""
    return getattr(args, "lanes", 0) or (args.threads if args.device == "cpu" else 4)


MODES = ("central", "limit", "limit-clients", "sequential", "vectorized", "concurrent", "vectorized-lanes")


def mode_arg(mode: str) -> str:
    """--modes' values: MODES, or vectorized@N (N >= 1)."""
    if mode in MODES or re.fullmatch(r"vectorized@[1-9][0-9]*", mode):
        return mode
    raise argparse.ArgumentTypeError(f"{mode!r}: one of {', '.join(MODES)}, or vectorized@N (N >= 1)")


def mode_round(args, mode: str):
    if mode == "limit":
        return limit_round(args)
    if mode == "limit-clients":
        return limit_clients_round(args)
    return central_round(args) if mode == "central" else engine_round(args, mode)


def summarize(mode: str, timed: list[tuple[float, int]], device, every: list[tuple[float, int]] | None = None) -> dict:
    """Medians over rounds (one slow round, a burst of load elsewhere, does not move them),
    and the throughput's min and max over the rounds; ``every``: all rounds' seconds, the
    warm-up's first (s_rounds), and each one's training samples (n_rounds)."""
    import torch

    rates = [n / s for s, n in timed]
    out = {"mode": mode, "s_per_round": statistics.median(s for s, _ in timed),
           "samples_per_s": statistics.median(rates), "samples_per_s_min": min(rates),
           "samples_per_s_max": max(rates), "peak_rss_mb": peak_rss_mb(),
           "s_rounds": [round(sec, 4) for sec, _ in (every or timed)],
           "n_rounds": [n for _, n in (every or timed)]}  # fmt: skip
    if device.type == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def measure(args, mode: str) -> dict:
    device, one = mode_round(args, mode)
    timed = [one(rnd) for rnd in range(1, args.warmup + args.rounds + 1)]
    out = summarize(mode, timed[args.warmup :], device, timed)
    graphs = getattr(one, "graphs", None)
    if graphs is not None:  # the batched engine's CUDA graphs over all rounds (warm-up included)
        out.update(graph_captures=graphs.captures, graph_replays=graphs.replays)
    ex = getattr(one, "exchange_s", [])[args.warmup :]
    if any(ex):  # a method with exchanges: the median seconds of a timed round in them
        out["exchange_s_per_round"] = statistics.median(ex)
    return out


def measure_interleaved(args) -> dict[str, dict]:
    """All modes in this one process, one round of each in turn (A/B/C per round), so drifts
    of machine speed hit all modes alike; peak memory is then the process's, not per mode."""
    rounds = {m: mode_round(args, m) for m in args.modes}
    timed: dict[str, list] = {m: [] for m in args.modes}
    for rnd in range(1, args.warmup + args.rounds * args.repeats + 1):
        for m, (_, one) in rounds.items():
            res = one(rnd)
            if rnd > args.warmup:
                timed[m].append(res)
    return {m: summarize(m, timed[m], rounds[m][0]) for m in args.modes}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    print("RESULT " + json.dumps(measure(args, args.mode)))


def spawn(args, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--mode", mode, *args.passthrough]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        return {"mode": mode, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="mcmahan")
    ap.add_argument("--partition", choices=["iid", "dirichlet0.5"], default="iid",
                    help="the preset's clients, IID or Dirichlet 0.5 label skew (min 10 rows)")  # fmt: skip
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per measurement")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--eval", choices=["none", "global", "local"], default="none",
                    help="global: the global model on the test set every round; local: each sampled client's "
                         "local model after its training (train.eval_local_models; the engine modes only)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", nargs="+", type=mode_arg, default=["central", "limit", "sequential", "vectorized"],
                    help="limit (CPU only): --threads independent single-thread central loops at once; "
                    "limit-clients (CPU only): the same on whole clients, their own minibatches; vectorized@N: the batched engine in groups of at most N clients")  # fmt: skip
    ap.add_argument("--lanes", type=int, default=0,
                    help="clients at once in the concurrent mode (default: --threads on a CPU, 4 on a GPU)")
    ap.add_argument("--memory", type=int, default=0, help="clients (e.g. 1000): measure peak memory at that scale")
    ap.add_argument("--clients", type=int, default=0,
                    help="clients in the partition (default: the preset's), e.g. FedProTIP's 5 or 10: a task end "
                         "runs every client holding the task")
    ap.add_argument("--rate", type=float, default=0.0, help="clients sampled per round (default: the preset's)")
    ap.add_argument("--train-rows", type=int, default=0,
                    help="a preset on blobs: this many training rows (and a sixth as many test rows; default: the preset's)")
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "fedforget-bench-data"))
    ap.add_argument("--interleave", action="store_true",
                    help="all modes in one process, a round of each in turn (robust to drifting machine speed; "
                    "--rounds x --repeats rounds per mode; peak memory not per mode)")  # fmt: skip
    ap.add_argument("--method", default="fedavg",
                    help="the engine modes run this method with its default hyperparameters (central is plain SGD)")  # fmt: skip
    ap.add_argument("--params", default="{}", help="the method's hyperparameters, JSON (e.g. '{\"tip\": \"none\"}')")
    ap.add_argument("--tasks", type=int, default=1,
                    help="a class-incremental split of this many tasks: task 0 in the warm-up, the timed rounds "
                         "in task 1 (continual methods with bases or buffers; --rounds x --repeats < --warmup)")  # fmt: skip
    ap.add_argument("--lr-decay", type=float, default=1.0,
                    help="train.lr_decay of the engine modes (a new lr every round; central keeps its lr)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="train.precision of the engine modes (central stays fp32)")  # fmt: skip
    ap.add_argument("--heads", choices=["shared", "per_task"], default="shared",
                    help="with --tasks: one shared head or one head per task (FedProTIP with TIP)")
    ap.add_argument("--public", type=float, default=0.0,
                    help="a held-out public set of this fraction of the training rows (methods that need one: FedProj, ...)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from fedforget.cli import keep_freed_memory

    keep_freed_memory()  # as fedforget train does (each mode's process: --child passes here too)
    if args.device != "cpu":
        args.modes = [m for m in args.modes if not m.startswith("limit")]  # CPU references only
    if args.child:
        return child(args)

    p = preset(args)
    prepare(args)  # once, before any timing
    args.passthrough = [
        "--preset", args.preset, "--partition", args.partition, "--epochs", str(args.epochs), "--rounds", str(args.rounds),
        "--warmup", str(args.warmup), "--eval", args.eval, "--threads", str(args.threads),
        "--device", args.device, "--memory", str(args.memory), "--data", args.data, "--method", args.method,
        "--precision", args.precision, "--params", args.params, "--tasks", str(args.tasks),
        "--clients", str(args.clients), "--rate", str(args.rate), "--public", str(args.public), "--heads", args.heads,
        "--lanes", str(args.lanes), "--lr-decay", str(args.lr_decay), "--train-rows", str(args.train_rows),
    ]  # fmt: skip
    runs: dict[str, list[dict]] = {m: [] for m in args.modes}
    width = max(11, *map(len, args.modes))  # the modes' column (vectorized@N is longer)
    if args.interleave:
        import torch

        torch.set_num_threads(args.threads)
        for m, res in measure_interleaved(args).items():
            runs[m].append(res)
        how = f"one process, modes interleaved round by round, {args.rounds * args.repeats} rounds each"
    else:
        for r in range(args.repeats):
            order = args.modes if r % 2 == 0 else list(reversed(args.modes))
            for m in order:
                runs[m].append(spawn(args, m))
        how = f"median of {args.repeats} processes x {args.rounds} rounds"
    extra = (f" {args.params}" if args.params != "{}" else "") + (f", public holdout {args.public}" if args.public else "") + (f", {args.tasks} tasks (task 1 timed), {args.heads} heads" if args.tasks > 1 else "") + (f", lr_decay {args.lr_decay}" if args.lr_decay != 1.0 else "") + (f", {args.train_rows} training rows" if args.train_rows else "")
    print(f"# {args.preset}, {args.method}{extra}: {args.memory or args.clients or p['clients']} clients ({args.partition}), rate {args.rate or p['rate']}, batch {p['batch']}, "
          f"{args.epochs} local epochs, eval {args.eval}, {args.threads} threads, {args.device}, "
          f"{how}; load {os.getloadavg()[0]:.2f}")  # fmt: skip
    summary = {}
    for m, rs in runs.items():
        ok = [x for x in rs if "error" not in x]
        if not ok:
            print(f"{m:{width}s} error: {rs[0]['error']}")
            continue
        pick = {"_min": min, "_max": max}  # over every process's rounds; medians of the rest
        rounds = ("s_rounds", "n_rounds")  # every process's rounds
        s = {k: pick.get(k[-4:], statistics.median)(x[k] for x in ok) for k in ok[0] if k not in ("mode", *rounds)}
        s.update({k: [x[k] for x in ok] for k in rounds})
        summary[m] = s
    refs = {r: summary[r]["samples_per_s"] for r in ("central", "limit", "limit-clients") if r in summary}
    for m, s in summary.items():
        ratio = ", ".join(f"{s['samples_per_s'] / v:.2f}x {name}" for name, v in refs.items() if v)
        cuda = f", peak CUDA {s['peak_cuda_mb']:.0f} MB" if "peak_cuda_mb" in s else ""
        cuda += f", graphs captured {s['graph_captures']:.0f}, replayed {s['graph_replays']:.0f}" if "graph_captures" in s else ""
        rss = "peak RSS (whole process)" if args.interleave else f"peak RSS {s['peak_rss_mb']:.0f} MB"
        print(f"{m:{width}s} {s['samples_per_s']:10.0f} samples/s (min {s['samples_per_s_min']:.0f}, max {s['samples_per_s_max']:.0f})  {s['s_per_round']:.3f} s/round  "
              f"{rss}{cuda}  {ratio}")  # fmt: skip
    for m, ref in (("vectorized", "sequential"), ("concurrent", "sequential"), ("vectorized-lanes", "vectorized")):
        if ref in summary and m in summary:
            speedup = summary[m]["samples_per_s"] / summary[ref]["samples_per_s"]
            print(f"{m} / {ref}: {speedup:.2f}x" + (f" ({lanes(args)} lanes)" if "lanes" in m or m == "concurrent" else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args) | {"passthrough": None}, "summary": summary, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
