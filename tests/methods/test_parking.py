"""On a GPU each client's state goes to host memory between its trainings
(``FedState.park``) and back to the device when it is next used (``FedState.client``:
``offload_clients``). Here, on the CPU, a parked client's tensors become meta tensors (another
device, no data) until ``FedState.client`` brings them back, so that a step that uses parked
state fails, as a host tensor in a GPU step would; the run must equal one without parking.

Under asynchronous task boundaries a client's task-end reply runs right before its training
(``LocalTrainer.enter_task``) and parks it: every method with a task-end exchange, in both
trainers."""

from __future__ import annotations

import pytest
import torch

from fedforget.methods import METHODS, RunInfo, make_params
from fedforget.methods.base import TASK_END
from fedforget.partition import PartitionSpec
from fedforget.state import FedState, to_device
from fedforget.train_spec import TrainSpec
from fedforget.utils import FedForgetError

from .conftest import CPU, QUICK_PARAMS, SMALL_CNN, SPLIT, run, same, strip
from .test_concurrent_clients import TINY_TARGET

TINY_LANDER = {**TINY_TARGET, "warmup": 0}
PARAMS = {**QUICK_PARAMS, "target": TINY_TARGET, "target_lode": TINY_TARGET, "lander": TINY_LANDER, "fedprotip": {"tip": "none"}}
SCENARIO = {**SPLIT, "rounds_per_task": 2, "boundaries": {"samples_per_window": 70, "window_rounds": 2}}


def _ends_tasks_asynchronously(name: str) -> bool:
    """``name`` has a task-end exchange and accepts asynchronous boundaries (iCaRL does not)."""
    cls, params = METHODS.get(name), make_params(name, PARAMS.get(name) or {})
    info = RunInfo(CPU, num_classes=10, seed=0, num_clients=4, train=TrainSpec())
    if TASK_END not in cls(params, info).exchanges:
        return False
    try:
        cls.check_scenario(SCENARIO, params)
    except FedForgetError:
        return False
    return True


TASK_ENDERS = [n for n in METHODS.names() if _ends_tasks_asynchronously(n)]
META = torch.device("meta")  # the host memory of a GPU run, played here


def _on_host_device(obj) -> list:
    """The tensors in ``obj`` not parked (not on the meta device)."""
    if isinstance(obj, torch.Tensor):
        return [] if obj.device.type == "meta" else [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _on_host_device(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _on_host_device(v)]
    return []


def parking(monkeypatch):
    """``FedState.park`` / ``FedState.client`` as on a GPU, the host memory played by the meta
    device; returns the number of parkings so far (a list of one count) and a function that
    brings every parked client back (to compare client state after a run)."""
    parked: dict[tuple[int, int], dict] = {}  # (fed, client) -> {key: (meta value, its value)}
    count = [0]

    def park(self, cid):
        st = self.clients.get(cid)
        if st is None:
            return
        held = parked.setdefault((id(self), cid), {})
        for k, v in st.items():
            if k not in held or held[k][0] is not v:  # not parked already
                held[k] = (to_device(v, META), v)
                st[k] = held[k][0]
        count[0] += 1

    def client(self, cid):
        st = self.clients.setdefault(cid, {})
        for k, (meta, value) in parked.pop((id(self), cid), {}).items():
            if st.get(k) is meta:  # a value written while parked stays
                st[k] = value
        return st

    monkeypatch.setattr(FedState, "park", park)
    monkeypatch.setattr(FedState, "client", client)

    def unpark(fed):
        for cid in list(fed.clients):
            fed.client(cid)

    return count, unpark


def _cfg(make_run_config, method, engine, scenario=SCENARIO):
    """``engine``: a trainer, or ``lanes`` (sequential, 3 clients at once: their replies on the lanes)."""
    return make_run_config(
        dataset="digits", model="cnn2d", model_options=SMALL_CNN, method=method, params=PARAMS.get(method),
        scenario=scenario, partition=PartitionSpec("dirichlet", clients=5, alpha=0.5, min_size=10, seed=0),
        rounds=6, batch_size=32, eval_local_models=False, eval_every=6,
        client_engine="sequential" if engine == "lanes" else engine, concurrent_clients=3 if engine == "lanes" else 1,
    )  # fmt: skip


def _engines(method):
    return ["sequential", "vectorized", "lanes"] if method == "gpm" else ["sequential"]


@pytest.mark.parametrize("method,engine", [(m, e) for m in TASK_ENDERS for e in _engines(m)])
def test_a_parked_client_trains_on_its_state_brought_back(make_run_config, monkeypatch, method, engine):
    rc = _cfg(make_run_config, method, engine)
    plain, plain_rows = run(rc)
    from fedforget.trainers import LocalTrainer

    ends, original = [], LocalTrainer.end_client_task

    def spy(self, cid, task, rnd, lr):
        ends.append(cid)
        return original(self, cid, task, rnd, lr)

    monkeypatch.setattr(LocalTrainer, "end_client_task", spy)
    with monkeypatch.context() as m:
        count, unpark = parking(m)
        sim, rows = run(rc)
        unpark(sim.fed)
    assert ends and count[0] > 0  # clients ended tasks before training, and were parked
    assert strip(rows) == strip(plain_rows)
    assert same(sim.global_params, plain.global_params)
    assert same(sim.fed.clients, plain.fed.clients)



@pytest.mark.parametrize("method", METHODS.names())
@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_every_method_runs_the_same_with_its_clients_parked(public_run_cfg, monkeypatch, method, engine):
    """Every registered method, in both trainers (the batched one where it trains the method
    batched; else its fallback): parking between rounds changes nothing (3 of 4 clients sampled,
    so some stay parked over a round)."""
    rc = public_run_cfg(method, QUICK_PARAMS.get(method), rounds=3, sample_rate=0.75, client_engine=engine)
    plain, plain_rows = run(rc)
    count, unpark = parking(monkeypatch)
    sim, rows = run(rc)
    assert not _on_host_device(sim.fed.clients), method  # every client's state parked after the run
    unpark(sim.fed)
    assert count[0] > 0 or not any(plain.fed.clients.values())  # parked, where any client has state
    assert strip(rows) == strip(plain_rows)
    assert same(sim.global_params, plain.global_params)
    assert same(sim.fed.clients, plain.fed.clients)
    assert same(sim.fed.server, plain.fed.server)


def test_an_asynchronous_schedule_ends_every_task_a_client_trains_past(make_run_config, monkeypatch):
    """Under asynchronous boundaries a client moving on ends its previous task and the tasks
    its window passed over (found in review: those were never ended); with one report per
    client between server task ends, what the server does not get is exactly the reports a
    later one replaced (``FedState.reports_replaced``): the trained (client, task) pairs,
    from each training's rows, less the pairs whose reports the server collected and the
    clients' last tasks (never ended)."""
    from fedforget.engine import Simulation
    from fedforget.trainers import LocalTrainer

    trained, pending, delivered, ended = {}, {}, set(), []
    enter, end, collect = LocalTrainer.enter_task, LocalTrainer.end_client_task, Simulation.collect

    def on_enter(self, ctx):
        v = ctx.data
        for task in v.data.task[v.start : v.stop].unique().tolist():
            trained.setdefault(ctx.cid, set()).add(task)
        return enter(self, ctx)

    def on_end(self, cid, task, rnd, lr):
        pending[cid] = task  # replaces an earlier one, as fed.task_reports does
        ended.append((cid, task))
        return end(self, cid, task, rnd, lr)

    def on_collect(self, exchange, replies):
        if exchange == TASK_END:
            delivered.update(pending.items())
            pending.clear()
        return collect(self, exchange, replies)

    monkeypatch.setattr(LocalTrainer, "enter_task", on_enter)
    monkeypatch.setattr(LocalTrainer, "end_client_task", on_end)
    monkeypatch.setattr(Simulation, "collect", on_collect)
    sim, _ = run(_cfg(make_run_config, "gpm", "sequential"))
    final = set(sim.fed.client_task.items())  # the clients' tasks at the end: never ended
    pairs = {(c, t) for c, ts in trained.items() for t in ts}
    assert set(ended) == pairs - final  # every task trained past is ended, once
    assert len(ended) == len(set(ended))
    replaced = sum(sim.fed.reports_replaced.values())
    assert replaced == len(pairs - delivered - final) > 0


class _Crash(Exception):
    pass


@pytest.mark.parametrize("method", TASK_ENDERS)
def test_a_run_resumed_with_task_reports_waiting_equals_it_uninterrupted(make_run_config, method):
    """Every method with a task-end report under asynchronous boundaries: checkpointed after
    round 3, when the reports of the clients that moved on in it wait for the server's task
    end of round 4 (checkpoint format 3 holds them), resumed, the same metrics, weights, client
    and server state as the run uninterrupted."""
    from fedforget.engine import Simulation

    rc = _cfg(make_run_config, method, "sequential")
    full, rows = run(rc)
    saved = []

    def crash(row):
        if row["round"] == 3:
            raise _Crash

    with pytest.raises(_Crash):
        Simulation(rc, device=CPU).run(progress=False, on_row=crash, on_checkpoint=saved.append)
    assert saved[-1]["round"] == 3
    if method in ("gpm", "fedprotip"):  # not vacuous: reports wait in it (the others reply None: their
        assert saved[-1]["tasks"]["reports"]  # client state, FOT's local sketches, TARGET's server synthesis)
    resumed = Simulation(rc, device=CPU)
    status, rows_r, msg = resumed.run(progress=False, resume=saved[-1])
    assert status == "completed", msg
    assert strip(rows_r) == strip(rows)
    assert same(resumed.global_params, full.global_params)
    assert same(resumed.fed.clients, full.fed.clients) and same(resumed.fed.server, full.fed.server)
