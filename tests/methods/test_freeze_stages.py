"""The model option ``freeze_stages`` (FedProTIP's protocol: after the first task the stem and
the first residual stages / encoder blocks train no more, for every method): which parameters
it holds (the FedProTIP code's first 30 ResNet-18 parameters), that a run keeps them at their
task-0 values from the second task on while task 0 trains them, that the stacked trainer
equals the sequential one with them held, that FedProTIP's own ``freeze_early`` gives the same
run on ResNet-18, and the configs it refuses."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fedforget.data.scenario import resolve_scenario
from fedforget.methods import METHODS, make_params
from fedforget.methods.shared import projected_layers
from fedforget.models import build_model
from fedforget.parse import parse_config
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError

from ..conftest import TEST_DEVICE
from .conftest import CPU, PUBLIC, QUICK_PARAMS, SPLIT, TINY_VIT, run, strip
from .test_concurrent_clients import TINY_TARGET

RESNET = {"stem": "cifar", "pool": 2}


def test_resnet18_holds_the_stem_and_the_first_stages_as_the_fedprotip_code():
    """freeze_stages 2 holds the FedProTIP code's ``freeze_layers`` set: the first 30 named
    parameters of the network (stem convolution and BatchNorm, layer1, layer2), and nothing
    of the head; those layers are no projected layers (no bases)."""
    model = build_model("resnet18_imagenet", (3, 8, 8), 10, {**RESNET, "freeze_stages": 2})
    body = [n for n, _ in model.named_parameters() if n.startswith("body.")]
    assert model.held == frozenset(body[:30])
    assert not any(n.startswith("body.6.") or n.startswith("head") for n in model.held)  # layer3 and on train
    assert build_model("resnet18_imagenet", (3, 8, 8), 10, RESNET).held == frozenset()
    layers = projected_layers(model)
    assert len(layers) == 21 - 10 and all(f"{n}.weight" not in model.held for n in layers)
    model.set_task(0)
    assert all(q.requires_grad for q in model.parameters())
    model.set_task(1)
    assert {n for n, q in model.named_parameters() if not q.requires_grad} == model.held
    model.set_task(0)  # a client still in the first task (asynchronous boundaries) trains them
    assert all(q.requires_grad for q in model.parameters())


def test_vit_holds_the_tokens_the_patch_embedding_and_the_first_blocks():
    model = build_model("vit", (3, 8, 8), 10, {**TINY_VIT, "layers": 3, "freeze_stages": 2})
    v = "body.vit."
    want = {f"{v}class_token", f"{v}conv_proj.weight", f"{v}conv_proj.bias", f"{v}encoder.pos_embedding"}
    want |= {n for n, _ in model.named_parameters() if n.startswith((f"{v}encoder.layers.encoder_layer_0.",
                                                                      f"{v}encoder.layers.encoder_layer_1."))}  # fmt: skip
    assert model.held == want and len(want) == 4 + 2 * 12


def vit_run(make_run_config, method="fedavg", params=None, **train):
    """Split digits (3 tasks x 2 rounds) on a tiny 2-block ViT with freeze_stages 1."""
    return make_run_config(
        dataset="digits", model="vit", model_options={**TINY_VIT, "layers": 2, "freeze_stages": 1}, method=method,
        params=params or {}, scenario={**SPLIT, "rounds_per_task": 2},
        partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=10, seed=0),
        **{"rounds": 6, "batch_size": 32, "eval_local_models": False, "eval_every": 6,
           "optimizer": {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}, **train},
    )  # fmt: skip


def test_held_parameters_train_in_the_first_task_only(make_run_config):
    """Task 0 moves the held parameters; from the second task on every round's global model
    keeps them at their values after task 0, bit for bit (with momentum and weight decay),
    while the others train on; without the option they move on."""
    rc = vit_run(make_run_config, save_client_models=[1, 2, 3, 5])
    sim, _ = run(rc)
    held = sim.model.held
    snaps = sim.snapshots
    assert held and all(not torch.equal(snaps[1]["global_before"][n], snaps[2]["global_after"][n]) for n in held)
    after0 = snaps[2]["global_after"]
    for r in (3, 5):
        assert all(torch.equal(snaps[r]["global_after"][n], after0[n]) for n in held)
        assert all(torch.equal(u[n], after0[n]) for u in snaps[r]["clients"].values() for n in held)
        assert not all(torch.equal(snaps[r]["global_after"][n], after0[n]) for n in sim.global_params if n not in held)
    free = replace(rc, dataset=replace(rc.dataset, model_options={**TINY_VIT, "layers": 2}))
    sim_free, _ = run(free)
    assert not all(torch.equal(sim_free.snapshots[5]["global_after"][n], sim_free.snapshots[2]["global_after"][n])
                   for n in held)  # fmt: skip


@pytest.mark.parametrize(
    "model,method,params",
    [("vit", "fedavg", {}), ("vit", "fedprox", {"mu": 0.1}),
     # on a CPU's paths (steps of 32 rows client by client, tails batched): stacked at batch 32,
     # BatchNorm over ResNet-18's 1x1 last stage amplifies rounding past 1e-5 within a round
     pytest.param("resnet18_imagenet", "fedavg", {}, marks=pytest.mark.cpu_paths)],
)  # fmt: skip
def test_held_parameters_train_stacked_as_sequential(make_run_config, run_engines, assert_same_metrics, model, method, params):
    """The stacked trainer leaves the held parameters out of the stack from the second task
    on, as a client alone (whose optimizer skips them), and its forward reads them beside
    BatchNorm's per-client statistics: metrics and weights within 1e-5 (a ViT: task 0's
    steps client by client, the convolution held after; ResNet-18: BatchNorm, tails batched)."""
    rc = vit_run(make_run_config, method, params, local_epochs=2, sample_rate=0.75)
    if model != "vit":
        rc = replace(rc, dataset=replace(rc.dataset, model=model, model_options={**RESNET, "freeze_stages": 2}),
                     train=replace(rc.train, drop_last=True, rounds=2, local_epochs=1, sample_rate=1.0),
                     partition=replace(rc.partition, clients=2))  # fmt: skip
        rc = replace(rc, dataset=replace(rc.dataset, scenario={**rc.dataset.scenario, "tasks": 2, "rounds_per_task": 1}))
    out = run_engines(rc, CPU)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    for k, v in seq.global_params.items():
        torch.testing.assert_close(v, vec.global_params[k], atol=1e-5, rtol=1e-5, msg=k)


def test_held_parameters_replay_under_graphs_as_eager_steps(make_run_config, monkeypatch):
    """ResNet-18 with its first stages held, batched, on the test device: the steps of the
    second task (the held parameters out of the stack, read beside BatchNorm's per-client
    statistics) captured and replayed (CUDA graphs on a GPU, the tape on a CPU:
    FEDFORGET_CUDA_GRAPHS=tape; batch 8, narrow steps that a CPU batches too) give the eager
    steps' run bit for bit. The lr decays every round, so on a CPU the graphs kept at the end
    are the second task's (each round's replace the last's). [D] Not against the sequential
    trainer here: at batch 8 BatchNorm over ResNet-18's 1x1 last stage amplifies rounding
    (one after another, 1 and 2 threads differ by 1e-3 in the test loss after a round)."""
    import fedforget.vectorized as vz

    device = torch.device(TEST_DEVICE)
    rc = make_run_config(
        dataset="digits", model="resnet18_imagenet", model_options={**RESNET, "freeze_stages": 2},
        scenario={**SPLIT, "tasks": 2}, partition=PartitionSpec("dirichlet", clients=2, alpha=0.5, min_size=10, seed=0),
        rounds=2, batch_size=8, drop_last=True, client_engine="vectorized", lr_decay=0.5, eval_local_models=False,
        optimizer={"lr": 0.005, "momentum": 0.9, "weight_decay": 1e-3},
    )  # fmt: skip
    runs = []
    for flag in ("0", "1" if device.type == "cuda" else "tape"):
        monkeypatch.setenv("FEDFORGET_CUDA_GRAPHS", flag)
        runs.append(run(rc, device))
    (eager, rows_e), (graphed, rows_g) = runs
    g = graphed.trainer.step_graphs
    assert eager.trainer.step_graphs is None and g.replays > 0 and g.graphs
    if not vz.lr_on_device(device):  # the lr a number (a CPU): the graphs kept are the second round's (task 1's)
        assert {k[-5] for k in g.graphs} == {0.005 * 0.5}
    assert strip(rows_e) == strip(rows_g)
    for k, v in eager.global_params.items():
        assert torch.equal(v, graphed.global_params[k]), k


def test_fedprotip_freeze_early_is_freeze_stages_2_on_resnet18(make_run_config):
    """On ResNet-18 FedProTIP's own freeze_early (the first half of the projected layers) and
    the model's freeze_stages 2 freeze the same layers from the second task on and collect the
    same bases: the same run, bit for bit (but for the basis-fill diagnostics)."""
    rc = make_run_config(
        dataset="digits", model="resnet18_imagenet", model_options=RESNET, method="fedprotip",
        params={"tip": "none", "samples": 16, "freeze_early": True}, scenario={**SPLIT, "tasks": 2},
        partition=PartitionSpec("iid", clients=2, seed=0), rounds=2, batch_size=64, eval_local_models=False,
        eval_every=2, sample_rate=0.5, drop_last=True, optimizer={"lr": 0.05, "weight_decay": 1e-3},
    )  # fmt: skip
    early, rows_e = run(rc)
    staged = replace(
        rc, dataset=replace(rc.dataset, model_options={**RESNET, "freeze_stages": 2}),
        method=replace(rc.method, params={**rc.method.params, "freeze_early": False}),
    )  # fmt: skip
    stages, rows_s = run(staged)
    trained = [{k: v for k, v in r.items() if not k.startswith("fedprotip_basis_fill")} for r in strip(rows_e)]
    assert trained == [{k: v for k, v in r.items() if not k.startswith("fedprotip_basis_fill")} for r in strip(rows_s)]
    # the fill diagnostics differ, and only there: freeze_early reports its frozen layers at 0
    # (they are projected layers), freeze_stages leaves them out (no projected layers)
    assert rows_e[-1]["fedprotip_basis_fill_body_0"] == 0.0 and "fedprotip_basis_fill_body_0" not in rows_s[-1]
    assert all(torch.equal(v, stages.global_params[k]) for k, v in early.global_params.items())
    assert early.server.state["fedprotip_bases"].keys() == stages.server.state["fedprotip_bases"].keys()


def raw(model_options, method=None, scenario=SPLIT, model="resnet18_imagenet"):
    return {"experiments": [{
        "name": "fz", "datasets": [{"name": "digits", "model": {"name": model, "options": model_options},
                                    **({"scenario": scenario} if scenario else {})}],
        "partitions": [{"scheme": "iid", "clients": 2}], "methods": [method or {"name": "fedavg"}],
        "seeds": [0], "train": {"rounds": 3}}]}  # fmt: skip


@pytest.mark.parametrize(
    "options,method,scenario,model,match",
    [
        ({"freeze_stages": 5}, None, SPLIT, "resnet18_imagenet", r"freeze_stages=5 .*allowed: an integer 0\.\.4"),
        ({"freeze_stages": True}, None, SPLIT, "resnet18_imagenet", r"freeze_stages=True"),
        ({**TINY_VIT, "freeze_stages": 2}, None, SPLIT, "vit", r"freeze_stages=2 .*0\.\.1"),
        ({"freeze_stages": 2}, None, None, "resnet18_imagenet", r"freeze_stages=2: .*streams one task"),
        ({"freeze_stages": 2}, {"name": "fedprotip", "params": {"tip": "none", "freeze_early": True}}, SPLIT,
         "resnet18_imagenet", r"freeze_early=True and model.options.freeze_stages=2"),
        ({**TINY_VIT, "freeze_stages": 1}, {"name": "l2p"}, SPLIT, "vit", r"'l2p' .*freeze_stages=1"),
        ({"freeze_stages": 1}, None, SPLIT, "resnet18", r"unknown option\(s\) \['freeze_stages'\]"),
        ({"freeze_stages": 2}, {"name": "scaffold"}, SPLIT, "resnet18_imagenet",
         r"method 'scaffold' is not defined for a model that freezes stages .*allowed: freeze_stages 0"),
        ({"freeze_stages": 2}, {"name": "fedsol", "params": {"base": "feddyn", "proximal": "base"}}, SPLIT,
         "resnet18_imagenet", r"method 'feddyn' is not defined for a model that freezes stages"),
    ],
    ids=["too-many", "bool", "vit-too-many", "one-task", "fedprotip-both", "l2p", "other-model", "scaffold", "fedsol-feddyn"],
)
def test_freeze_stages_refused(options, method, scenario, model, match):
    with pytest.raises(FedForgetError, match=match):
        parse_config(raw(options, method, scenario, model))


def _accepts(name: str) -> bool:
    """Whether method ``name`` runs the contract's split stream with freeze_stages (L2P refuses
    it: its ViT is frozen whole)."""
    try:
        params = make_params(name, PARAMS.get(name) or {})
        METHODS.get(name).check_scenario(resolve_scenario(TWO_TASKS, 10, (1, 8, 8), "scenario"), params)
        METHODS.get(name).check_model("vit", params, {"freeze_stages": 1})
    except FedForgetError:
        return False
    return True


TWO_TASKS = {**SPLIT, "tasks": 2}
PARAMS = {**QUICK_PARAMS, "target": TINY_TARGET, "target_lode": TINY_TARGET, "lander": {**TINY_TARGET, "warmup": 0},
          "fedprotip": {"tip": "none", "samples": 32}}  # fmt: skip
ACCEPTING = [n for n in METHODS.names() if _accepts(n)]


def test_the_methods_of_the_fedprotip_tables_accept_freeze_stages():
    """FedProTIP's tables freeze for all their methods; the methods whose state is one vector
    over the trained parameters (SCAFFOLD, FedDyn), and L2P's frozen ViT, refuse it."""
    assert {"fedavg", "glfc", "lga", "target", "lander", "fot", "fedprotip", "scr", "target_lode"} <= set(ACCEPTING)
    assert {"scaffold", "feddyn", "l2p"}.isdisjoint(ACCEPTING)


@pytest.mark.parametrize("method", ACCEPTING)
def test_every_method_keeps_the_held_parameters_from_the_second_task_on(make_run_config, digits_public_root, method):
    """A contract over every registered method that runs a split stream: with freeze_stages
    (a 2-block ViT, its tokens, patch embedding and first block held), the global model
    after the second task holds them at their values after the first, bit for bit, whatever
    the method's own steps (server distillation, control variates, replay, projections,
    synthesis), and its other parameters moved."""
    rc = make_run_config(
        dataset="digits", model="vit", model_options={**TINY_VIT, "layers": 2, "freeze_stages": 1}, method=method,
        params=PARAMS.get(method), public=PUBLIC, scenario=TWO_TASKS,
        partition=PartitionSpec("dirichlet", clients=3, alpha=0.5, min_size=10, seed=0),
        rounds=2, batch_size=32, eval_local_models=False, eval_every=2, save_client_models=[1, 2],
    )  # fmt: skip
    sim, _ = run(replace(rc, data_dir=str(digits_public_root)))
    first, second = sim.snapshots[1]["global_after"], sim.snapshots[2]["global_after"]
    held = sim.model.held
    assert held and all(torch.equal(first[n], second[n]) for n in held), method
    assert not all(torch.equal(first[n], second[n]) for n, _ in sim.model.named_parameters() if n not in held), method


def test_the_fedprotip_paper_configs_freeze_for_every_method():
    """Every FedProTIP paper config on a pretrained network freezes its stem and first stages
    after the first task through the model (every method: ResNet-18's two stages, ViT-B/16's six
    blocks, as the code's freeze_layers), none through FedProTIP's own freeze_early; the
    scratch ResNet (Table 6) freezes nothing, as the code, which freezes pretrained networks only.
    On DomainNet FedProTIP and FOT run BatchNorm on batch statistics, the other methods not."""
    import yaml

    paper = Path(__file__).resolve().parents[2] / "config" / "experiments" / "paper"
    seen, domainnet = set(), set()
    for path in sorted(paper.glob("fedprotip_*.yaml")):
        for ex in yaml.safe_load(path.read_text())["experiments"]:
            for d in ex["datasets"]:
                model = d["model"]
                opts = model.get("options") or {}
                want = {"resnet18_imagenet": 2, "vit": 6}[model["name"]] if opts.get("pretrained") else None
                assert opts.get("freeze_stages") == want, (path.name, ex["name"], model)
                seen.add((model["name"], want))
                if d["name"] == "domainnet":  # the code's track_rs: off for FedProTIP and FOT there [C]
                    stateless = {m["name"] for m in ex["methods"]} <= {"fedprotip", "fot"}
                    assert (opts.get("norm") == "batch_stateless") == stateless, (path.name, ex["name"])
                    domainnet.add(stateless)
            assert not any((m.get("params") or {}).get("freeze_early") for m in ex["methods"]), (path.name, ex["name"])
    assert seen == {("resnet18_imagenet", 2), ("vit", 6), ("resnet18_imagenet", None)} and domainnet == {True, False}
