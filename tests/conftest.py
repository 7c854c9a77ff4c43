"""Shared fixtures: prepared datasets (once per session), a minimal valid workflow config,
a factory for tiny single-run configs, and the comparison of two runs' metrics rows."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import math
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fedforget.config import DatasetSpec, MethodSpec, OptimizerSpec, RunConfig, TrainSpec
from fedforget.data import DATASETS, dataset_id, prepare_dataset
from fedforget.data.scenario import resolve_scenario
from fedforget.partition import PartitionSpec

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def benchmark_script(name: str):
    """benchmarks/<name>.py loaded as a module, benchmarks/ on sys.path meanwhile (the scripts
    import one another); the datasets a script registers (model_rates.py's bench_tokens) are
    gone after, so that no later test in the process sees them in the registry's names."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    registered = dict(DATASETS._items)
    try:
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
        DATASETS._items.clear()
        DATASETS._items.update(registered)

# FEDFORGET_TEST_DEVICE=cuda runs the make_run_config tests (the engine equivalence tests
# among them) on a GPU. TF32 is switched off there (the 1e-5 comparisons are float32
# claims), and cuDNN picks deterministic algorithms (no atomics: a rerun gives the same bits).
TEST_DEVICE = os.environ.get("FEDFORGET_TEST_DEVICE", "cpu")
if TEST_DEVICE != "cpu":
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True

# [D] The engine comparisons' tolerances (assert_same_metrics, assert_same_weights) are float32
# claims for a CPU, where both trainers run the same kernels up to summation order. On a GPU the
# stacked step's convolutions are other cuDNN kernels than one client's (grouped over the stack),
# whose rounding SGD with momentum grows over the steps: on the H200 (2026-11-27, three sessions:
# benchmarks/results/h200-2026-11-27-c/README.md) four comparisons missed 1e-5, by at most 6.4e-5
# in a loss after 2 rounds, and one near-tie test row of 450 was classified differently. There
# each tolerance is GPU_TOL_FACTOR times the CPU's and an accuracy may differ by GPU_ACC_TOL
# (two rows of 450); the bit-for-bit tests (CUDA graphs, lanes) are exact on every device.
#
# FEDFORGET_TEST_GPU_PATHS=1 (benchmarks/gpu_rehearsal.sh, gpu.sh's GPU tests on a CPU): the code
# paths a GPU takes, on the CPU (fixture gpu_paths): every stacked step batched (a CPU runs a
# Conv2d model's wide steps client by client), SGD's lr a tensor, the stacked convolutions in
# channels_last, CUDA graphs through the tape, host tensors copied to the device (utils.
# host_to_device: on a CPU the tensor itself); with the GPU's tolerances (the stacked
# convolutions round otherwise than one client's here too). Not a GPU: its kernels, streams and
# memory are not exercised; a device session is 15 minutes, and a test that fails there for a
# reason a CPU shows costs one (2026-12-06: FedSOL's step-records test read the host inside a
# captured step). Tests of the CPU's own paths are marked cpu_paths and skipped there.
GPU_PATHS = os.environ.get("FEDFORGET_TEST_GPU_PATHS", "0") == "1"
GPU_CODE_PATHS = TEST_DEVICE != "cpu" or GPU_PATHS  # the tests take a GPU's code paths
GPU_TOL_FACTOR = 10 if GPU_CODE_PATHS else 1
GPU_ACC_TOL = 0.005 if GPU_CODE_PATHS else 0.0

# The slow end-to-end tests start first, the SLURM stage (mostly waiting on the scheduler)
# before all: pytest-xdist hands tests out in this order, so the long ones run beside the many
# short ones instead of after them (longest first onto the least loaded worker).
FIRST = ("tests/test_slurm.py", "tests/test_reruns.py", "tests/test_workflow.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = Path(str(item.fspath)).relative_to(REPO).as_posix()
        if path in FIRST:
            return FIRST.index(path)
        return len(FIRST) if item.get_closest_marker("e2e") else len(FIRST) + 1

    items.sort(key=rank)  # stable: collection order within a rank


# [D] the ResNets of the engine-equality runs: widths 8/16/32/64 (ResNet-8: 78k parameters
# against 4.9M at the papers' 64), the same layers and code paths at a fraction of the time
SMALL_RESNET = {"width": 8}

# (name, options) of every dataset the session fixture prepares
PREPARED = [("iris", {}), ("iris", {"pca": 2}), ("digits", {}), ("mnist1d", {})]


def shared_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """A directory that ``build(path)`` fills once per test session, shared by every
    pytest-xdist worker: a module-scoped fixture runs once per worker that gets one of the
    module's tests (worksteal spreads a module over workers), so an expensive end-to-end
    set-up (a Snakemake pipeline) would run twice; here the second worker waits for the
    first's result instead. The directory must be read-only to the tests."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the workers' common parent
    path = base / f"shared-{name}"
    with FileLock(str(path) + ".lock"):
        if not (path / ".done").exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            build(path)
            (path / ".done").touch()
    return path


def run_experiment(experiment: dict[str, Any], data_dir: Path, work: Path) -> Path:
    """One experiment through the in-process pipeline (``fedforget.pipeline.run_all``) with
    its results under ``work``: the experiment's results directory (its runs, summary and
    figures)."""
    from fedforget.parse import parse_config
    from fedforget.pipeline import run_all

    cfg = {"data_dir": str(data_dir), "results_dir": str(work / "results"), "experiments": [experiment]}
    run_all(parse_config(cfg), progress=False)
    return work / "results" / experiment["name"]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> Path:
    """iris, iris pca2, digits and mnist1d prepared once, read-only for tests (copy before
    corrupting anything)."""
    root = tmp_path_factory.mktemp("data")
    for name, opts in PREPARED:
        prepare_dataset(name, opts, root)
    return root


MINIMAL_CONFIG: dict[str, Any] = {
    "experiments": [
        {
            "name": "tiny",
            "datasets": [{"name": "iris", "model": "mlp"}],
            "partitions": [{"scheme": "iid", "clients": 3}],
            "methods": [{"name": "fedavg"}],
            "seeds": [0],
        }
    ]
}


@pytest.fixture
def minimal_config() -> dict[str, Any]:
    """A fresh deep copy of a minimal valid raw config (iris, mlp, iid 3 clients, fedavg)."""
    return copy.deepcopy(MINIMAL_CONFIG)


@pytest.fixture
def make_run_config(data_root, tmp_path):
    """Factory for tiny RunConfigs (iris + mlp, iid 4 clients, fedavg, 2 rounds, cpu unless
    FEDFORGET_TEST_DEVICE says otherwise, one torch thread: tiny models run faster single-threaded on a shared 2-core machine)."""

    def make(
        dataset: str = "iris",
        options: dict[str, Any] | None = None,
        model: str = "mlp",
        model_options: dict[str, Any] | None = None,
        partition: PartitionSpec | None = None,
        method: str = "fedavg",
        params: dict[str, Any] | None = None,
        seed: int = 0,
        public: dict[str, Any] | None = None,
        scenario: dict[str, Any] | None = None,
        **train: Any,
    ) -> RunConfig:
        options = dict(options or {})
        opt = OptimizerSpec(**train.pop("optimizer", {"lr": 0.1}))
        base = TrainSpec(
            rounds=2,
            local_epochs=1,
            batch_size=16,
            sample_rate=1.0,
            device=TEST_DEVICE,
            threads=1,
            optimizer=opt,
            # one client after another: method tests compare methods with FedAvg bit for bit
            # (tests/test_vectorized.py compares the two engines)
            client_engine="sequential",
            checkpoint_every=1,  # tests that stop a run after round r find its checkpoint (default: auto)
        )
        ts = replace(base, **train)
        if scenario is not None:  # a raw scenario block (fedforget.data.scenario), resolved
            info = DATASETS.get(dataset)
            scenario = resolve_scenario(scenario, info.num_classes, tuple(info.input_shape(info.resolve(options))), "scenario")
        ds = DatasetSpec(
            dataset, options, model, dict(model_options or {}), public, dataset_id(dataset, options), scenario
        )
        return RunConfig(
            experiment="test",
            dataset=ds,
            partition=partition or PartitionSpec("iid", clients=4, seed=0),
            method=MethodSpec(method, dict(params or {}), method),
            seed=seed,
            train=ts,
            data_dir=str(data_root),
            results_dir=str(tmp_path / "results"),
        )

    return make


def thread_probe() -> tuple:
    """(an MLP 4 -> 64 -> 64, inputs of 1..16 rows): outputs MKL computes with other bits on
    more threads than one (on 5, 6, 7, 9, 10 and 11 rows on the 2-core AMD EPYC of 2026-12-06),
    the probe of whether a new thread runs on its own intra-op count (MKL's and OpenMP's are
    per thread)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    return mlp, [torch.randn(n, 4, generator=gen) for n in range(1, 17)]


@pytest.fixture(autouse=True)
def gpu_paths(request, monkeypatch):
    """A test marked cpu_paths is skipped where the tests take a GPU's code paths; under
    FEDFORGET_TEST_GPU_PATHS=1 (above) each other test takes them on the CPU."""
    if GPU_CODE_PATHS and request.node.get_closest_marker("cpu_paths"):
        pytest.skip("tests a CPU's own code paths (the tests take a GPU's here)")
    if not GPU_PATHS:
        return
    import fedforget.vectorized as vz

    monkeypatch.setattr(vz, "LOOP_MIN_ROWS", sys.maxsize)  # every stacked step batched
    monkeypatch.setattr(vz, "lr_on_device", lambda device: True)
    monkeypatch.setattr(vz, "nhwc_device", lambda t: True)
    monkeypatch.setenv("FEDFORGET_CUDA_GRAPHS", "tape")
    # a host tensor reaches a GPU as a copy (a CPU's .to(cpu) is the tensor itself)
    import fedforget.utils as fu

    real = fu.host_to_device

    def copied(t, device):
        out = real(t, device)
        return out.clone() if out is t else out

    for mod in [m for name, m in sys.modules.items() if name.startswith("fedforget")]:
        if getattr(mod, "host_to_device", None) is real:
            monkeypatch.setattr(mod, "host_to_device", copied)


@pytest.fixture
def run_engines():
    """run_engines(rc, device=None) -> {engine: (simulation, metrics rows)}: ``rc`` run to
    the end with the sequential and with the vectorized client engine (each must be the
    engine that ran, and complete)."""
    from fedforget.engine import Simulation

    def run(rc: RunConfig, device=None):
        out = {}
        for engine in ("sequential", "vectorized"):
            sim = Simulation(replace(rc, train=replace(rc.train, client_engine=engine)), device=device)
            assert sim.engine_info["client_engine"] == engine
            status, rows, msg = sim.run(progress=False)
            assert status == "completed", msg
            out[engine] = (sim, rows)
        return out

    return run


@pytest.fixture
def assert_same_weights():
    """assert_same_weights(sim_a, sim_b, tol=1e-5): two simulations' global weights, floats
    within ``tol`` (absolute and relative; on a GPU ``GPU_TOL_FACTOR`` times it), the rest
    (BatchNorm's num_batches_tracked) equal."""
    import torch

    def check(a, b, tol=1e-5):
        tol *= GPU_TOL_FACTOR
        for k, v in a.global_params.items():
            if torch.is_floating_point(v):
                assert torch.allclose(v, b.global_params[k], atol=tol, rtol=tol), k
            else:
                assert torch.equal(v, b.global_params[k]), k

    return check


@pytest.fixture
def assert_same_metrics():
    """assert_same_metrics(rows_a, rows_b, tol=1e-5): two runs' metrics rows have the same
    columns and values, floats within ``tol`` (absolute; NaN equals NaN; on a GPU
    ``GPU_TOL_FACTOR`` times it, accuracies within ``GPU_ACC_TOL`` too; ``tol=0``: the
    same values on every device), timings ignored
    (e.g. the sequential and the batched client engine on one config)."""
    from fedforget.engine import TIMING_COLUMNS

    def check(rows_a, rows_b, tol=1e-5):
        tol *= GPU_TOL_FACTOR
        assert len(rows_a) == len(rows_b)
        for ra, rb in zip(rows_a, rows_b):
            assert set(ra) == set(rb), (ra["round"], set(ra) ^ set(rb))
            pairs = [(k, ra[k], rb[k]) for k in set(ra) - set(TIMING_COLUMNS) - {"_tasks"}]
            for ta, tb in zip(ra.get("_tasks", []), rb.get("_tasks", [])):  # per-task rows
                pairs += [(f"task{ta['task']}.{k}", ta[k], tb[k]) for k in ta]
            assert len(ra.get("_tasks", [])) == len(rb.get("_tasks", []))
            for k, a, b in pairs:
                if isinstance(a, float) and isinstance(b, float):
                    bound = max(tol, GPU_ACC_TOL) if tol and "acc" in k else tol  # tol 0: bits, on every device
                    assert math.isclose(a, b, rel_tol=0, abs_tol=bound) or (math.isnan(a) and math.isnan(b)), (ra["round"], k, a, b)
                else:
                    assert a == b, (ra["round"], k, a, b)

    return check
