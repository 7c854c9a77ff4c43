"""FL+L2P (methods/l2p.py): prompts selected by key similarity (per input, per batch with
ties), the pull term on a hand-built case, the query equal to the frozen ViT's [CLS] output,
the prompted features from the selected prompts alone, the local loss as Eq. 5 with the
class-IL train mask, gradients on prompts, keys and head only, split-digits runs with a tiny
ViT (class-IL, task-IL with per-task heads) whose backbone stays bit-identical, an exact
resume mid-task and at a task boundary, FedGP over L2P, and refusals (non-ViT model, bad
hyperparameters)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from fedforget.config import TrainSpec
from fedforget.data.scenario import Scenario, resolve_scenario
from fedforget.engine import Simulation
from fedforget.methods import ClientContext, RunInfo, check_params, make_params
from fedforget.methods.fedgp import STATE_KEY
from fedforget.methods.l2p import L2P, PromptedViT, pull_term, select
from fedforget.models import build_model, check_model
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError

from .conftest import CPU, SMALL_CNN, SPLIT, TINY_VIT, checkpoint_keeper, strip

SMALL = {"pool_size": 4, "length": 2, "top_k": 2}
TRAINABLE = {"body.prompt", "body.prompt_key", "head.weight", "head.bias"}


def l2p_cfg(make_run_config, method="l2p", params=None, scenario=SPLIT, **train):
    """Split digits (3 tasks x 1 round), the tiny ViT, Dirichlet 0.5 over 4 clients."""
    return make_run_config(
        dataset="digits", model="vit", model_options=TINY_VIT, method=method,
        params={**SMALL, **(params or {})} if method == "l2p" else params, scenario=scenario,
        partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=10, seed=0),
        **{"rounds": 3, "batch_size": 32, "eval_local_models": False, "eval_every": 3, **train},
    )  # fmt: skip


def method_and_model(params=None, scenario=None, num_classes=10):
    info = RunInfo(CPU, num_classes, seed=0, num_clients=2, train=TrainSpec(), scenario=scenario)
    method = L2P(make_params("l2p", {**SMALL, **(params or {})}), info)
    torch.manual_seed(0)
    model = build_model("vit", (1, 8, 8), num_classes, TINY_VIT)
    plain = copy.deepcopy(model.body)
    method.model_init(model)
    return method, model, plain


def digits(n=6, seed=1):
    return torch.rand(n, 1, 8, 8, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ selection and pull term
KEYS = torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0]])


def test_prompts_are_selected_by_key_similarity():
    # cosines: q0 -> k0 .999, k3 .74;  q1 -> k1 .98, k3 .69;  q2 -> k1 .995, k3 .78
    q = torch.tensor([[2.0, 0.1, 0], [0, 1, 0.2], [0.1, 1, 0]])
    nearest = [[0, 3], [1, 3], [1, 3]]
    assert select(q, KEYS, 2, batchwise=False).tolist() == nearest
    assert select(q, 5 * KEYS, 2, batchwise=False).tolist() == nearest  # cosine: scale-free
    # per batch: counts k3 3, k1 2, k0 1 -> the two most chosen, for every row
    assert select(q, KEYS, 2, batchwise=True).tolist() == [[3, 1]] * 3
    # ties go to the lower prompt id: q0 -> {0, 3}, q1 -> {1, 2}: each chosen once
    tie = torch.tensor([[2.0, 0.1, 0], [0, 1, 1.01]])
    assert select(tie, KEYS, 2, batchwise=False).tolist() == [[0, 3], [2, 1]]
    assert select(tie, KEYS, 2, batchwise=True).tolist() == [[0, 1]] * 2


def test_pull_term_on_a_hand_built_case():
    q = torch.tensor([[1.0, 0], [0, 3]])
    keys = torch.tensor([[2.0, 0], [0, 1], [1, 1]], requires_grad=True)
    idx = torch.tensor([[0, 1], [0, 2]])
    got = pull_term(q, keys, idx)
    # row 0: (1 - 1) + (1 - 0);  row 1: (1 - 0) + (1 - 1/sqrt 2)
    torch.testing.assert_close(got, torch.tensor([1.0, 2 - 1 / math.sqrt(2)]))
    got.sum().backward()
    assert keys.grad[0].abs().sum() > 0 and keys.grad[2].abs().sum() > 0
    # key 1 is selected by row 0 only, where it is orthogonal to the query: the gradient of
    # 1 - cos at cos = 0 points along the query, not zero
    torch.testing.assert_close(keys.grad[1], torch.tensor([-1.0, 0.0]))


# ------------------------------------------------------------------ the prompted forward
def test_query_is_the_frozen_vits_cls_output_without_prompts():
    _, model, plain = method_and_model()
    x = digits()
    body = model.body
    assert isinstance(body, PromptedViT)
    with torch.no_grad():
        q = body.encode(body.embed(x))[:, 0]
        assert torch.equal(q, plain(x))  # the plain ViT, grayscale taken as RGB
    check_model("vit", (1, 8, 8), {"pretrained": True})  # pretrained weights on grayscale data


def test_features_come_from_the_selected_prompts_alone():
    _, model, _ = method_and_model()
    body, x = model.body, digits()
    with torch.no_grad():
        z, _, idx = body.prompted(x)
        emb = body.embed(x)
        # by hand, row 0: its prompts, then the embedded input; the mean of the prompt outputs
        p0 = body.prompt[idx[0]].reshape(-1, 16)
        ref = body.encode(torch.cat([p0, emb[0]])[None])[0, : len(p0)].mean(0)
        torch.testing.assert_close(z[0], ref)
        unused = sorted(set(range(4)) - set(idx.flatten().tolist()))
        assert unused, "some prompt must be left out for this test"
        body.prompt[unused[0]] += 1.0
        assert torch.equal(body.prompted(x)[0], z)  # an unselected prompt changes nothing
        body.prompt[idx[0, 0]] += 1.0
        assert not torch.allclose(body.prompted(x)[0][0], z[0])


def class_il(tasks=2):
    raw = {"kind": "split", "tasks": tasks, "classes_per_task": 2, "leftover_classes": "drop"}
    return Scenario.build(resolve_scenario(raw, 10, (1, 8, 8), "scenario"), 10, (1, 8, 8), tasks)


def context(model, task=1):
    return ClientContext(
        cid=0, round=1, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        global_params={}, broadcast={}, state={}, n_samples=6, lr=0.1, local_epochs=1, batch_size=6, task=task,
    )  # fmt: skip


def test_local_loss_is_eq5_with_the_class_il_train_mask():
    method, model, _ = method_and_model({"pull_coeff": 0.3}, scenario=class_il())
    x, y = digits(), torch.tensor([2, 3, 2, 2, 3, 3])  # task 1 holds classes 2 and 3
    ctx = context(model)
    method.client_begin(ctx)
    loss = method.step_loss(ctx, x, y)
    with torch.no_grad():
        z, _, idx = model.body.prompted(x)
        q = model.body.encode(model.body.embed(x))[:, 0]
    k = model.body.prompt_key.detach()
    pull = torch.stack(
        [sum(1 - F.cosine_similarity(q[b], k[j], dim=0) for j in idx[b]) for b in range(6)]
    )
    ce = F.cross_entropy(model.head(z)[:, 2:4], y - 2)  # CE over the task's two classes only
    torch.testing.assert_close(loss, ce + 0.3 * pull.mean())
    # without the mask: CE over all ten classes
    method, model, _ = method_and_model(
        {"pull_coeff": 0.0, "train_mask": False}, scenario=class_il()
    )
    ctx = context(model)
    method.client_begin(ctx)
    torch.testing.assert_close(method.step_loss(ctx, x, y), F.cross_entropy(model(x), y))


def test_only_prompts_keys_and_head_get_gradients():
    method, model, _ = method_and_model()
    x, y = digits(), torch.tensor([0, 1, 2, 3, 4, 5])
    ctx = context(model, task=0)
    method.client_begin(ctx)
    method.client_step(ctx, x, y)
    method.client_grad(ctx)
    with torch.no_grad():
        used = set(model.body.prompted(x)[2].flatten().tolist())
    for n, p in model.named_parameters():
        if n in TRAINABLE:
            assert p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert not p.requires_grad and p.grad is None, n
    for j in range(4):  # a prompt and its key learn only where selected
        for g in (model.body.prompt.grad[j], model.body.prompt_key.grad[j]):
            assert (g.abs().sum() > 0) == (j in used)
    norm = torch.sqrt(sum((p.grad**2).sum() for n, p in model.named_parameters() if n in TRAINABLE))
    assert norm <= 1.0 + 1e-5  # clip_norm 1 [C]


def test_a_non_vit_model_is_refused(make_run_config):
    rc = make_run_config(dataset="digits", model="cnn2d", model_options=SMALL_CNN, method="l2p")
    with pytest.raises(FedForgetError, match="dataset.model.name must be 'vit'"):
        Simulation(rc, device=CPU)


@pytest.mark.parametrize(
    "params, match",
    [
        ({"top_k": 11}, "top_k=11"),
        ({"pool_size": 0}, "pool_size=0"),
        ({"length": 0}, "length=0"),
        ({"pull_coeff": -1}, "pull_coeff=-1"),
        ({"selection": "task"}, "selection='task'"),
        ({"train_mask": 1}, "train_mask=1"),
        ({"init_scale": 0}, "init_scale=0"),
        ({"clip_norm": -0.5}, "clip_norm=-0.5"),
    ],
)
def test_bad_params_name_the_value(params, match):
    with pytest.raises(FedForgetError, match=match):
        check_params("l2p", params)


# ------------------------------------------------------------------ federated runs
@pytest.mark.parametrize("setting", ["class", "task"])
def test_split_digits_run_trains_prompts_keys_and_head_only(make_run_config, setting):
    scenario = {
        **SPLIT,
        "incremental": setting,
        "heads": "per_task" if setting == "task" else "shared",
    }
    rc = l2p_cfg(make_run_config, scenario=scenario)
    sim = Simulation(rc, device=CPU)
    before = {k: v.clone() for k, v in sim.global_params.items()}
    status, rows, msg = sim.run(progress=False)
    assert status == "completed", msg
    for k, v in sim.global_params.items():  # the backbone bit-identical, the rest trained
        assert torch.equal(v, before[k]) == k.startswith("body.vit."), k
    last = rows[-1]
    assert last["l2p_pull"] > 0 and 1 <= last["l2p_prompts_used"] <= 4
    assert all("batch_selection" in r for r in last["_tasks"])


def test_resume_mid_task_and_at_a_task_boundary_is_exact(make_run_config):
    scenario = {**SPLIT, "tasks": 2, "rounds_per_task": 2}
    rc = l2p_cfg(make_run_config, params={"selection": "batch"}, scenario=scenario, rounds=4,
                 sample_rate=0.5, checkpoint_every=1, eval_every=1)  # fmt: skip
    full = Simulation(rc, device=CPU)
    saved, keep = checkpoint_keeper()
    status, rows_full, _ = full.run(progress=False, on_checkpoint=keep)
    assert status == "completed"
    assert all("instance_selection" in t for t in rows_full[-1]["_tasks"])
    for stop in (1, 2):  # the middle of task 0, its end
        torch.manual_seed(12345)  # a new process: the global RNG is elsewhere
        resumed = Simulation(rc, device=CPU)
        status, rows_res, _ = resumed.run(
            progress=False, resume=next(c for c in saved if c["round"] == stop)
        )
        assert status == "completed"
        assert strip(rows_res) == strip(rows_full)
        for k, v in full.global_params.items():
            assert torch.equal(v, resumed.global_params[k]), k


def test_fedgp_over_l2p_runs_on_the_trainable_parameters(make_run_config):
    rc = l2p_cfg(
        make_run_config,
        method="fedgp",
        params={"base": "l2p", "base_params": SMALL, "buffer_size": 20},
    )
    sim = Simulation(rc, device=CPU)
    before = {k: v.clone() for k, v in sim.global_params.items() if k.startswith("body.vit.")}
    status, rows, msg = sim.run(progress=False)
    assert status == "completed", msg
    assert "fedgp_proj_share" in rows[-1] and "fedgp_l2p_pull" in rows[-1]
    assert set(sim.server.state[STATE_KEY]) == TRAINABLE  # g_ref over prompts, keys, head
    for k, v in before.items():
        assert torch.equal(sim.global_params[k], v), k


# ------------------------------------------------------------------ stacked trainer
@pytest.mark.parametrize(
    "method,setting",
    [("l2p", "class"),  # the class-IL train mask, the clip (lr high enough to reach it)
     ("l2p", "task"),  # per-task heads: the active head in the stack
     ("fedgp", "class")],  # FedGP's projection after L2P's clip (stacks_over_live)
)  # fmt: skip
def test_trains_stacked_as_sequential(make_run_config, run_engines, assert_same_metrics, method, setting):
    """Issue 32, 3: L2P's prompted forward in the stacked trainer (``PromptedViT.stacked_body``:
    the frozen ViT once over the stack's rows, each row with its client's prompts), its pull
    term and clip as live terms, within 1e-5 of one client after another (metrics with the
    pull term and prompts used, the trained prompts, keys and head); the backbone untouched."""
    scenario = {**SPLIT, "incremental": setting, "heads": "per_task" if setting == "task" else "shared"}
    params = {"base": "l2p", "base_params": SMALL, "buffer_size": 20} if method == "fedgp" else None
    rc = l2p_cfg(make_run_config, method=method, params=params, scenario=scenario, sample_rate=0.75, local_epochs=2,
                 eval_every=1, optimizer={"lr": 0.5})  # fmt: skip
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    prefix = "fedgp_l2p_" if method == "fedgp" else "l2p_"
    assert rows_s[-1][prefix + "pull"] > 0 and rows_s[-1][prefix + "prompts_used"] >= 1
    for k, v in seq.global_params.items():
        torch.testing.assert_close(v, vec.global_params[k], atol=1e-5, rtol=1e-5, msg=k)
        if k.startswith("body.vit."):
            assert torch.equal(v, vec.global_params[k]), k


def test_batch_selection_and_dropout_train_one_client_after_another():
    from fedforget.methods import METHODS
    from fedforget.vectorized import method_not_vectorized

    assert method_not_vectorized(METHODS.get("l2p"), "sgd", params=make_params("l2p", {})) is None
    why = method_not_vectorized(METHODS.get("l2p"), "sgd", params=make_params("l2p", {"selection": "batch"}))
    assert "declares stacked = False" in why
    _, model, _ = method_and_model()  # the frozen ViT's dropout would draw in its training forward
    assert model.body.stacked_unsupported() is None
    model.body.vit.encoder.dropout.p = 0.1
    assert model.body.stacked_unsupported() == "PromptedViT(dropout > 0: Dropout)"
