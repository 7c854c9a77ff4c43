"""Batch sizes beyond the rows there are. ``train.batch_size`` beyond every client's rows (full-batch training: each epoch one
minibatch of all a client's rows) over every registered method, on both trainers: the run
completes, bit for bit as at ``batch_size`` = the largest client's rows. Before, the stacked
steps' row table and a replay plan's offer table were ``batch_size`` wide: 10**12 tried to
allocate terabytes (A-GEM and DER on either trainer, every method on the stacked one). A replay method's memory
batch beyond its buffer replays the whole buffer at every step, as at memory_batch_size =
buffer_size (its plan's draw table was memory_batch_size wide)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fedforget.engine import Simulation
from fedforget.methods import METHODS

from .conftest import QUICK_PARAMS, same, strip


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
@pytest.mark.parametrize("method", METHODS.names())
def test_a_batch_beyond_every_client_is_full_batch_training(public_run_cfg, method, engine):
    rc = public_run_cfg(method, QUICK_PARAMS.get(method), rounds=2, sample_rate=0.75, client_engine=engine,
                        batch_size=10**12)  # fmt: skip
    out = []
    for bs in (10**12, None):
        sim = Simulation(rc if bs else replace(rc, train=replace(rc.train, batch_size=out[0][0].trainer.clients.largest)))
        status, rows, msg = sim.run(progress=False)
        assert status == "completed", msg
        out.append((sim, rows))
    (a, ra), (b, rb) = out
    assert a.engine_info == b.engine_info and a.engine_info["client_engine"] == engine
    assert strip(ra) == strip(rb)
    assert same(a.global_params, b.global_params)


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
@pytest.mark.parametrize("method", ["agem", "der"])
def test_a_memory_batch_beyond_the_buffer_replays_the_whole_buffer(public_run_cfg, method, engine):
    out = []
    for m in (10**12, 20):
        rc = public_run_cfg(method, {"buffer_size": 20, "memory_batch_size": m}, rounds=3, sample_rate=0.75,
                            client_engine=engine)  # fmt: skip
        sim = Simulation(rc)
        status, rows, msg = sim.run(progress=False)
        assert status == "completed", msg
        out.append((sim, rows))
    (a, ra), (b, rb) = out
    assert a.engine_info["client_engine"] == engine
    assert strip(ra) == strip(rb)
    assert same(a.global_params, b.global_params) and same(a.fed.clients, b.fed.clients)
