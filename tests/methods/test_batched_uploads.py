"""Methods on the batched client engine equal the sequential engine within 1e-5:
- those that train clients as FedAvg does but upload something of their own (FedNova's
  effective step count, FedDF's and FedET's public logits): their client_end runs per client
  on its trained weights;
- those whose local change is a per-step loss/gradient term (FedProx, FedDyn, SCAFFOLD),
  stated for the whole stack in ``stacked_step_terms``, with their per-client state (FedDyn's
  gradient, SCAFFOLD's c_i) carried over rounds."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fedforget.engine import Simulation
from fedforget.methods import METHODS
from fedforget.partition import PartitionSpec

from .conftest import CPU


@pytest.mark.parametrize("method", ["fednova", "feddf", "fedet"])
def test_batched_engine_runs_the_methods_own_upload(public_run_cfg, run_engines, assert_same_metrics, method):
    rc = public_run_cfg(method, rounds=2, sample_rate=0.75, local_epochs=2, batch_size=8,
                        optimizer={"lr": 0.05, "momentum": 0.9})  # fmt: skip
    out = run_engines(rc, CPU)
    assert_same_metrics(out["sequential"][1], out["vectorized"][1])


@pytest.mark.parametrize(
    "method,params",
    [("fedprox", {"mu": 0.5}), ("feddyn", {"alpha": 0.1}), ("scaffold", {}), ("scaffold", {"weighting": "samples"})],
    ids=["fedprox", "feddyn", "scaffold", "scaffold-samples"],
)
def test_batched_engine_runs_step_terms(public_run_cfg, run_engines, assert_same_metrics, method, params):
    # 4 rounds at 3 of 4 clients: clients come back with state from an earlier round
    rc = public_run_cfg(method, params, rounds=4, sample_rate=0.75, local_epochs=2, batch_size=8,
                        optimizer={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3})  # fmt: skip
    out = run_engines(rc, CPU)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    assert seq.client_state.keys() == vec.client_state.keys()
    for cid, st in seq.client_state.items():
        for k, v in st.items():
            assert torch.allclose(v, vec.client_state[cid][k], atol=1e-5), (cid, k)


def test_step_terms_on_conv_steps_client_by_client(make_run_config, run_engines, assert_same_metrics):
    # digits cnn2d on a CPU: wide steps client by client (the terms per client), tails batched
    rc = make_run_config(dataset="digits", model="cnn2d", method="feddyn", params={"alpha": 0.1}, rounds=2,
                         local_epochs=2, batch_size=32, sample_rate=0.5, device="cpu",
                         optimizer={"lr": 0.05, "momentum": 0.9}, partition=PartitionSpec("dirichlet", clients=6, alpha=0.5, seed=0))  # fmt: skip
    out = run_engines(rc)
    assert_same_metrics(out["sequential"][1], out["vectorized"][1])


def test_methods_that_change_local_training_stay_sequential(public_run_cfg):
    for method in ("moon", "fedntd", "fedproj"):
        rc = public_run_cfg(method)
        sim = Simulation(replace(rc, train=replace(rc.train, client_engine="auto")), device=CPU)
        assert sim.engine_info["client_engine"] == "sequential", method
        assert "local-training hooks" in sim.engine_info["client_engine_reason"]
    assert METHODS.get("fednova").client_end is not METHODS.get("fedavg").client_end
