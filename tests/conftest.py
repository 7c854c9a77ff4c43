"""Shared fixtures: prepared datasets (once per session), a minimal valid workflow config
and a factory for tiny single-run configs."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fedforget.config import DatasetSpec, MethodSpec, OptimizerSpec, RunConfig, TrainSpec
from fedforget.data import dataset_id, prepare_dataset
from fedforget.partition import PartitionSpec

REPO = Path(__file__).resolve().parents[1]

# (name, options) of every dataset the session fixture prepares
PREPARED = [("iris", {}), ("iris", {"pca": 2}), ("digits", {}), ("mnist1d", {})]


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
    """Factory for tiny RunConfigs (iris + mlp, iid 4 clients, fedavg, 2 rounds, cpu, one
    torch thread: tiny models run faster single-threaded on a shared 2-core machine)."""

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
        **train: Any,
    ) -> RunConfig:
        options = dict(options or {})
        opt = OptimizerSpec(**train.pop("optimizer", {"lr": 0.1}))
        base = TrainSpec(
            rounds=2,
            local_epochs=1,
            batch_size=16,
            sample_rate=1.0,
            device="cpu",
            threads=1,
            optimizer=opt,
            # one client after another: method tests compare methods with FedAvg bit for bit
            # (tests/test_vectorized.py compares the two engines)
            client_engine="sequential",
        )
        ts = replace(base, **train)
        ds = DatasetSpec(
            dataset, options, model, dict(model_options or {}), public, dataset_id(dataset, options)
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
