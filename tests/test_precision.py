"""``train.precision`` (issue 32, 4): bf16 autocast of the local steps' forward passes on
fp32 weights, in both trainers; fp32 runs keep their identity."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fedforget.config import RunConfig
from fedforget.engine import Simulation
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError


def test_fp32_keeps_the_run_identity_bf16_is_another_run(make_run_config):
    rc = make_run_config()
    assert rc.train.precision == "fp32" and "precision" not in rc.to_dict()["train"]  # hashes from before the key
    bf = replace(rc, train=replace(rc.train, precision="bf16"))
    assert bf.to_dict()["train"]["precision"] == "bf16" and bf.hash != rc.hash
    assert RunConfig.from_dict(bf.to_dict()) == bf and RunConfig.from_dict(rc.to_dict()) == rc
    with pytest.raises(FedForgetError, match="train.precision='fp16'; allowed: fp32, bf16"):
        Simulation(replace(rc, train=replace(rc.train, precision="fp16")))


def test_bf16_trains_both_trainers_alike_on_fp32_weights(make_run_config, run_engines, assert_same_metrics):
    """bf16 changes what is computed (other weights than fp32), keeps the weights, their
    optimizer and evaluation in fp32, and the two trainers still agree: the stacked forward in
    bf16 against each client's own, within bf16's rounding (1e-2 on metrics)."""
    rc = make_run_config(dataset="digits", model="cnn2d", rounds=2, batch_size=8, sample_rate=0.5,
                         optimizer={"lr": 0.05, "momentum": 0.9}, device="cpu",
                         partition=PartitionSpec("dirichlet", clients=6, alpha=0.5, min_size=10, seed=0))  # fmt: skip
    bf = replace(rc, train=replace(rc.train, precision="bf16"))
    out = run_engines(bf)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v, tol=1e-2)
    assert all(v.dtype == torch.float32 for sim in (seq, vec) for v in sim.global_params.values())
    fp = Simulation(replace(rc, train=replace(rc.train, client_engine="sequential")))
    fp.run(progress=False)
    diff = (fp.global_params["head.weight"] - seq.global_params["head.weight"]).abs().max().item()
    assert diff > 0  # bf16 arithmetic ran (how close its accuracy is: benchmarks/precision.py)


@pytest.mark.parametrize("method,params", [("gpm", None), ("fedprotip", {"tip": "none"})])
def test_bf16_builds_the_projections_in_fp32_in_both_trainers(make_run_config, monkeypatch, method, params):
    """The methods' own math stays fp32 under bf16 (docs/reference.md): one client after
    another built a client's projection map inside its step's autocast, so I - U U^T came
    out of a bf16 matmul (3e-3 off; the stacked trainer built it in fp32): every Projector
    is now made with autocast off, and the dense ones (r > d / 2) are made."""
    from fedforget import activations

    made, real = [], activations.Projector.__init__

    def init(self, basis):
        real(self, basis)
        made.append((torch.is_autocast_enabled("cpu"), self.dense, self.m.dtype))

    monkeypatch.setattr(activations.Projector, "__init__", init)
    scenario = {"kind": "split", "tasks": 2, "classes_per_task": 3, "rounds_per_task": 1, "leftover_classes": "drop"}
    for engine in ("sequential", "vectorized"):
        rc = make_run_config(dataset="digits", model="cnn2d", method=method, params=params, scenario=scenario, rounds=2,
                             batch_size=32, precision="bf16", client_engine=engine)  # fmt: skip
        Simulation(rc).run(progress=False)
    assert any(dense for _, dense, _ in made) and not any(on for on, _, _ in made)
    assert {dtype for _, _, dtype in made} == {torch.float32}


def test_the_contrastive_similarities_stay_fp32_under_bf16():
    """FedRCL's and SCR's similarity matrices are the methods' own math: fp32 under a bf16
    step's autocast, as outside it (one client after another computed them in bf16, the
    stacked trainer in fp32, before 2026-12-06; found in review)."""
    from fedforget.methods.fedrcl import rcl_terms
    from fedforget.methods.scr import supcon_loss

    g = torch.Generator().manual_seed(0)
    z, y = torch.randn(12, 16, generator=g), torch.randint(0, 3, (12,), generator=g)
    views = torch.nn.functional.normalize(torch.randn(2, 2, 6, 8, generator=g), dim=-1)
    plain = [*rcl_terms(z, y, 0.5, 0.3), supcon_loss(views, y[:12].view(2, 6), 0.07)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = [*rcl_terms(z, y, 0.5, 0.3), supcon_loss(views, y[:12].view(2, 6), 0.07)]
    assert all(a.dtype == b.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(plain, cast))
