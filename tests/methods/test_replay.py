"""The reservoir replay buffer (methods/replay.py): Algorithm 4 of fedgp.md against a plain
reference implementation, each item's inclusion frequency B/N over many seeds (a binomial
bound with a stated false-alarm rate), sampling, and the offer rule in a continual run
(every sample offered once per task, on the client's first pass)."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import binom

from fedforget.engine import Simulation, sample_clients
from fedforget.methods.replay import Reservoir

from .conftest import CPU, checkpoint_keeper

SPLIT3 = {"kind": "split", "tasks": 3, "classes_per_task": 2, "rounds_per_task": 2, "leftover_classes": "drop"}


def reference_reservoir(items, capacity, u):
    """Algorithm 4, one item after another: n < B -> slot n; else j = floor(u (n + 1)),
    replace slot j if j < B (``u``: the uniforms the implementation draws, in order)."""
    buf = []
    for n, (item, ui) in enumerate(zip(items, u)):
        if n < capacity:
            buf.append(item)
        else:
            j = min(math.floor(ui * (n + 1)), n)
            if j < capacity:
                buf[j] = item
    return buf


@pytest.mark.parametrize("capacity,batches", [(3, [4, 50, 1, 7]), (10, [10, 10]), (5, [2]), (4, [1] * 9)])
def test_offer_is_algorithm_4_one_row_after_another(capacity, batches):
    """Batched offers (a slot drawn twice in one batch keeps the later row) equal the
    sequential algorithm with the same draws."""
    res, state = Reservoir(capacity), {}
    gen, ref_gen = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    items, u, start = [], [], 0
    for m in batches:
        y = torch.arange(start, start + m)
        res.offer(state, y.float().unsqueeze(1), y, gen, task=2)
        u += torch.rand(m, generator=ref_gen, dtype=torch.float64).tolist()
        items += y.tolist()
        start += m
    expected = reference_reservoir(items, capacity, u)
    rows = res.rows(state)
    assert rows["y"].tolist() == expected
    assert rows["x"][:, 0].tolist() == [float(v) for v in expected]
    assert rows["task"].tolist() == [2] * len(expected)
    assert res.size(state) == min(capacity, len(items)) and res.seen(state) == len(items)


def test_each_item_is_kept_with_probability_b_over_n():
    """N = 20 items offered in minibatches of 7 to a buffer of B = 5, over S = 2000 seeds:
    each item's inclusion count is Binomial(S, B/N) (fedgp.md App. C). The two-sided
    acceptance region per item has probability >= 1 - 1e-6 / N, so a correct
    implementation fails this test with probability < 1e-6 (union bound over the items)."""
    n_items, capacity, seeds, batch = 20, 5, 2000, 7
    counts = torch.zeros(n_items, dtype=torch.long)
    res = Reservoir(capacity)
    for seed in range(seeds):
        state, gen = {}, torch.Generator().manual_seed(seed)
        for s in range(0, n_items, batch):
            y = torch.arange(s, min(s + batch, n_items))
            res.offer(state, y.unsqueeze(1), y, gen, task=0)
        kept = res.rows(state)["y"]
        assert len(set(kept.tolist())) == capacity  # distinct items, buffer full
        counts[kept] += 1
    p, alpha = capacity / n_items, 1e-6 / n_items
    lo, hi = binom.ppf(alpha / 2, seeds, p), binom.isf(alpha / 2, seeds, p)
    assert ((counts >= lo) & (counts <= hi)).all(), (lo, hi, counts.tolist())
    assert counts.sum() == seeds * capacity


def test_sliding_and_random_policies():
    """FedGP Table 9's other buffers: ``sliding`` keeps exactly the last B items (in ring
    order); ``random`` stores every offer, at a uniform slot once full, so the newest item
    is always kept and item i < B survives the N - B later offers with probability
    (1 - 1/B)^(N - B) (a binomial bound at false-alarm rate 1e-6)."""
    n_items, capacity = 23, 5
    state, gen = {}, torch.Generator().manual_seed(0)
    sliding = Reservoir(capacity, policy="sliding")
    for s in range(0, n_items, 4):
        y = torch.arange(s, min(s + 4, n_items))
        sliding.offer(state, y.unsqueeze(1), y, gen, task=0)
    assert sorted(sliding.rows(state)["y"].tolist()) == list(range(n_items - capacity, n_items))
    assert sliding.rows(state)["y"].tolist() == [20, 21, 22, 18, 19]  # slot n mod B
    seeds, first = 3000, 0
    rnd = Reservoir(capacity, policy="random")
    for seed in range(seeds):
        state, gen = {}, torch.Generator().manual_seed(seed)
        for s in range(0, n_items, 4):
            y = torch.arange(s, min(s + 4, n_items))
            rnd.offer(state, y.unsqueeze(1), y, gen, task=0)
        kept = rnd.rows(state)["y"].tolist()
        assert n_items - 1 in kept and rnd.size(state) == capacity
        first += 0 in kept
    p = (1 - 1 / capacity) ** (n_items - capacity)
    lo, hi = binom.ppf(0.5e-6, seeds, p), binom.isf(0.5e-6, seeds, p)
    assert lo <= first <= hi, (lo, hi, first)
    with pytest.raises(ValueError, match="policy='fifo'"):
        Reservoir(3, policy="fifo")


def test_sample_draws_distinct_rows_and_extras():
    res, state = Reservoir(5), {}
    assert res.sample(state, 3, torch.Generator()) is None and res.size(state) == 0
    y = torch.arange(4)
    res.offer(state, torch.randn(4, 2), y, torch.Generator(), task=torch.tensor([0, 0, 1, 1]), logits=y.float().unsqueeze(1) * 10)
    got = res.sample(state, 3, torch.Generator().manual_seed(0))
    assert len(got["y"]) == 3 and len(set(got["y"].tolist())) == 3
    assert torch.equal(got["logits"][:, 0], got["y"].float() * 10)
    assert torch.equal(got["task"], (got["y"] >= 2).long())
    assert len(res.sample(state, 99, torch.Generator())["y"]) == 4  # min(m, size)
    with pytest.raises(ValueError, match="keeps"):
        res.offer(state, torch.randn(1, 2), y[:1], torch.Generator(), task=0)  # logits missing
    assert Reservoir(0).offer({}, torch.randn(2, 2), y[:2], torch.Generator(), task=0) == 0


@pytest.mark.parametrize("capacity,seen,offered,batch,draws", [(6, 0, 10, 4, 1), (6, 5, 10, 4, 2), (3, 9, 0, 4, 1), (20, 0, 7, 8, 2)])
def test_a_plan_draws_and_fills_as_step_by_step(capacity, seen, offered, batch, draws):
    """ReplayPlan (A-GEM's and DER's steps): at each step its memory batches equal
    ``Reservoir.sample``'s with the same generator, drawn before the step's offer, and after
    the round the buffer and its counters equal ``Reservoir.offer``'s, minibatch after
    minibatch of the first epoch (an empty buffer, one filling, one full, none offered)."""
    from types import SimpleNamespace

    from fedforget.methods.base import ClientContext
    from fedforget.methods.replay import ReplayPlan

    def client(state):
        ctx = ClientContext(cid=0, round=0, model=None, optimizer=None, global_params={}, broadcast={}, state=state,
                            n_samples=max(offered, 1), lr=0.1, local_epochs=2, batch_size=batch)  # fmt: skip
        s = SimpleNamespace(to_offer=offered, sample_gen=torch.Generator().manual_seed(3),
                            offer_gen=torch.Generator().manual_seed(4), rows_ever=None)  # fmt: skip
        return ctx, s

    res, gen = Reservoir(capacity), torch.Generator().manual_seed(0)
    before = {}
    if seen:
        res.offer(before, torch.randn(seen, 2, generator=gen), torch.arange(seen), torch.Generator(), task=0)
    rows = torch.randn(offered, 2, generator=gen), torch.arange(100, 100 + offered)
    plain = {k: dict(v) for k, v in before.items()}
    planned = {k: dict(v) for k, v in before.items()}
    ctx, s = client(planned)
    plan = ReplayPlan(res, ctx, s, draws, 3, torch.device("cpu"))
    _, ref = client(plain)
    for k in range(ctx.max_steps):
        at = slice(k * batch, (k + 1) * batch) if k * batch < offered else slice(0, 0)
        expected = [res.sample(plain, 3, ref.sample_gen) for _ in range(draws)]
        got = plan.batches(planned, k)
        for e, g in zip(expected, got):
            assert (e is None) == (g is None)
            if e is not None:
                assert all(torch.equal(e[f], g[f]) for f in e)
        if at.stop > at.start:
            res.offer(plain, rows[0][at], rows[1][at], ref.offer_gen, task=1)
            plan.offer(planned, k, rows[0][at], rows[1][at], 1)
    plan.finish(planned)
    assert plain.keys() == planned.keys()
    for key, buf in plain.items():
        for f, v in buf.items():
            assert torch.equal(v, planned[key][f]) if isinstance(v, torch.Tensor) else v == planned[key][f], f
    if offered:  # an offer that is not the planned one is an error, not another buffer
        ctx, s = client({})
        with pytest.raises(RuntimeError, match=f"step 0 offers 3 rows, planned {min(offered, batch)}"):
            ReplayPlan(res, ctx, s, draws, 3, torch.device("cpu")).offer({}, 0, rows[0][:3], rows[1][:3], 1)


def test_each_sample_offered_once_per_task_on_the_first_pass(make_run_config):
    """A-GEM on split digits (3 tasks x 2 rounds), 2 local epochs, half the clients per
    round: each client offered exactly its rows of the tasks in which it trained at least
    once (once, not once per epoch or round), its buffer rows carry their task (the class's)
    and are rows of its data."""
    rc = make_run_config(dataset="digits", model="cnn2d", method="agem", params={"buffer_size": 30},
                         scenario=SPLIT3, rounds=6, local_epochs=2, batch_size=32, sample_rate=0.5,
                         eval_local_models=False)  # fmt: skip
    sim = Simulation(rc, device=CPU)
    status, rows, msg = sim.run(progress=False)
    assert status == "completed", msg
    cd, sc = sim.clients, sim.scenario
    trained = {k: set() for k in range(4)}
    for rnd in range(1, 7):
        for k in sample_clients(rc.seed, rnd, 4, 0.5):
            if cd.size(k, sc.task_of_round(rnd)):
                trained[k].add(sc.task_of_round(rnd))
    res = Reservoir(30)
    for k in range(4):
        st = sim.client_state.get(k, {})
        assert res.seen(st) == sum(cd.size(k, t) for t in trained[k]), k
        if not res.size(st):
            continue
        got = res.rows(st)
        assert res.size(st) == min(30, res.seen(st))
        assert torch.equal(got["task"], got["y"] // 2)  # split 2 classes per task, natural order
        x_all, _ = cd.slice(k)
        # every stored row is one of the client's rows, as the model saw it (no transform here)
        match = (got["x"].flatten(1)[:, None, :] == x_all.flatten(1)[None]).all(-1).any(1)
        assert match.all()


def test_replayed_rows_use_their_own_task_head_unmasked():
    from fedforget.config import TrainSpec
    from fedforget.data.scenario import Scenario
    from fedforget.methods import RunInfo
    from fedforget.methods.replay import Replay
    from fedforget.models import build_model

    sc = Scenario.build({**SPLIT3, "kind": "split", "incremental": "task", "heads": "per_task",
                         "class_order": "natural", "rotation": [0, 180], "boundaries": "sync", "seed": 0},
                        6, (4,), 6)  # fmt: skip
    info = RunInfo(CPU, num_classes=6, seed=0, num_clients=1, train=TrainSpec(), scenario=sc)
    replay = Replay(info, 10, 0x99)
    model = build_model("mlp", (4,), 6, {"hidden": [5]})
    model.use_task_heads(sc.task_classes)
    model.set_task(2)
    x, task = torch.randn(5, 4), torch.tensor([0, 2, 1, 0, 2])
    out = model.row_logits(x, task)  # the routing of replayed rows (A-GEM, DER, FedGP)
    z = model.features(x)
    for i, t in enumerate(task.tolist()):
        assert torch.allclose(out[i], model.head.heads[t](z[i]))
    assert torch.equal(replay.task_of_class, torch.tensor([0, 0, 1, 1, 2, 2]))


class Crash(Exception):
    pass


@pytest.mark.parametrize(
    "method,params",
    [("agem", {"buffer_size": 25}), ("der", {"buffer_size": 25, "plus": True}), ("fedcurv", {"fisher_samples": 16})],
    ids=["agem", "derpp", "fedcurv"],
)
def test_continual_resume_mid_task_equals_uninterrupted(make_run_config, method, params):
    """Split digits, 3 tasks x 2 rounds, half the clients per round: a run stopped after
    round 3 (the middle of task 1) and resumed from that checkpoint gives the same metrics
    (per task included) and weights: buffers, offer marks and FedCurv's sums are in the
    checkpointed state."""
    from fedforget.engine import TIMING_COLUMNS

    rc = make_run_config(dataset="digits", model="cnn2d", method=method, params=params, scenario=SPLIT3,
                         rounds=6, batch_size=32, sample_rate=0.5, eval_local_models=False)  # fmt: skip
    full = Simulation(rc, device=CPU)
    _, rows_full, _ = full.run(progress=False)
    saved, keep = checkpoint_keeper()

    def crash(row):
        if row["round"] == 3:
            raise Crash

    with pytest.raises(Crash):
        Simulation(rc, device=CPU).run(progress=False, on_row=crash, on_checkpoint=keep)
    assert saved[-1]["round"] == 3 and saved[-1]["tasks"]["server"] == 1
    torch.manual_seed(12345)
    resumed = Simulation(rc, device=CPU)
    _, rows, _ = resumed.run(progress=False, resume=saved[-1])
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING_COLUMNS or k == "round"} for r in rs]  # noqa: E731
    assert strip(rows) == strip(rows_full)
    for k, v in full.global_params.items():
        assert torch.equal(v, resumed.global_params[k]), k
