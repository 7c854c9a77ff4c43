"""FL+A-GEM (methods/agem.py): the client step's projection against the gradient of one
buffer batch (after it g' . g_ref >= -tol, unchanged without conflict, equal to the formula
on a hand-built example), no projection with an empty buffer (buffer_size 0 is FedAvg bit
for bit), hyperparameter validation, a task-IL continual run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedforget.config import TrainSpec
from fedforget.methods import ClientContext, RunInfo, check_params
from fedforget.methods.agem import AGEM, MEMORY_STREAM
from fedforget.methods.replay import Reservoir, sample_generator
from fedforget.methods.shared import project
from fedforget.models import Classifier
from fedforget.parse import parse_config
from fedforget.utils import FedForgetError

from ..conftest import GPU_TOL_FACTOR
from .conftest import CPU, SMALL_RESNET, TINY_VIT, close_buffers, replay_stream_cfg, run

INFO = RunInfo(CPU, num_classes=3, seed=0, num_clients=2, train=TrainSpec())


def tiny_model(seed: int) -> Classifier:
    torch.manual_seed(seed)
    return Classifier(nn.Sequential(nn.Linear(4, 5), nn.ReLU()), 5, 3)


def context(model, state) -> ClientContext:
    return ClientContext(
        cid=1, round=3, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        global_params={}, broadcast={}, state=state, n_samples=4, lr=0.1, local_epochs=1, batch_size=4,
    )  # fmt: skip


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def step(seed: int, mem_y: torch.Tensor, mem_x: torch.Tensor | None = None):
    """One A-GEM step on a tiny model with a filled buffer: (g, g', g_ref, memory batch)."""
    model = tiny_model(seed)
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 4, generator=gen), torch.randint(0, 3, (4,), generator=gen)
    mem_x = torch.randn(len(mem_y), 4, generator=gen) if mem_x is None else mem_x
    method, state = AGEM(AGEM.Params(buffer_size=8, memory_batch_size=3), INFO), {}
    Reservoir(8).offer(state, mem_x, mem_y, torch.Generator(), task=0)
    ctx = context(model, state)
    method.client_begin(ctx)
    method.client_step(ctx, x, y)
    g = flat_grad(model).clone()
    method.client_grad(ctx)
    g_new = flat_grad(model).clone()
    # the memory batch A-GEM drew: the same keyed generator, the same draw
    mem = Reservoir(8).sample(state, 3, sample_generator(0, 3, 1, 0, MEMORY_STREAM))
    model.zero_grad()
    F.cross_entropy(model(mem["x"]), mem["y"]).backward()
    return g, g_new, flat_grad(model).clone()


def test_projection_formula_on_a_hand_built_example():
    g = [torch.tensor([1.0, 0.0]), torch.tensor([[2.0]])]
    g_ref = [torch.tensor([-1.0, 1.0]), torch.tensor([[0.0]])]
    out, projected, _ = project(g, g_ref, eps=0.0, norm_guard=0.0)  # A-GEM's use of Eq. 5
    # g . g_ref = -1, |g_ref|^2 = 2: g - (-1/2) g_ref = [0.5, 0.5, 2]
    assert bool(projected)
    assert torch.allclose(out[0], torch.tensor([0.5, 0.5])) and torch.allclose(out[1], torch.tensor([[2.0]]))
    zero = [torch.zeros(2), torch.zeros(1, 1)]
    out, projected, _ = project(g, zero, eps=0.0, norm_guard=0.0)  # zero reference: no NaN
    assert not bool(projected) and all(torch.equal(a, b) for a, b in zip(out, g))


@pytest.mark.parametrize("seed", range(6))
def test_client_step_projects_on_conflict_only(seed):
    """The step's gradient after client_grad is the formula applied to (g, g_ref), with
    g_ref the gradient of the buffer batch drawn by the keyed generator; after it
    g' . g_ref >= -tol; without conflict g is unchanged bit for bit."""
    gen = torch.Generator().manual_seed(100 + seed)
    g, g_new, g_ref = step(seed, torch.randint(0, 3, (6,), generator=gen))
    dot = g @ g_ref
    if dot < 0:
        expected = g - dot / (g_ref @ g_ref) * g_ref
        assert torch.allclose(g_new, expected, atol=1e-6)
        assert g_new @ g_ref >= -1e-5 * g.norm() * g_ref.norm()
        assert g_new.norm() <= g.norm() + 1e-6
    else:
        assert torch.equal(g_new, g)


def test_conflict_and_agreement_both_occur_in_the_checked_cases():
    """The parametrised cases above cover both branches (not vacuous)."""
    signs = set()
    for seed in range(6):
        gen = torch.Generator().manual_seed(100 + seed)
        g, _, g_ref = step(seed, torch.randint(0, 3, (6,), generator=gen))
        signs.add(bool(g @ g_ref < 0))
    assert signs == {True, False}


def test_buffer_of_the_step_batch_itself_never_projects():
    """g_ref of the batch's own rows points with g: no conflict, g unchanged."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 4, generator=gen), torch.randint(0, 3, (4,), generator=gen)
    model, state = tiny_model(0), {}
    Reservoir(8).offer(state, x, y, torch.Generator(), task=0)
    method = AGEM(AGEM.Params(buffer_size=8, memory_batch_size=4), INFO)
    ctx = context(model, state)
    method.client_begin(ctx)
    method.client_step(ctx, x, y)
    g = flat_grad(model).clone()
    method.client_grad(ctx)
    assert torch.equal(flat_grad(model), g)


def test_no_buffer_is_fedavg_bit_for_bit(make_run_config):
    _, rows_avg = run(make_run_config(method="fedavg", rounds=2))
    _, rows = run(make_run_config(method="agem", params={"buffer_size": 0}, rounds=2))
    strip = lambda r: {k: v for k, v in r.items() if not k.endswith("_s") and not k.startswith("agem_")}  # noqa: E731
    assert [strip(r) for r in rows] == [strip(r) for r in rows_avg]
    assert rows[-1]["agem_proj_share"] == 0.0 and rows[-1]["agem_buffer_size"] == 0.0


def test_task_il_run_projects_and_fills_the_buffer(make_run_config):
    scenario = {"kind": "split", "tasks": 2, "classes_per_task": 2, "rounds_per_task": 2, "incremental": "task", "leftover_classes": "drop"}
    rc = make_run_config(dataset="digits", model="cnn2d", method="agem", params={"buffer_size": 20},
                         scenario=scenario, rounds=4, batch_size=32, eval_local_models=False)  # fmt: skip
    sim, rows = run(rc)
    assert rows[-1]["agem_buffer_size"] == 20.0
    assert any(r.get("agem_proj_share", 0) > 0 for r in rows[1:])
    assert all(0 <= r["agem_proj_share"] <= 1 for r in rows[1:])


@pytest.mark.parametrize(
    "field,value", [("buffer_size", -1), ("buffer_size", 2.5), ("memory_batch_size", 0), ("memory_batch_size", True)]
)
def test_bad_hyperparameters_are_rejected(minimal_config, field, value):
    minimal_config["experiments"][0]["methods"] = [{"name": "agem", "params": {field: value}}]
    with pytest.raises(FedForgetError, match=field):
        parse_config(minimal_config)


def test_defaults():
    assert check_params("agem", {}) == {"buffer_size": 200, "memory_batch_size": 32}


@pytest.mark.parametrize(
    "model,opts,incremental,params",
    [("mlp", {}, "class", {"buffer_size": 30}),  # batched steps (stacked_forward)
     ("cnn2d", {}, "task", {"buffer_size": 30, "memory_batch_size": 8}),  # wide steps client by client, tails batched
     ("vit", TINY_VIT, "task", {"buffer_size": 30})],  # vmap (stacked_forward cannot run torchvision's ViT)
    ids=["mlp-class-il", "cnn2d-task-il", "vit-vmap"],
)  # fmt: skip
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # vmap over torch's SDPA (vit)
def test_agem_trains_stacked_as_sequential(make_run_config, run_engines, assert_same_metrics, model, opts, incremental, params):
    """Issue 32, 3: A-GEM's step as per-step terms that see the step's minibatch (each
    client's memory batch from its own buffer, g_ref by a stacked forward on the batches,
    the projection as the gradient map, then the step's rows offered): the stacked trainer
    within 1e-5 of the sequential one, metrics and buffers, on a split digits stream whose
    buffers fill and project; clients of unequal sizes, some with an empty buffer early."""
    out = run_engines(replay_stream_cfg(make_run_config, "agem", params, model, opts, incremental))
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    assert any(r.get("agem_proj_share", 0) > 0 for r in rows_s)
    close_buffers(seq, vec)


def test_fedgp_over_agem_trains_stacked_as_sequential(make_run_config, run_engines, assert_same_metrics):
    """FedGP over A-GEM stacks with its base: the base's terms get the step (its memory
    batch, offers), FedGP's manipulation follows as the map."""
    rc = replay_stream_cfg(make_run_config, "fedgp", {"base": "agem", "base_params": {"buffer_size": 30}})
    out = run_engines(rc)
    assert_same_metrics(out["sequential"][1], out["vectorized"][1])
    assert out["vectorized"][0].engine_info["client_engine"] == "vectorized"


@pytest.mark.parametrize("method", ["agem", "der"])
def test_replay_on_a_batchnorm_model_trains_stacked_as_sequential(make_run_config, run_engines, assert_same_metrics, method):
    """ResNet-8 (BatchNorm): the replayed rows update each client's own running statistics
    with its real rows only (one vmap where every client has as many, else client by
    client), after the step's own forward, as alone: within 1e-5, buffers and statistics."""
    # the first task's rounds (buffers fill in the first epoch, replay from then on); drop_last:
    # no 1-row batch through BatchNorm (as FedGP's ResNet configs)
    rc = replay_stream_cfg(make_run_config, method, {"buffer_size": 30, "memory_batch_size": 8}, "resnet8",
                           SMALL_RESNET, rounds=2, local_epochs=1, drop_last=True)
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    for k, v in seq.global_params.items():  # running statistics included
        assert torch.allclose(v.float(), vec.global_params[k].float(), atol=1e-4 * GPU_TOL_FACTOR), k
    close_buffers(seq, vec)
