"""Fixtures shared by the method tests: a data root with a held-out public set, tiny
distillation-method runs on it, and a Simulation runner."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch

from fedforget.data import prepare_public
from fedforget.engine import Simulation
from fedforget.partition import PartitionSpec

CPU = torch.device("cpu")
PUBLIC = {"source": "holdout", "fraction": 0.1, "seed": 0}


@pytest.fixture(scope="session")
def public_root(data_root, tmp_path_factory):
    """A copy of the prepared iris data with a 10% holdout public set (data_root stays
    read-only)."""
    root = tmp_path_factory.mktemp("public_data")
    shutil.copytree(data_root / "iris", root / "iris")
    prepare_public(PUBLIC, "iris", root)
    return root


@pytest.fixture
def public_run_cfg(make_run_config, public_root):
    """Tiny run configs (iris, Dirichlet 0.5 over 4 clients, 3 rounds) with the public set."""

    def make(method, params=None, **train):
        rc = make_run_config(
            method=method,
            params=params,
            public=PUBLIC,
            partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=5, seed=0),
            **{"rounds": 3, **train},
        )
        return replace(rc, data_dir=str(public_root))

    return make


def run(rc):
    """Run a Simulation on the CPU to the end; it must complete."""
    sim = Simulation(rc, device=CPU)
    status, rows, msg = sim.run(progress=False)
    assert status == "completed", msg
    return sim, rows


def run_method(make_run_config, method, params, **train):
    """A tiny run of ``method`` with ``params`` (see the make_run_config fixture), to the end."""
    return run(make_run_config(method=method, params=params, **train))
