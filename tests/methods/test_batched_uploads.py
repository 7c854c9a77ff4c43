"""Methods that train clients as FedAvg does but upload something of their own (FedNova's
effective step count, FedDF's and FedET's public logits) run on the batched client engine:
their client_end runs per client on its trained weights, and the run equals the sequential
engine's within 1e-5."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fedforget.engine import Simulation
from fedforget.methods import METHODS

from .conftest import CPU


@pytest.mark.parametrize("method", ["fednova", "feddf", "fedet"])
def test_batched_engine_runs_the_methods_own_upload(public_run_cfg, assert_same_metrics, method):
    rc = public_run_cfg(method, rounds=2, sample_rate=0.75, local_epochs=2, batch_size=8,
                        optimizer={"lr": 0.05, "momentum": 0.9})  # fmt: skip
    out = {}
    for engine in ("sequential", "vectorized"):
        sim = Simulation(replace(rc, train=replace(rc.train, client_engine=engine)), device=CPU)
        assert sim.engine_info["client_engine"] == engine
        status, rows, msg = sim.run(progress=False)
        assert status == "completed", msg
        out[engine] = rows
    assert_same_metrics(out["sequential"], out["vectorized"])


def test_methods_that_change_local_training_stay_sequential(public_run_cfg):
    for method in ("fedprox", "scaffold", "fedproj"):
        rc = public_run_cfg(method)
        sim = Simulation(replace(rc, train=replace(rc.train, client_engine="auto")), device=CPU)
        assert sim.engine_info["client_engine"] == "sequential", method
        assert "local-training hooks" in sim.engine_info["client_engine_reason"]
    assert METHODS.get("fednova").client_end is not METHODS.get("fedavg").client_end
