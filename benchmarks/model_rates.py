"""Local-training throughput of every distinct (model, model options, input shape, batch size)
of the paper configs, measured (issue 32, item 6): prints numbers, not a test.

For each setting, FedAvg rounds of fedforget's engine (``client_engine: auto``: batched on a
GPU) on ``blobs`` images of the config's input shape: ``--clients`` (10) clients of ``--steps`` full
minibatches each, all sampled every round, 1 local epoch, SGD with momentum; ``--warmup``
rounds untimed (kernels chosen, CUDA graphs captured), then ``--rounds`` timed. Reported per
setting: samples/s (median over the timed rounds), seconds of the first round, the engine
that ran, the global model's evaluation rate (``eval_samples_per_s``: the engine's own global
evaluation, ``Simulation.global_metrics``, over ``--eval-rows`` test rows at the default
``train.eval_batch_size``, the median of ``--rounds`` after one untimed; forward passes only,
a frozen encoder's kept features bypassed: ``benchmarks/paper_runtime.py --model-rates`` also
takes it as the encoder's rate over a run's distinct rows), peak
GPU memory, and how many runs of the paper configs use the setting (the
order of measurement: most runs first, so a ``--budget`` cut leaves the rarest unmeasured,
listed as such). Pretrained weights are not loaded (the same arithmetic; the lent GPU
machine reaches no hub): the paper configs' Hugging Face encoders are built from their
published shapes (``paper_runtime.HF_SHAPES``) and timed on synthetic token sequences of
the config's length (``build_tokens``); the 2-feature MLP (Iris) is left out (its runs take
seconds on a CPU). ``--concurrent n``: clients that train one after another (a Hugging Face
encoder) do so n at once on lanes (``train.concurrent_clients``; the same results).
``--feature-cache``: the frozen-encoder settings alone, their features kept per row (``on``,
the model's default: ``fedforget.featcache``; the first round computes them, the timed rounds
read them), computed in every pass (``off``), or ``both``, one row per way
(``options.feature_cache`` in the row); without it every setting runs as its model's default. ``--engines``: each setting under
each ``train.client_engine`` given, side by side (``client_engine`` in the row; default auto).

    python benchmarks/model_rates.py --device cuda --budget 120 --json out.json
    python benchmarks/model_rates.py --device cuda --skip earlier.json --json more.json
    python benchmarks/model_rates.py --device cpu --only cnn_fedgp --steps 2 --rounds 1
    python benchmarks/model_rates.py --device cuda --only hf --concurrent 4 --json lanes.json
    python benchmarks/model_rates.py --device cpu --only hf --feature-cache both --steps 1 --json cache.json
    python benchmarks/model_rates.py --device cpu --only hf --feature-cache on --engines sequential vectorized
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
from pathlib import Path

import numpy as np
import torch

from fedforget.config import DatasetSpec, MethodSpec, OptimizerSpec, RunConfig, TrainSpec
from fedforget.data import DATASETS, DatasetInfo, prepare_dataset
from fedforget.data.base import Arrays
from fedforget.engine import Simulation, sample_clients
from fedforget.memory import process_peak_mb
from fedforget.models import HFBody, build_model
from fedforget.partition import PartitionSpec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from paper_runtime import HF_SHAPES, config_runs, gpu_engine, hf_config, setting_key  # noqa: E402  (the hub encoders' published shapes)

CLIENTS = 10


def paper_runs():
    """Every run of config/experiments/paper: (its config file, RunConfig, input shape, model
    options without pretrained weights: the same shapes, no download)."""
    for path in sorted((REPO / "config/experiments/paper").glob("*.yaml")):
        for rc in config_runs(path):
            info = DATASETS.get(rc.dataset.name)
            shape = tuple(info.input_shape(info.resolve(rc.dataset.options)))
            yield path, rc, shape, {k: v for k, v in rc.dataset.model_options.items() if k != "pretrained"}


def paper_settings() -> list[dict]:
    """The distinct (model, options, input shape, batch) of config/experiments/paper, most
    runs first; pretrained weights dropped from the options (same shapes, no download)."""
    count: collections.Counter = collections.Counter()
    for _, rc, shape, opts in paper_runs():
        count[setting_key(rc.dataset.model, opts, shape, rc.train.batch_size)] += 1
    out = []
    for (model, opts, shape, batch), runs in count.most_common():
        if model == "hf" and json.loads(opts)["name_or_path"] not in HF_SHAPES:
            continue  # a hub encoder whose shapes are not known offline
        if model != "hf" and (len(shape) != 3 or shape[1] != shape[2]):
            continue
        out.append({"model": model, "options": json.loads(opts), "shape": list(shape), "batch": batch, "paper_runs": runs})
    return out


def build_tokens(num_train: int, num_test: int, length: int, vocab: int, seed: int = 0) -> Arrays:
    """Token sequences in the project's text format (int64 [2, L]: ids, attention mask) for
    timing text models without a download [D]: lengths uniform in [L/2, L], padding (id 0)
    after, ids uniform over the vocabulary's upper part, 10 balanced labels; a step's time
    depends on the shapes, not the words."""
    rng = np.random.default_rng(seed)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        mask = (np.arange(length)[None] < rng.integers(length // 2, length + 1, size=(n, 1))).astype(np.int64)
        ids = rng.integers(vocab // 2, vocab, size=(n, length)) * mask
        return np.stack([ids, mask], axis=1), np.arange(n) % 10

    return Arrays(*draw(num_train), *draw(num_test), [str(i) for i in range(10)])


TOKENS = "bench_tokens"
TOKENS_INFO = DatasetInfo(
    name=TOKENS, description="synthetic token sequences for timing text models (benchmarks/model_rates.py)",
    build=build_tokens, defaults={"num_train": 1000, "num_test": 100, "length": 128, "vocab": 30522, "seed": 0},
    input_shape=lambda o: (2, int(o["length"])), num_classes=10, sizes=lambda o: (int(o["num_train"]), int(o["num_test"])),
    feature_dtype="int64",
)  # fmt: skip
if TOKENS not in DATASETS:  # registered in the benchmarks' process only (once, if this file is run again)
    DATASETS.register(TOKENS)(TOKENS_INFO)


def dataset_spec(s: dict, n: int, data: str, n_test: int = 100) -> DatasetSpec:
    """The setting's data: ``blobs`` images of its shape (uint8), or for a hub encoder token
    sequences and its published shapes (``paper_runtime.HF_SHAPES``: a config written under
    ``data``, randomly initialised weights)."""
    if s["model"] != "hf":
        c, size = s["shape"][0], s["shape"][1]
        options = {"channels": c, "size": size, "num_train": n, "num_test": n_test, "uint8": True}
        return DatasetSpec("blobs", options, s["model"], s["options"], None, "blobs")
    cfg = hf_config(s["options"]["name_or_path"], s["options"])
    where = Path(data) / "hf" / s["options"]["name_or_path"].replace("/", "--")
    cfg.save_pretrained(where)
    model = {**s["options"], "name_or_path": str(where), "pretrained": False}
    options = {"num_train": n, "num_test": n_test, "length": s["shape"][1], "vocab": cfg.vocab_size}
    return DatasetSpec(TOKENS, options, "hf", model, None, TOKENS)


def run_config(s: dict, a: argparse.Namespace) -> RunConfig:
    ds = dataset_spec(s, a.clients * a.steps * s["batch"], a.data, a.eval_rows)
    ts = TrainSpec(
        rounds=a.warmup + a.rounds + 1, local_epochs=1, batch_size=s["batch"], sample_rate=1.0,
        optimizer=OptimizerSpec(lr=0.01, momentum=0.9), eval_local_models=False, eval_every=10**9,
        device=a.device, threads=a.threads, client_engine=s.get("client_engine", "auto"), checkpoint_every=10**9,
        concurrent_clients=a.concurrent,
    )  # fmt: skip
    part = PartitionSpec("iid", clients=a.clients, seed=0)
    return RunConfig("rates", ds, part, MethodSpec("fedavg", {}, "fedavg"), 0, ts, a.data, os.path.join(a.data, "results"))


def measure(s: dict, a: argparse.Namespace) -> dict:
    rc = run_config(s, a)
    prepare_dataset(rc.dataset.name, rc.dataset.options, a.data)  # before any timing
    cuda = a.device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    sim = Simulation(rc)
    times, first = [], None
    for rnd in range(1, a.warmup + a.rounds + 1):
        n = sum(sim.clients.size(c) for c in sample_clients(rc.seed, rnd, a.clients, 1.0))
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        sim.run_round(rnd, t0)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        first = dt if first is None else first
        if rnd > a.warmup:
            times.append((dt, n))
    # the global model's evaluation as the engine runs it, one untimed first; a frozen encoder's
    # kept features (fedforget.featcache) bypassed, so that each evaluation runs the encoder: the
    # rate paper_runtime.py takes for the encoder's one pass over a run's distinct rows
    kept = [m for m in sim.server.model.modules() if isinstance(m, HFBody) and m.cache is not None]
    saved = [m.cache for m in kept]
    evals = []
    try:
        for m in kept:
            m.cache = None
        for i in range(a.rounds + 1):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            sim.global_metrics(a.warmup + a.rounds)
            if cuda:
                torch.cuda.synchronize()
            if i:
                evals.append(time.perf_counter() - t0)
    finally:
        for m, c in zip(kept, saved):
            m.cache = c
    out = {
        **s, "engine": sim.engine_info["client_engine"], "samples_per_s": statistics.median(n / t for t, n in times),
        "s_per_round": statistics.median(t for t, _ in times), "s_first_round": first, "samples_per_round": times[0][1],
        "eval_samples_per_s": len(sim.evaluator.test.y) / statistics.median(evals), "eval_rows": len(sim.evaluator.test.y),
    }  # fmt: skip
    if cuda:
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    else:  # the process's peak so far (one setting per process to read it per setting)
        out["peak_rss_mb_so_far"] = process_peak_mb()
    del sim
    return out


def _key(row: dict) -> tuple:
    """A setting's identity (``paper_runtime.setting_key``): model, options, input shape, batch."""
    return setting_key(row["model"], row["options"], row["shape"], row["batch"])


def expected_engine(s: dict, a: argparse.Namespace) -> str:
    """The trainer the setting runs with here: its ``client_engine``, or what auto picks on
    ``--device`` (``paper_runtime.gpu_engine``, the model built as ``measure``'s run builds it)."""
    if s.get("client_engine", "auto") != "auto":
        return s["client_engine"]
    rc = run_config(s, a)
    classes = DATASETS.get(rc.dataset.name).num_classes
    model = build_model(rc.dataset.model, tuple(s["shape"]), classes, rc.dataset.model_options)
    return gpu_engine(rc, model, a.device)


def measured_before(s: dict, done: set, a: argparse.Namespace) -> bool:
    """Whether ``done`` (--skip's (setting, trainer) pairs) holds ``s`` as it runs now [D]: with
    the trainer it runs with here (paper_runtime looks a run's rate up by its setting and that
    trainer), so that an earlier session's other trainer is measured again."""
    return any(k == _key(s) for k, _ in done) and (_key(s), expected_engine(s, a)) in done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="minibatches per client per round")
    ap.add_argument("--clients", type=int, default=CLIENTS, help="clients, all sampled every round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=float("inf"), help="seconds: start no setting after this")
    ap.add_argument("--eval-rows", type=int, default=2048, help="test rows of the timed global evaluation")
    ap.add_argument("--only", nargs="*", help="models to measure (default: all)")
    ap.add_argument("--malloc", choices=("keep", "default"), default="keep",
                    help="host memory freed kept for the next allocations, as fedforget train has it "
                         "(cli.keep_freed_memory), or the C library's default")
    ap.add_argument("--concurrent", type=int, default=1,
                    help="train.concurrent_clients: clients at once on lanes where they train one after another")
    ap.add_argument("--feature-cache", choices=("on", "off", "both"), default=None,
                    help="the frozen-encoder settings alone, their features kept per row (on), computed "
                         "every pass (off), or both ways (default: every setting, as its model's default: on)")
    ap.add_argument("--engines", nargs="+", default=["auto"], choices=("auto", "sequential", "vectorized"),
                    help="train.client_engine: each setting measured with each, side by side (one row each)")
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "fedforget-rates-data"))
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--skip", nargs="*", default=[],
                    help="earlier --json outputs: the settings they measured on a device of this name, with the "
                         "trainer each runs with now, are not measured again (a later session goes on where a "
                         "budget cut one)")
    a = ap.parse_args()
    if a.malloc == "keep":  # as fedforget train does
        from fedforget.cli import keep_freed_memory

        keep_freed_memory()
    torch.set_num_threads(a.threads)
    device = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    done = set()
    for f in a.skip:
        earlier = json.loads(Path(f).read_text())
        if earlier["setting"]["device"] != device:
            print(f"--skip {f}: measured on {earlier['setting']['device']}, not {device}: measured again", flush=True)
            continue
        done |= {(_key(r), r["engine"]) for r in earlier["rows"] if "error" not in r}
    start, rows = time.perf_counter(), []
    settings = paper_settings()
    if a.feature_cache is not None:  # the settings it changes, each with the cache on, off, or both
        ways = {"on": [True], "off": [False], "both": [True, False]}[a.feature_cache]
        settings = [{**s, "options": {**s["options"], "feature_cache": w}} for s in settings
                    if s["model"] == "hf" and s["options"].get("freeze_encoder") for w in ways]  # fmt: skip
    if a.engines != ["auto"]:
        settings = [{**s, "client_engine": e} for s in settings for e in a.engines]
    for s in settings:
        if a.only and s["model"] not in a.only:
            continue
        if measured_before(s, done, a):
            print(f"{s['model']} {json.dumps(s['options'])} {tuple(s['shape'])} batch {s['batch']}: in --skip", flush=True)
            continue
        if time.perf_counter() - start > a.budget:
            rows.append({**s, "error": "not measured: --budget spent"})
        else:
            try:
                rows.append(measure(s, a))
            except Exception as e:  # noqa: BLE001  (one setting's failure is reported, the others run)
                rows.append({**s, "error": f"{type(e).__name__}: {e}"})
        r = rows[-1]
        what = f"{r['model']} {json.dumps(r['options'])} {tuple(r['shape'])} batch {r['batch']} ({r['paper_runs']} runs)"
        if "error" in r:
            print(f"{what}: {r['error']}", flush=True)
        else:
            mem = f", peak {r['peak_cuda_mb']:.0f} MB" if "peak_cuda_mb" in r else ""
            print(f"{what}: {r['engine']} {r['samples_per_s']:.0f} samples/s, {r['s_per_round']:.3f} s/round "
                  f"(first {r['s_first_round']:.2f} s), evaluation {r['eval_samples_per_s']:.0f} rows/s{mem}", flush=True)  # fmt: skip
        if a.json:  # after every setting: a cut run keeps what it measured
            meta = {"device": device, "torch": torch.__version__, "clients": a.clients, "steps": a.steps,
                    "warmup": a.warmup, "rounds": a.rounds, "threads": a.threads, "concurrent": a.concurrent,
                    "feature_cache": a.feature_cache or "model default", "engines": a.engines,
                    "malloc": a.malloc, "eval_rows": a.eval_rows}  # fmt: skip
            Path(a.json).write_text(json.dumps({"setting": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
