"""Which methods' terms run inside CUDA graphs (issue 32: "the FedSOL/FedProj baselines with
per-step terms under CUDA graphs, not eagerly"), checked on a CPU through the tape
(``fedforget.cudagraph.Tape``: a replay reads what a graph's replay would read).

A contract over the registry: every method the stacked trainer runs with step or live terms,
on a small run of the trainer's batched steps (an MLP at batch 8, every step stacked). One
that declares ``capturable_terms`` trains under the tape to the eager run's bits, with
steps replayed; one that declares it false would not (forced, its steps fail to capture or
replay other numbers), so the declaration is needed."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fedforget.engine import TIMING_COLUMNS, Simulation
from fedforget.methods import METHODS, make_params
from fedforget.vectorized import method_not_vectorized

from .conftest import CPU, PUBLIC, QUICK_PARAMS, replay_stream_cfg

# TARGET's and LANDER's synthesis at a few steps (a pool after the first task, replayed after)
SYNTH_FAST = {"syn_size": 24, "syn_batch": 8, "syn_rounds": 3, "g_steps": 2, "warmup": 0, "nz": 8, "ngf": 4,
              "student_steps": 1, "student_batch": 8}  # fmt: skip
PARAMS = {**QUICK_PARAMS, "target": SYNTH_FAST, "target_lode": SYNTH_FAST, "lander": SYNTH_FAST}
# (method, params): every registered method with terms the stacked trainer runs, at its
# defaults, and FedSOL's other stacked forms (Tables 1-5)
WITH_TERMS = [
    n for n in METHODS.names()
    if method_not_vectorized(METHODS.get(n), "sgd", params=make_params(n, PARAMS.get(n, {}))) is None
    and (METHODS.get(n).step_terms or METHODS.get(n).live_terms or METHODS.get(n).trait("step_terms", make_params(n, {})))
]  # fmt: skip
CASES = [(n, PARAMS.get(n, {})) for n in WITH_TERMS] + [
    ("fedsol", {"rho": 0.5, "perturb": "all", "proximal": "l2", "adaptive": False}),
    ("fedsol", {"update": "loss", "proximal": "kl", "beta": 1.0}),
    ("fedsol", {"update": "project", "proximal": "kl", "perturb": "all"}),
    ("fedsol", {"rho": 2.0, "perturb": "all", "base": "scaffold", "proximal": "base"}),
    ("fedprotip", {"tip": "none", "samples": 32, "freeze_early": True}),
    ("fedproj", {"memory_batch_size": 4}),  # memory batches drawn (the public set is larger)
    ("fedgp", {"rate": 0.5}),  # each step's rate draw, drawn at the client's start
    ("fedgp", {"base": "agem"}),  # over a base whose steps follow a plan (keyed by it)
    ("agem", {"buffer_size": 12, "memory_batch_size": 4}),  # a full buffer: rows replaced
    ("der", {"plus": True, "buffer_size": 12, "memory_batch_size": 4}),  # two batches per step
    ("fedgp", {"base": "fedprox", "manipulation": "rotate", "apply": "always"}),
    ("fedgp", {"base": "fedntd"}),  # its map over a base's live terms (stacks_over_live)
    ("fedgp", {"base": "icarl"}),  # over joined rows: not capturable, as iCaRL
]
# methods whose terms read the continual stream (task ids, bases kept at task ends)
STREAM = {"agem", "der", "gpm", "fot", "fedprotip", "fedcurv", "target", "target_lode", "lander", "icarl", "glfc", "lga", "cfed"}


def strip(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in rows]


def stream(make_run_config, method, params, heads="shared", **train):
    """replay_stream_cfg's split digits at batch 8, 4 rounds, ``heads`` shared or per task."""
    return replay_stream_cfg(make_run_config, method, params, heads=heads, batch_size=8, rounds=4, **train)


def config(method, params, public_run_cfg, make_run_config, public_root=None, **train):
    if method in STREAM or params.get("base") in STREAM:
        per_task = method == "fedprotip" and params.get("tip", "sample") != "none"
        rc = stream(make_run_config, method, params, "per_task" if per_task else "shared", **train)
        if METHODS.get(method).trait("needs_public", make_params(method, params)):  # CFeD's surrogate rows
            rc = replace(rc, data_dir=str(public_root), dataset=replace(rc.dataset, public=PUBLIC))
    else:
        rc = public_run_cfg(method, params, rounds=3, sample_rate=0.75, local_epochs=2, batch_size=8,
                            optimizer={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}, **train)  # fmt: skip
    return replace(rc, train=replace(rc.train, client_engine="vectorized"))


def runs(rc, monkeypatch, flags=("0", "tape"), device=CPU):
    out = {}
    for flag in flags:
        monkeypatch.setenv("FEDFORGET_CUDA_GRAPHS", flag)
        sim = Simulation(rc, device=device)
        status, rows, msg = sim.run(progress=False)
        assert status == "completed", msg
        out[flag] = (sim, strip(rows))
    return out


def same_run(a, b):
    (sim_a, rows_a), (sim_b, rows_b) = a, b
    assert rows_a == rows_b
    for k, v in sim_a.global_params.items():
        assert torch.equal(v, sim_b.global_params[k]), k


def test_the_contract_covers_the_papers_methods():
    assert {"fedsol", "fedgp", "fedproj", "fedprotip", "gpm", "der", "agem", "fedprox", "scaffold", "moon"} <= set(WITH_TERMS)


@pytest.mark.parametrize("method,params", CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
def test_declared_capturable_terms_replay_the_eager_steps(public_run_cfg, make_run_config, digits_public_root,
                                                          monkeypatch, method, params):  # fmt: skip
    rc = config(method, params, public_run_cfg, make_run_config, digits_public_root)
    cls = METHODS.get(method)
    if cls.trait("capturable_terms", make_params(method, params)):
        out = runs(rc, monkeypatch)
        graphs = out["tape"][0].trainer.step_graphs
        assert graphs.replays > 0 and graphs.captures > 0
        same_run(out["0"], out["tape"])
        return
    # declared not capturable: the trainer captures none of its steps with terms (those of a
    # round without any, FedAvg's, it may), and forcing it would not replay its steps (a host
    # read or host value in the step, or other numbers)
    out = runs(rc, monkeypatch, ("tape",))
    assert out["tape"][0].trainer.step_graphs.scoped_captures == 0
    trait = cls.trait
    monkeypatch.setattr(cls, "trait", classmethod(lambda c, name, p=None: name == "capturable_terms" or trait(name, p)))
    try:
        forced = runs(rc, monkeypatch)
    except RuntimeError as e:
        assert "not capturable" in str(e)
        return
    with pytest.raises(AssertionError):
        same_run(forced["0"], forced["tape"])


def test_a_method_declared_not_capturable_runs_its_steps_with_terms_eagerly(public_run_cfg, make_run_config, monkeypatch):
    """The engine honours ``capturable_terms = False`` (no registered method declares it
    since FedRCL counts its rows on the host, ``step_rows``): none of its steps with terms is
    captured, and it trains as without graphs."""
    monkeypatch.setattr(METHODS.get("fedprox"), "capturable_terms", False)
    out = runs(config("fedprox", {}, public_run_cfg, make_run_config), monkeypatch)
    assert out["tape"][0].trainer.step_graphs.scoped_captures == 0
    same_run(out["0"], out["tape"])


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_adam_and_per_task_heads_steps_replay_in_graphs_of_one_call(make_run_config, monkeypatch, optimizer):
    """FedAvg's steps that read one call's own tensors (Adam's moments; the active head of
    per-task heads, which change the stack's names) run in graphs that live for the call
    (StepGraphs.scope), to the eager steps' bits."""
    opt = {"name": "adam", "lr": 0.01, "weight_decay": 1e-3} if optimizer == "adam" else {"lr": 0.05, "momentum": 0.9}
    rc = stream(make_run_config, "fedavg", {}, "shared" if optimizer == "adam" else "per_task", optimizer=opt)
    rc = replace(rc, train=replace(rc.train, client_engine="vectorized"))
    out = runs(rc, monkeypatch)
    assert out["tape"][0].trainer.step_graphs.replays > 0
    same_run(out["0"], out["tape"])


@pytest.mark.parametrize("method", ["fedsol", "scaffold"])
def test_terms_read_an_lr_in_a_tensor_as_a_number(public_run_cfg, make_run_config, monkeypatch, method):
    """On a GPU SGD's lr is a tensor (``vectorized.lr_on_device``; forced here): the steps
    with a method's terms replay to the eager steps' bits, which are the number's."""
    import fedforget.vectorized as vz

    rc = config(method, {}, public_run_cfg, make_run_config)
    number = runs(rc, monkeypatch, ("0",))["0"]
    monkeypatch.setattr(vz, "lr_on_device", lambda device: True)
    out = runs(rc, monkeypatch)
    assert out["tape"][0].trainer.step_graphs.scoped_captures > 0
    same_run(out["0"], out["tape"])
    same_run(number, out["tape"])


GPU_CASES = [("fedsol", {}), ("fedsol", {"update": "project", "proximal": "kl", "perturb": "all"}), ("fedgp", {}),
             ("scaffold", {}), ("fedproj", {}), ("gpm", {}), ("fedprotip", {"tip": "none", "samples": 32}),
             ("agem", {}), ("der", {"plus": True}), ("fedrcl", {})]  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (benchmarks/gpu.sh runs this where one is)")
@pytest.mark.parametrize("method,params", GPU_CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(GPU_CASES)])
def test_captured_terms_on_a_gpu_replay_the_eager_steps(public_run_cfg, make_run_config, monkeypatch, method, params):
    """On a GPU, real CUDA graphs of the paper methods' stacked steps: the eager steps' bits."""
    rc = config(method, params, public_run_cfg, make_run_config)
    rc = replace(rc, train=replace(rc.train, device="cuda"))
    out = runs(rc, monkeypatch, ("0", "1"), torch.device("cuda"))
    assert out["1"][0].trainer.step_graphs.replays > 0
    same_run(out["0"], out["1"])
