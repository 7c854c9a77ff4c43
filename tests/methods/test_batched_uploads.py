"""Methods that train clients as FedAvg does but upload something of their own (FedNova's
effective step count, FedDF's and FedET's public logits) run on the batched client engine:
their client_end runs per client on its trained weights, and the run equals the sequential
engine's within 1e-5."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from fedforget.engine import TIMING_COLUMNS, Simulation
from fedforget.methods import METHODS

from .conftest import CPU


@pytest.mark.parametrize("method", ["fednova", "feddf", "fedet"])
def test_batched_engine_runs_the_methods_own_upload(public_run_cfg, method):
    rc = public_run_cfg(method, rounds=2, sample_rate=0.75, local_epochs=2, batch_size=8,
                        optimizer={"lr": 0.05, "momentum": 0.9})  # fmt: skip
    out = {}
    for engine in ("sequential", "vectorized"):
        sim = Simulation(replace(rc, train=replace(rc.train, client_engine=engine)), device=CPU)
        assert sim.engine_info["client_engine"] == engine
        status, rows, msg = sim.run(progress=False)
        assert status == "completed", msg
        out[engine] = rows
    seq, vec = out["sequential"], out["vectorized"]
    assert len(seq) == len(vec)
    for a, b in zip(seq, vec):
        assert set(a) == set(b)
        for k in set(a) - set(TIMING_COLUMNS):
            if isinstance(a[k], float):
                assert math.isclose(a[k], b[k], abs_tol=1e-5) or (math.isnan(a[k]) and math.isnan(b[k])), (k, a[k], b[k])
            else:
                assert a[k] == b[k], k


def test_methods_that_change_local_training_stay_sequential(public_run_cfg):
    for method in ("fedprox", "scaffold", "fedproj"):
        rc = public_run_cfg(method)
        sim = Simulation(replace(rc, train=replace(rc.train, client_engine="auto")), device=CPU)
        assert sim.engine_info["client_engine"] == "sequential", method
        assert "local-training hooks" in sim.engine_info["client_engine_reason"]
    assert METHODS.get("fednova").client_end is not METHODS.get("fedavg").client_end
