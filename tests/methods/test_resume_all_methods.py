"""Checkpoint/resume for every registered method: a run interrupted after a round and
resumed from its checkpoint gives the same metrics and weights as an uninterrupted run.
This also enforces the state rule of ``methods/base.py``: whatever a method keeps across
rounds lives in server.state or the client's ctx.state, which the checkpoint holds."""

from __future__ import annotations

import io

import pytest
import torch

from fedforget.engine import TIMING_COLUMNS, Simulation
from fedforget.methods import METHODS
from fedforget.methods.shared import report_bytes
from fedforget.parse import client_shape
from fedforget.state import model_copies

from .conftest import QUICK_PARAMS

CPU = torch.device("cpu")


class Crash(Exception):
    pass


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_COLUMNS or k == "round"} for r in rows]


def _roundtrip(ckpt):
    """Through torch.save/torch.load, as the runner writes it to disk."""
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _cfg(public_run_cfg, method):
    # half the clients per round: client state must survive rounds in which it is not sampled
    return public_run_cfg(method, QUICK_PARAMS.get(method), rounds=4, sample_rate=0.5, local_epochs=1)


@pytest.mark.parametrize("method", METHODS.names())
def test_resume_equals_uninterrupted(public_run_cfg, method):
    rc = _cfg(public_run_cfg, method)
    full = Simulation(rc, device=CPU)
    status, rows_full, msg = full.run(progress=False)
    assert status == "completed", msg
    # the model copies each client keeps are those the method declares (the engine's memory
    # check counts them: FedAvg.client_model_copies)
    declared = type(full.method).client_copies(full.method.p)
    kept = [model_copies(s, full.global_params)[0] for s in full.fed.clients.values() if s]
    assert all(abs(k - declared) < 0.25 for k in kept), (method, declared, kept)  # a bias-shaped count is no copy
    # and its other tensors (buffers, exemplars, bases; what the server keeps for it: class
    # reports) at most what it declares, nothing declared where it keeps none (the training
    # job's resource: parse.client_state_of)
    bound = type(full.method).client_kept_bytes(full.method.p, client_shape(rc, lambda: full.model))
    server = server_bytes_per_client(full)
    other = [model_copies(full.fed.clients.get(c), full.global_params)[1] + server.get(c, 0)
             for c in sorted(set(full.fed.clients) | set(server))]  # fmt: skip
    assert all(o <= bound for o in other) and (bound > 0) == any(other), (method, bound, other)

    saved = []

    def crash_after_round_2(row):
        if row["round"] == 2:
            raise Crash

    first = Simulation(rc, device=CPU)
    with pytest.raises(Crash):
        first.run(progress=False, on_row=crash_after_round_2, on_checkpoint=lambda c: saved.append(_roundtrip(c)))
    assert [c["round"] for c in saved] == [1, 2]

    # a new process would build a fresh Simulation; the global RNG is deliberately disturbed
    torch.manual_seed(12345)
    second = Simulation(rc, device=CPU)
    status, rows_resumed, msg = second.run(progress=False, resume=saved[-1])
    assert status == "completed", msg
    assert _strip(rows_resumed) == _strip(rows_full)
    for k, v in full.global_params.items():
        assert torch.equal(v, second.global_params[k]), k


def server_bytes_per_client(sim: Simulation) -> dict[int, int]:
    """The bytes of tensors the server keeps for each client: its state's dicts keyed by
    client id (iCaRL's and SCR's class reports; all their bytes: a report's sums [C, f] are
    shaped as the head's weight, which ``model_copies`` would count as a copy of it)."""
    model_bytes = sum(v.nbytes for v in sim.global_params.values())
    out: dict[int, int] = {}
    for v in sim.fed.server.values():
        if isinstance(v, dict) and v and all(isinstance(k, int) for k in v):
            for c, entry in v.items():
                copies, other = model_copies(entry, sim.global_params)
                out[c] = out.get(c, 0) + round(copies * model_bytes) + other
    return out


@pytest.mark.parametrize("method", ["icarl", "scr"])
def test_a_class_report_takes_what_the_method_declares(public_run_cfg, method):
    """The server keeps one class report per client that sent one: float32 sums [C, f] and
    int64 counts [C], exactly ``shared.report_bytes`` (f the model's feature width)."""
    rc = public_run_cfg(method, QUICK_PARAMS.get(method), rounds=2, local_epochs=1)
    sim = Simulation(rc, device=CPU)
    assert sim.run(progress=False)[0] == "completed"
    shape = client_shape(rc, lambda: sim.model)
    sent = server_bytes_per_client(sim)
    assert sent and set(sent.values()) == {report_bytes(shape)}, sent
    assert report_bytes(shape) == shape.num_classes * (4 * sim.model.feature_dim + 8)


@pytest.mark.parametrize("method", ["agem", "der", "scr"])
def test_a_full_buffer_takes_what_the_method_declares(public_run_cfg, method):
    """The bound is reached: a client that offered more rows than its buffer holds keeps
    exactly ``client_kept_bytes`` (8 rows of 4 float32 inputs, y and task; DER also 3 logits)."""
    rc = public_run_cfg(method, {**(QUICK_PARAMS.get(method) or {}), "buffer_size": 8}, rounds=2, local_epochs=1)
    sim = Simulation(rc, device=CPU)
    assert sim.run(progress=False)[0] == "completed"
    shape = client_shape(rc, lambda: sim.model)
    bound = type(sim.method).client_kept_bytes(sim.method.p, shape)
    rows = 8 * (4 * (4 + (3 if method == "der" else 0)) + 16)
    report = server_bytes_per_client(sim)
    assert bound == rows + (report_bytes(shape) if method == "scr" else 0) and (method == "scr") == bool(report)
    full = [c for c, s in sim.fed.clients.items() if s and int(s[sim.method.replay.buffer.key]["seen"]) >= 8]
    assert full and all(model_copies(sim.fed.clients[c], sim.global_params)[1] + report.get(c, 0) == bound for c in full)


def test_model_copies_counts_model_shaped_state_once():
    """The count above: tensors shaped as a parameter or as all of them flattened are model
    copies, each storage counted once (a view of one is not another copy); anything else (a
    replay buffer) is other bytes."""
    w, b = torch.zeros(3, 4), torch.zeros(4)  # a model of 16 parameters
    flat = torch.zeros(16)
    state = {"c": {"w": w, "b": b}, "again": [w, flat, flat[:16]], "buffer": torch.zeros(5, 2, dtype=torch.float64)}
    assert model_copies(state, {"w": w, "b": b}) == ((2 * 16 * 4) / (16 * 4), 5 * 2 * 8)
    assert model_copies({}, {"b": b}) == (0.0, 0)


def test_resume_without_client_state_differs(public_run_cfg):
    """The equality above is not vacuous: SCAFFOLD resumed without its clients' control
    variates (what a method keeping them outside ctx.state would suffer) diverges."""
    rc = _cfg(public_run_cfg, "scaffold")
    _, rows_full, _ = Simulation(rc, device=CPU).run(progress=False)
    saved = []
    with pytest.raises(Crash):
        Simulation(rc, device=CPU).run(
            progress=False,
            on_row=lambda r: (_ for _ in ()).throw(Crash) if r["round"] == 2 else None,
            on_checkpoint=lambda c: saved.append(_roundtrip(c)),
        )
    ckpt = saved[-1]
    ckpt["client_state"] = {}
    _, rows, _ = Simulation(rc, device=CPU).run(progress=False, resume=ckpt)
    assert _strip(rows)[:3] == _strip(rows_full)[:3]
    assert _strip(rows)[3:] != _strip(rows_full)[3:]
