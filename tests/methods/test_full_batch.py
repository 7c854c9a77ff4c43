"""Sizes beyond the rows there are mean all of them, and change no result. ``train.batch_size``
beyond every client's rows (full-batch training: each epoch one minibatch of all a client's
rows) over every registered method, on both trainers: bit for bit as at ``batch_size`` = the
largest client's rows. Before, the stacked steps' row table and a replay plan's offer table
were ``batch_size`` wide: 10**12 tried to allocate terabytes (A-GEM and DER on either trainer,
every method on the stacked one). A replay method's memory batch beyond its buffer replays
the whole buffer at every step (its plan's draw table was memory_batch_size wide); a buffer
beyond a client's rows keeps every row in room for them, or for the windows it offers under
asynchronous boundaries (it allocated buffer_size rows)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fedforget.engine import Simulation
from fedforget.methods import METHODS

from .conftest import QUICK_PARAMS, same, strip


def same_runs(huge, small, engine):
    """Run both configs to the end on ``engine``: equal metrics, global weights and client
    state; the two simulations."""
    sims = []
    for rc in (huge, small):
        sim = Simulation(rc)
        status, rows, msg = sim.run(progress=False)
        assert status == "completed", msg
        assert sim.engine_info["client_engine"] == engine
        sims.append((sim, strip(rows)))
    (a, ra), (b, rb) = sims
    assert ra == rb
    assert same(a.global_params, b.global_params) and same(a.fed.clients, b.fed.clients)
    return a, b


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
@pytest.mark.parametrize("method", METHODS.names())
def test_a_batch_beyond_every_client_is_full_batch_training(public_run_cfg, method, engine):
    rc = public_run_cfg(method, QUICK_PARAMS.get(method), rounds=2, sample_rate=0.75, client_engine=engine,
                        batch_size=10**12)  # fmt: skip
    largest = Simulation(rc).trainer.clients.largest
    same_runs(rc, replace(rc, train=replace(rc.train, batch_size=largest)), engine)


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
@pytest.mark.parametrize("method", ["agem", "der"])
def test_a_memory_batch_beyond_the_buffer_replays_the_whole_buffer(public_run_cfg, method, engine):
    huge, small = (public_run_cfg(method, {"buffer_size": 20, "memory_batch_size": m}, rounds=3, sample_rate=0.75,
                                  client_engine=engine) for m in (10**12, 20))  # fmt: skip
    same_runs(huge, small, engine)


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
@pytest.mark.parametrize("method", ["agem", "der", "fedgp", "scr"])
def test_a_buffer_beyond_every_clients_data_keeps_every_row_in_their_room(public_run_cfg, method, engine):
    """The same run, bit for bit, as at buffer_size 1000 (also beyond every client), with
    buffers as long as each client's rows."""
    params = {"fedgp": lambda b: {"base": "fedavg", "buffer_size": b}}.get(method, lambda b: {"buffer_size": b})
    huge, small = (public_run_cfg(method, {**(QUICK_PARAMS.get(method) or {}), **params(b)}, rounds=3, sample_rate=0.75,
                                  client_engine=engine) for b in (10**12, 1000))  # fmt: skip
    a, _ = same_runs(huge, small, engine)
    key = a.method.replay.buffer.key
    kept = {cid: st[key] for cid, st in a.fed.clients.items() if key in st and "y" in st[key]}
    assert kept, "no client kept a buffer"
    for cid, buf in kept.items():
        assert len(buf["y"]) == a.trainer.clients.size(cid) >= buf["size"] == buf["seen"]


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
@pytest.mark.parametrize("method", ["agem", "der"])
def test_a_buffer_beyond_every_clients_windows_keeps_every_offer_in_their_room(public_run_cfg, method, engine):
    """Asynchronous windows of 20 rows over the clients' streams: each client offers its
    windows, the last one (clipped to the stream's end) overlapping the one before it. The same
    run, bit for bit, as at buffer_size 1000, in buffers of ceil(n / 20) windows of 20 rows
    (they were buffer_size long)."""
    scenario = {"kind": "split", "tasks": 3, "classes_per_task": 1, "rounds_per_task": 2,
                "boundaries": {"samples_per_window": 20, "window_rounds": 1}}  # fmt: skip
    huge, small = (public_run_cfg(method, {"buffer_size": b}, rounds=6, sample_rate=0.75, client_engine=engine,
                                  scenario=scenario) for b in (10**12, 1000))  # fmt: skip
    a, _ = same_runs(huge, small, engine)
    key = a.method.replay.buffer.key
    kept = {cid: st[key] for cid, st in a.fed.clients.items() if key in st and "y" in st[key]}
    assert kept, "no client kept a buffer"
    overlapped = 0
    for cid, buf in kept.items():
        n = a.trainer.clients.size(cid)
        s = min(20, n)  # a stream of n <= 20 rows is one window
        assert len(buf["y"]) == s * -(-n // s) >= buf["size"] == buf["seen"]
        overlapped += buf["seen"] > n  # a window offered rows again
    assert overlapped, "no client's last window overlapped"
