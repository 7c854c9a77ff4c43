"""Clients trained together (fedforget.vectorized) against one after another."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from fedforget.engine import TIMING_COLUMNS, Simulation
from fedforget.methods import METHODS
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError
from fedforget.vectorized import client_side_is_fedavg, why_not_vectorized


def _both(rc):
    out = {}
    for eng in ("sequential", "vectorized"):
        sim = Simulation(replace(rc, train=replace(rc.train, client_engine=eng)))
        status, rows, msg = sim.run(progress=False)
        assert status == "completed", msg
        assert sim.engine_info["client_engine"] == eng
        out[eng] = (sim, rows)
    return out


def _assert_same_metrics(rows_a, rows_b, tol=1e-5):
    assert len(rows_a) == len(rows_b)
    for ra, rb in zip(rows_a, rows_b):
        keys = (set(ra) | set(rb)) - set(TIMING_COLUMNS)
        for k in keys:
            a, b = ra.get(k), rb.get(k)
            if isinstance(a, float) and isinstance(b, float):
                assert math.isclose(a, b, rel_tol=0, abs_tol=tol) or (math.isnan(a) and math.isnan(b)), (ra["round"], k, a, b)
            else:
                assert a == b, (ra["round"], k, a, b)


@pytest.mark.parametrize(
    "kw",
    [
        # unequal client sizes (Dirichlet), partial last batches, momentum and weight decay
        dict(dataset="digits", model="cnn2d", partition=PartitionSpec("dirichlet", clients=8, alpha=0.3, seed=0),
             rounds=2, local_epochs=2, batch_size=32, sample_rate=0.5,
             optimizer={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}),
        dict(dataset="iris", model="mlp", partition=PartitionSpec("dirichlet", clients=5, alpha=0.5, min_size=3, seed=1),
             rounds=3, local_epochs=3, batch_size=7, sample_rate=1.0, optimizer={"lr": 0.1}),
        dict(dataset="mnist1d", model="cnn1d", partition=PartitionSpec("shards", clients=10, shards_per_client=2, seed=0),
             rounds=2, local_epochs=1, batch_size=50, sample_rate=0.3, optimizer={"lr": 0.05, "momentum": 0.5}),
    ],
    ids=["digits-dirichlet-momentum-wd", "iris-mlp-small-batches", "mnist1d-shards"],
)
def test_vectorized_equals_sequential_within_1e5(make_run_config, kw):
    out = _both(make_run_config(**kw))
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    _assert_same_metrics(rows_s, rows_v)
    for k, v in seq.global_params.items():
        assert torch.allclose(v, vec.global_params[k], atol=1e-4, rtol=1e-4), k


def test_small_groups_give_the_same_result(make_run_config):
    rc = make_run_config(dataset="digits", model="cnn2d", rounds=2, sample_rate=1.0,
                         partition=PartitionSpec("dirichlet", clients=6, alpha=0.3, seed=0))  # fmt: skip
    one = Simulation(replace(rc, train=replace(rc.train, client_engine="vectorized", max_parallel_clients=2)))
    _, rows_groups, _ = one.run(progress=False)
    _, rows_all = _both(rc)["vectorized"]
    _assert_same_metrics(rows_groups, rows_all, tol=1e-6)


def test_engine_choice_and_fallback(make_run_config):
    rc = make_run_config()
    assert Simulation(replace(rc, train=replace(rc.train, client_engine="sequential"))).engine_info["client_engine"] == "sequential"
    # a method with its own client step falls back, and says why
    prox = make_run_config(method="fedprox", params={"mu": 0.1})
    sim = Simulation(replace(prox, train=replace(prox.train, client_engine="auto")))
    assert sim.engine_info["client_engine"] == "sequential"
    assert "fedprox" in sim.engine_info["client_engine_reason"]
    with pytest.raises(FedForgetError, match="client_engine='vectorized' is not possible here: method 'fedprox'"):
        Simulation(replace(prox, train=replace(prox.train, client_engine="vectorized")))
    adam = make_run_config(optimizer={"name": "adam", "lr": 1e-3})
    with pytest.raises(FedForgetError, match="optimizer 'adam'"):
        Simulation(replace(adam, train=replace(adam.train, client_engine="vectorized")))


def test_which_methods_train_clients_like_fedavg():
    like = {m for m in METHODS.names() if client_side_is_fedavg(METHODS.get(m))}
    assert "fedavg" in like and "fedprox" not in like and "scaffold" not in like
    assert "feddyn" not in like and "moon" not in like and "fedsam" not in like


def test_model_with_buffers_is_not_vectorized():
    from fedforget.models import build_model

    bn = build_model("resnet8", (1, 8, 8), 10, {"norm": "batch"})
    assert "buffers" in why_not_vectorized(METHODS.get("fedavg"), bn, "sgd")
    gn = build_model("resnet8", (1, 8, 8), 10, {"norm": "group"})
    assert why_not_vectorized(METHODS.get("fedavg"), gn, "sgd") is None


def test_auto_engine_choice_on_cpu(make_run_config):
    for kw in ({}, {"dataset": "digits", "model": "cnn2d"}):
        rc = make_run_config(**kw)
        sim = Simulation(replace(rc, train=replace(rc.train, client_engine="auto")))
        assert sim.engine_info["client_engine"] == "sequential"
        assert "auto on a CPU" in sim.engine_info["client_engine_reason"]


def test_vectorized_run_resumes_exactly(make_run_config):
    import io

    rc = make_run_config(rounds=4, sample_rate=0.5, client_engine="vectorized",
                         partition=PartitionSpec("dirichlet", clients=6, alpha=0.5, min_size=3, seed=0))  # fmt: skip
    _, rows_full, _ = Simulation(rc).run(progress=False)
    saved = []

    class Stop(Exception):
        pass

    def stop_after_2(row):
        if row["round"] == 2:
            raise Stop

    def keep(ckpt):
        buf = io.BytesIO()
        torch.save(ckpt, buf)
        buf.seek(0)
        saved.append(torch.load(buf, weights_only=False))

    with pytest.raises(Stop):
        Simulation(rc).run(progress=False, on_row=stop_after_2, on_checkpoint=keep)
    _, rows, _ = Simulation(rc).run(progress=False, resume=saved[-1])
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in rs]  # noqa: E731
    assert strip(rows) == strip(rows_full)
