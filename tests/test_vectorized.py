"""Clients trained together (fedforget.vectorized) against one after another."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedforget.engine import TIMING_COLUMNS, Simulation
from fedforget.methods import METHODS
from fedforget.models import Classifier, build_model
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError
from fedforget.vectorized import (
    auto_prefers_sequential,
    evaluate_stacked,
    stacked_forward,
    stacked_supported,
    why_not_vectorized,
)

from .conftest import SMALL_RESNET, TEST_DEVICE


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
def test_vectorized_equals_sequential_within_1e5(make_run_config, run_engines, assert_same_metrics, kw):
    out = run_engines(make_run_config(**kw))
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    for k, v in seq.global_params.items():
        assert torch.allclose(v, vec.global_params[k], atol=1e-4, rtol=1e-4), k


def full_width_steps(monkeypatch) -> set[int]:
    """Every batched step run full_width (a GPU's default for models without BatchNorm); the
    widths of the steps' gathers, as the set returned fills."""
    import fedforget.trainers as tr

    real, widths = tr.train_clients_together, set()

    def padded(model, global_params, batch, jobs, **k):
        def spy(pos):
            widths.add(pos.shape[-1])
            return batch(pos)

        return real(model, global_params, spy, jobs, **{**k, "full_width": True})

    monkeypatch.setattr(tr, "train_clients_together", padded)
    return widths


@pytest.mark.parametrize(
    "kw",
    [
        dict(dataset="iris", model="mlp", partition=PartitionSpec("dirichlet", clients=5, alpha=0.5, min_size=3, seed=1),
             rounds=2, local_epochs=2, batch_size=7, sample_rate=1.0, optimizer={"lr": 0.1, "momentum": 0.9}),
        dict(dataset="mnist1d", model="cnn1d",
             partition=PartitionSpec("dirichlet", clients=6, alpha=0.3, min_size=5, seed=0),
             rounds=2, local_epochs=1, batch_size=32, sample_rate=0.5, optimizer={"lr": 0.05, "weight_decay": 1e-4}),
        # live terms on padded rows: FedSOL's KL direction and FedNTD's distillation read
        # each client's real rows only
        dict(dataset="iris", model="mlp", method="fedsol", params={"rho": 1.0},
             partition=PartitionSpec("dirichlet", clients=5, alpha=0.5, min_size=3, seed=1),
             rounds=2, local_epochs=2, batch_size=7, sample_rate=1.0, optimizer={"lr": 0.1, "momentum": 0.9}),
        dict(dataset="iris", model="mlp", method="fedntd", params={"tau": 2.0},
             partition=PartitionSpec("dirichlet", clients=5, alpha=0.5, min_size=3, seed=1),
             rounds=2, local_epochs=2, batch_size=7, sample_rate=1.0, optimizer={"lr": 0.1, "momentum": 0.9}),
    ],
    ids=["iris-mlp", "mnist1d-cnn1d", "iris-mlp-fedsol", "iris-mlp-fedntd"],
)
def test_full_width_steps_equal_sequential(make_run_config, run_engines, assert_same_metrics, monkeypatch, kw):
    """full_width (a GPU's default for models without BatchNorm): every batched step is
    batch_size rows wide, the partial last minibatches padded with masked rows; the clients'
    results stay those of one after another within 1e-5."""
    widths = full_width_steps(monkeypatch)
    out = run_engines(make_run_config(**kw))
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert widths == {kw["batch_size"]}  # partial minibatches exist in these splits, and were padded
    assert_same_metrics(rows_s, rows_v)
    for k, v in seq.global_params.items():
        assert torch.allclose(v, vec.global_params[k], atol=1e-4, rtol=1e-4), k


def test_a_batch_wider_than_every_client_is_full_batch_training(make_run_config, run_engines, assert_same_metrics, monkeypatch):
    """train.batch_size 10**12 (each epoch one minibatch of a client's rows): the batched
    steps are as wide as the largest client, not 10**12 rows (that table was allocated, and
    failed), even full_width; the same results as batch_size = the largest client's rows,
    and as the clients one after another."""
    widths = full_width_steps(monkeypatch)
    kw = dict(dataset="iris", model="mlp", partition=PartitionSpec("dirichlet", clients=5, alpha=0.5, min_size=3, seed=1),
              rounds=2, local_epochs=2, sample_rate=1.0, optimizer={"lr": 0.1, "momentum": 0.9})  # fmt: skip
    out = run_engines(make_run_config(batch_size=10**12, **kw))
    (_, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    largest = vec.trainer.clients.largest
    assert widths == {largest} and largest < 100
    assert_same_metrics(rows_s, rows_v)
    widths.clear()
    _, rows_n = run_engines(make_run_config(batch_size=largest, **kw))["vectorized"]
    assert widths == {largest}
    assert_same_metrics(rows_v, rows_n, tol=0)


def test_small_groups_give_the_same_result(make_run_config, run_engines, assert_same_metrics):
    rc = make_run_config(dataset="digits", model="cnn2d", rounds=2, sample_rate=1.0,
                         partition=PartitionSpec("dirichlet", clients=6, alpha=0.3, seed=0))  # fmt: skip
    one = Simulation(replace(rc, train=replace(rc.train, client_engine="vectorized", max_parallel_clients=2)))
    _, rows_groups, _ = one.run(progress=False)
    _, rows_all = run_engines(rc)["vectorized"]
    assert_same_metrics(rows_groups, rows_all, tol=1e-6)


def test_a_group_out_of_gpu_memory_names_the_setting(make_run_config, monkeypatch):
    """A batched group that runs out of GPU memory (its stack grows with its clients) stops
    the run with one error naming the group's size and ``train.max_parallel_clients``."""
    import fedforget.trainers

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore detail")

    monkeypatch.setattr(fedforget.trainers, "train_clients_together", oom)
    rc = make_run_config(partition=PartitionSpec("iid", clients=4, seed=0))
    sim = Simulation(replace(rc, train=replace(rc.train, client_engine="vectorized", max_parallel_clients=3)))
    want = (r"round 1: the batched engine's group of 3 clients ran out of GPU memory \(CUDA out of memory. "
            r"Tried to allocate 2.00 GiB.\); set train.max_parallel_clients below 3 \(now 3\)")
    with pytest.raises(FedForgetError, match=want):
        sim.run(progress=False)


def test_engine_choice_and_fallback(make_run_config):
    rc = make_run_config()
    assert Simulation(replace(rc, train=replace(rc.train, client_engine="sequential"))).engine_info["client_engine"] == "sequential"
    # a method whose step is not batched in this setting falls back, and says why (GLFC's live
    # terms with per-task heads)
    heads = {"kind": "split", "tasks": 2, "classes_per_task": 5, "rounds_per_task": 1, "heads": "per_task"}
    seq = make_run_config(method="glfc", dataset="digits", scenario=heads, rounds=2)
    sim = Simulation(replace(seq, train=replace(seq.train, client_engine="auto")))
    assert sim.engine_info["client_engine"] == "sequential"
    assert "glfc" in sim.engine_info["client_engine_reason"]
    with pytest.raises(FedForgetError, match="client_engine='vectorized' is not possible here: per-task heads with "
                                             "method 'glfc'"):  # fmt: skip
        Simulation(replace(seq, train=replace(seq.train, client_engine="vectorized")))
    # live terms (FedSOL's second pass) run where stacked_forward runs the model: a model
    # only vmap can batch (PReLU; no registered model since torchvision's ViT stacks) trains
    # sequentially, and asking for the batched engine says why
    from fedforget.methods import make_params
    from fedforget.trainers import choose_trainer

    prelu = Classifier(nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.PReLU()), 4, 2)
    sol = make_run_config(method="fedsol")
    with pytest.raises(FedForgetError, match="method 'fedsol' has terms of the step's own forward pass"):
        choose_trainer(METHODS.get("fedsol"), prelu, replace(sol.train, client_engine="vectorized"), torch.device("cpu"),
                       make_params("fedsol", {}))  # fmt: skip
    rms = make_run_config()
    rms = replace(rms, train=replace(rms.train, optimizer=replace(rms.train.optimizer, name="rmsprop")))
    assert "optimizer 'rmsprop' (the batched path implements SGD and Adam)" in why_not_vectorized(
        METHODS.get("fedavg"), build_model("mlp", (4,), 2), "rmsprop")


ADAM = [
    # batched steps (an MLP): unequal client sizes and tail batches, betas, L2 weight decay
    dict(dataset="iris", model="mlp", batch_size=8, optimizer={"name": "adam", "lr": 0.01, "betas": [0.8, 0.99], "weight_decay": 1e-4}),
    dict(dataset="digits", model="mlp", batch_size=16, method="fedsam", params={"rho": 0.05},
         optimizer={"name": "adam", "lr": 0.002}),  # live terms: a second pass
    # a CPU's Conv2d steps client by client (every batch full: drop_last), their state carried
    dict(dataset="digits", model="cnn2d", batch_size=32, drop_last=True, method="fedprox", params={"mu": 0.1},
         optimizer={"name": "adam", "lr": 0.002, "weight_decay": 1e-4}),
]


@pytest.mark.parametrize("kw", ADAM, ids=["iris-mlp-betas", "fedsam", "cnn2d-fedprox-alone"])
def test_adam_stacked_equals_sequential(make_run_config, run_engines, assert_same_metrics, assert_same_weights, kw):
    """Adam in the batched engine (issue 32: FedProj's tables train with it): each client's
    two moments and step count stacked, torch.optim.Adam's update on every client's rows;
    within 1e-5 of the clients one after another (metrics and weights). [D] Adam divides by
    sqrt(v): a gradient coordinate near 0 whose sign rounding flips moves by about lr either
    way, so where the two trainers' gradients differ in rounding (a CPU's grouped
    convolutions of the tail steps) the weights come apart by the order of lr (an ad-hoc
    probe on cnn2d); these cases' gradients agree closely (MLPs) or exactly (each client's Conv2d
    steps in its replica, as alone). The update itself: test_adam_update_equals_torch."""
    rc = make_run_config(rounds=2, local_epochs=2, sample_rate=0.5,
                         partition=PartitionSpec("dirichlet", clients=6, alpha=0.5, min_size=10, seed=0), **kw)  # fmt: skip
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    assert_same_weights(seq, vec)


def test_channels_last_switch_refuses_an_unknown_value():
    from fedforget.vectorized import channels_last_mode

    assert channels_last_mode(None) == "resnet" and channels_last_mode("0") == "0" and channels_last_mode("1") == "1"
    with pytest.raises(FedForgetError, match="FEDFORGET_STACKED_CHANNELS_LAST='yes'; allowed: 0, 1, resnet"):
        channels_last_mode("yes")


def test_adam_update_equals_torch():
    """adam_update_ on 3 clients' stacked rows, over 5 steps of made-up gradients (weight
    decay on), equals torch.optim.Adam (foreach, as make_optimizer builds it) on each
    client's tensor alone, bit for bit on a CPU."""
    from fedforget.vectorized import adam_update_

    gen = torch.Generator().manual_seed(0)
    p = torch.randn(3, 4, 5, generator=gen)
    alone = [p[i].clone().requires_grad_() for i in range(3)]
    opts = [torch.optim.Adam([q], lr=0.01, betas=(0.8, 0.95), weight_decay=0.1, foreach=True) for q in alone]
    state = (torch.zeros_like(p), torch.zeros_like(p), torch.zeros(3))
    for _ in range(5):
        g = torch.randn(3, 4, 5, generator=gen) * torch.tensor([1.0, 1e-3, 10.0]).view(3, 1, 1)
        adam_update_([p], [g], [state], 0.01, (0.8, 0.95), 0.1)
        for i, (q, opt) in enumerate(zip(alone, opts)):
            q.grad = g[i].clone()
            opt.step()
    for i, q in enumerate(alone):
        assert torch.equal(p[i], q.detach()), i  # on a CPU the same bits (adam_update_)
    assert state[2].tolist() == [5.0, 5.0, 5.0]


def test_which_methods_train_clients_like_fedavg():
    like = {m for m in METHODS.names() if METHODS.get(m).stacked and not (METHODS.get(m).step_terms or METHODS.get(m).live_terms)}
    assert "fedavg" in like and "fedprox" not in like and "scaffold" not in like
    assert "feddyn" not in like and "moon" not in like and "fedsam" not in like
    # their own upload (client_end) only: batched training, then client_end per client
    assert {"fednova", "feddf", "fedet"} <= like and "fedproj" not in like


def test_which_buffers_the_stacked_path_keeps():
    """BatchNorm's running statistics are kept per client (issue 32); BatchNorm with a
    cumulative average (momentum None) and any other buffer are refused, named."""
    bn = build_model("resnet8", (1, 8, 8), 10, {"norm": "batch"})
    assert why_not_vectorized(METHODS.get("fedavg"), bn, "sgd") is None
    gn = build_model("resnet8", (1, 8, 8), 10, {"norm": "group"})
    assert why_not_vectorized(METHODS.get("fedavg"), gn, "sgd") is None
    bn.body.bn1.momentum = None
    assert "BatchNorm body.bn1 with momentum=None" in why_not_vectorized(METHODS.get("fedavg"), bn, "sgd")
    other = Classifier(nn.Sequential(nn.Flatten()), 4, 2)
    other.register_buffer("scale", torch.ones(1))
    assert "buffers other than BatchNorm's running statistics (scale)" in why_not_vectorized(METHODS.get("fedavg"), other, "sgd")


@pytest.mark.parametrize("drop_last,batch_size,norm", [(False, 64, "batch"), (True, 12, "batch"), (False, 12, "batch_stateless")],
                         ids=["unequal-batches", "drop-last", "stateless"])  # fmt: skip
def test_batchnorm_stacked_equals_sequential(
    make_run_config, run_engines, assert_same_metrics, assert_same_weights, drop_last, batch_size, norm
):
    """ResNet-8 with BatchNorm, clients trained together (stacked_forward over their stacked
    weights and running statistics; wide steps on a CPU client by client, a step's clients
    split into runs with batches of one size) equals the clients one after another within 1e-5: metrics, weights and every
    running statistic after aggregation, with and without drop_last; and without running
    statistics (``norm: batch_stateless``, evaluated by the test batches' own statistics)."""
    # [D] one round of 4 steps per client: BatchNorm training on small batches is chaotic enough
    # that float summation order (or the thread count, in the sequential trainer alone) grows
    # to 1e-1 in the running statistics over ~30 steps of 12 rows on 3 clients (measured); a
    # second round here already gives 1.1e-5 in the mean loss. The test is of the arithmetic
    rc = make_run_config(dataset="digits", model="resnet8", model_options={**SMALL_RESNET, "norm": norm}, rounds=1, local_epochs=2,
                         batch_size=batch_size, eval_batch_size=batch_size, sample_rate=0.1, drop_last=drop_last,
                         optimizer={"lr": 0.01, "momentum": 0.5, "weight_decay": 1e-4},
                         partition=PartitionSpec("iid", clients=40, seed=0))  # fmt: skip
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    assert_same_weights(seq, vec)  # num_batches_tracked equal
    assert any("running_mean" in k for k in seq.global_params) == (norm == "batch")


def test_auto_engine_choice_on_cpu(make_run_config):
    # batched where stacked_forward runs the model, one after another where only vmap could;
    # the reason is recorded
    for kw in ({}, {"dataset": "mnist1d", "model": "cnn1d"}, {"dataset": "digits", "model": "cnn2d"}):
        rc = make_run_config(device="cpu", **kw)
        sim = Simulation(replace(rc, train=replace(rc.train, client_engine="auto")))
        assert sim.engine_info["client_engine"] == "vectorized", (kw, sim.engine_info)
        assert "groups of at most" in sim.engine_info["client_engine_reason"]
    rc = make_run_config(dataset="digits", model="resnet8", model_options={"norm": "group"}, device="cpu")
    sim = Simulation(replace(rc, train=replace(rc.train, client_engine="auto")))
    assert sim.engine_info["client_engine"] == "sequential"
    assert "ResNetBody: the stacked ResNet step is measured on a GPU only" in sim.engine_info["client_engine_reason"]
    gn = build_model("resnet8", (1, 8, 8), 10, {"norm": "group"})
    assert auto_prefers_sequential(gn, torch.device("cuda")) is None  # batched: 1.72x the plain loop (H200)
    tv = build_model("resnet18_imagenet", (3, 8, 8), 10)  # torchvision's blocks, stacked since 2026-12-02
    assert auto_prefers_sequential(tv, torch.device("cuda")) is None
    assert "BatchNorm2d: the stacked ResNet step is measured on a GPU only" in auto_prefers_sequential(tv, torch.device("cpu"))
    vit = build_model("vit", (1, 8, 8), 10, VIT_TINY)  # stacked since 2026-12-03: on a GPU only
    assert auto_prefers_sequential(vit, torch.device("cuda")) is None
    assert "ViTBody: its stacked step is not measured on a CPU" in auto_prefers_sequential(vit, torch.device("cpu"))
    slvit = build_model("slvit", (1, 8, 8), 10, SLVIT_TINY)  # stacked since 2026-12-02: on a GPU only
    assert auto_prefers_sequential(slvit, torch.device("cuda")) is None
    assert "SLViTBody: its stacked step is not measured on a CPU" in auto_prefers_sequential(slvit, torch.device("cpu"))


def _stacked_params(model, g, seed=0):
    """g different weight sets of ``model``'s architecture, stacked [g, ...]."""
    gen = torch.Generator().manual_seed(seed)
    return {k: v.detach().unsqueeze(0) + 0.05 * torch.randn(g, *v.shape, generator=gen)
            for k, v in model.named_parameters()}  # fmt: skip


RESNETS = [(name, norm) for name in ("resnet8", "resnet18") for norm in ("batch", "batch_stateless", "group", "none")]


@pytest.mark.parametrize(
    "name,norm,nhwc",
    [*[(n, m, False) for n, m in RESNETS], ("resnet18_imagenet", "batch", False),
     ("resnet18", "batch", True), ("resnet8", "group", True), ("resnet18_imagenet", "batch", True)],
)  # fmt: skip
def test_stacked_resnet_equals_each_client_alone(name, norm, nhwc, monkeypatch):
    """The ResNets layer by layer (issue 32: grouped convolutions, BatchNorm and GroupNorm
    over the clients' channels side by side), ours and torchvision's (``resnet18_imagenet``,
    FedProTIP's tables: its BasicBlock, 7x7 stem, max-pool): in float64, logits, each
    client's gradient, its running statistics after the training-mode pass and
    num_batches_tracked equal those of its weights and statistics loaded into the module
    (functional_call) on its own rows, to rounding (1e-12), and the eval-mode logits (running
    statistics) likewise. [D] float64: in float32 a ReLU input within rounding of 0 takes the
    kink's two sides in the two passes for some init (ResNet-18 with GroupNorm: one layer's
    gradient 2 % apart). ``nhwc``: the stacked layers in channels_last, as on a GPU (there
    only: ``vectorized.nhwc_device``), here on the CPU."""
    from torch.func import functional_call

    import fedforget.vectorized as vec

    layouts = []
    if nhwc:
        monkeypatch.setattr(vec, "nhwc_device", lambda t: True)
        conv2d = vec.F.conv2d

        def spy(h, *args, **kw):
            nhwc_ok = h.is_contiguous(memory_format=torch.channels_last)  # (either, where C = 1 or H = W = 1)
            layouts.append((nhwc_ok, nhwc_ok and not h.is_contiguous()))
            return conv2d(h, *args, **kw)

        monkeypatch.setattr(vec.F, "conv2d", spy)
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    opts = {} if name == "resnet18_imagenet" else {"norm": norm, **SMALL_RESNET}
    model = build_model(name, (3, 8, 8), 10, opts).double().train()
    assert stacked_supported(model) is None
    g = 3
    p = {k: v.detach().unsqueeze(0) + 0.05 * torch.randn(g, *v.shape, generator=gen, dtype=v.dtype)
         for k, v in model.named_parameters()}  # fmt: skip
    st = {k: v.detach().unsqueeze(0).repeat(g, *[1] * v.dim()) for k, v in model.named_buffers()}
    for k in st:  # each client's own statistics
        if "running" in k:
            st[k] += torch.rand(st[k].shape, generator=gen, dtype=st[k].dtype)
    before = {k: v.clone() for k, v in st.items()}
    x = torch.randn(g, 6, 3, 8, 8, generator=gen, dtype=torch.float64)
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    out = stacked_forward(model, {**leaves, **st}, x)
    if nhwc:  # the stacked convolutions in NHWC: every one (torchvision's from its first block on)
        assert any(strict for _, strict in layouts)
        assert all(ok for ok, _ in (layouts[1:] if name == "resnet18_imagenet" else layouts))
    grads = torch.autograd.grad(out.square().sum(), list(leaves.values()))
    for j in range(g):
        own = {k: v[j].clone().requires_grad_() for k, v in p.items()}
        own_st = {k: v[j].clone() for k, v in before.items()}
        o = functional_call(model, {**own, **own_st}, (x[j],))
        want = torch.autograd.grad(o.square().sum(), list(own.values()))
        torch.testing.assert_close(out[j], o, rtol=1e-12, atol=1e-12)
        for k, a, b in zip(own, grads, want):
            torch.testing.assert_close(a[j], b, rtol=1e-10, atol=1e-10, msg=k)
        for k, v in own_st.items():
            assert torch.equal(v, st[k][j]) if "num_batches" in k else torch.allclose(v, st[k][j], atol=1e-12), k
    bn1 = "body.1" if name == "resnet18_imagenet" else "body.bn1"
    assert norm != "batch" or int(st[f"{bn1}.num_batches_tracked"][0]) == 1
    model.eval()
    with torch.no_grad():
        out = stacked_forward(model, {**p, **st}, x)
        for j in range(g):
            o = functional_call(model, {**{k: v[j] for k, v in p.items()}, **{k: v[j] for k, v in st.items()}}, (x[j],))
            torch.testing.assert_close(out[j], o, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "name,shape,opts",
    [("mlp", (64,), {}), ("mlp", (1, 8, 8), {"hidden": [16]}), ("cnn2d", (1, 8, 8), {}),
     ("cnn1d", (1, 40), {}), ("cnn_mcmahan", (1, 28, 28), {"padding": 0}), ("cnn_mcmahan", (3, 16, 16), {}),
     ("slvit", (3, 16, 16), {"dim": 16, "depth": 2, "heads": 2, "dim_head": 8, "mlp_dim": 16}), ("slvit", (1, 8, 8), {"patch_size": 4, "dim": 16, "depth": 1, "heads": 2, "dim_head": 8, "mlp_dim": 16})],
)  # fmt: skip
def test_stacked_forward_equals_each_client_alone(name, shape, opts):
    """Logits and each client's gradient of its own mean loss, from one stacked pass, equal
    those of the client's weights loaded into the model (functional_call) on its own data."""
    from torch.func import functional_call

    # a seeded init: unseeded, the global RNG (so the test order) chose it, and about 1 init in
    # 40 puts a ReLU's input within rounding of 0 for some row, where the stacked and the
    # alone pass then take the kink's two sides (cnn_mcmahan 3x16x16 at seed 4: one unit of
    # body.7, its gradient row 0.06 apart; the flake seen under pytest -n 2)
    torch.manual_seed(0)
    model = build_model(name, shape, 10, opts)
    assert stacked_supported(model) is None
    g, b = 3, 5
    p = _stacked_params(model, g)
    x = torch.randn(g, b, *shape, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (g, b), generator=torch.Generator().manual_seed(2))
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    logits = stacked_forward(model, leaves, x)
    assert logits.shape == (g, b, 10)
    losses = torch.stack([F.cross_entropy(logits[i], y[i]) for i in range(g)])
    grads = torch.autograd.grad(losses.sum(), list(leaves.values()))
    for i in range(g):
        own = {k: v[i].clone().requires_grad_() for k, v in p.items()}
        ref = functional_call(model, own, (x[i],))
        assert torch.allclose(logits[i], ref, atol=1e-5, rtol=1e-5), (name, i)
        ref_grads = torch.autograd.grad(F.cross_entropy(ref, y[i]), list(own.values()))
        for k, gs, gr in zip(own, grads, ref_grads):
            assert torch.allclose(gs[i], gr, atol=1e-5, rtol=1e-4), (name, i, k)


def test_stacked_forward_handles_every_layer_it_claims():
    """Grouped and strided/dilated convolutions without bias, average and adaptive pooling,
    Tanh/Sigmoid/GELU/Identity, a Linear without bias, nested Sequentials, 1-D and 2-D, and
    the models' input resizing (Resize: bilinear and nearest, VGG-11's PathMNIST upsampling)."""
    from torch import nn
    from torch.func import functional_call

    from fedforget.models import Classifier, Resize

    body2d = nn.Sequential(
        Resize(11), nn.Conv2d(2, 6, 3, padding=1, bias=False), nn.Tanh(), Resize(9, mode="nearest"),
        nn.Sequential(nn.Conv2d(6, 6, 3, stride=2, dilation=2, padding=2, groups=3), nn.GELU()),
        nn.AvgPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Identity(),
        nn.Linear(6, 5, bias=False), nn.Sigmoid(),
    )  # fmt: skip
    body1d = nn.Sequential(
        nn.Conv1d(1, 4, 5, stride=2, padding=2), nn.ReLU(), nn.MaxPool1d(2, ceil_mode=True),
        nn.Conv1d(4, 4, 3, groups=4), nn.AvgPool1d(2), nn.AdaptiveAvgPool1d(3), nn.Flatten(),
    )  # fmt: skip
    for model, shape in ((Classifier(body2d, 5, 3), (2, 9, 9)), (Classifier(body1d, 12, 3), (1, 29))):
        assert stacked_supported(model) is None
        g = 4
        p = _stacked_params(model, g, seed=5)
        x = torch.randn(g, 3, *shape, generator=torch.Generator().manual_seed(6))
        got = stacked_forward(model, p, x)
        for i in range(g):
            want = functional_call(model, {k: v[i] for k, v in p.items()}, (x[i],))
            assert torch.allclose(got[i], want, atol=1e-6, rtol=1e-5), (shape, i)


def test_stacked_supported_names_what_it_cannot_run():
    from torch import nn

    from fedforget.models import Classifier

    assert stacked_supported(build_model("resnet8", (1, 8, 8), 10, {"norm": "none"})) is None
    assert stacked_supported(build_model("slvit", (1, 8, 8), 10, SLVIT_TINY)) is None
    assert stacked_supported(build_model("vit", (1, 8, 8), 10, VIT_TINY)) is None
    assert stacked_supported(Classifier(nn.Sequential(nn.Flatten(), nn.BatchNorm1d(4)), 4, 2)) == "BatchNorm1d"
    assert stacked_supported(Classifier(nn.Sequential(nn.Flatten(), nn.Dropout(0.1)), 4, 2)) == "Dropout(p > 0)"
    assert stacked_supported(Classifier(nn.Sequential(nn.Flatten(0)), 4, 2)) == "Flatten"
    assert stacked_supported(Classifier(nn.Sequential(nn.Conv1d(1, 2, 3, padding_mode="circular")), 4, 2)) == "Conv1d"


SLVIT_TINY = {"patch_size": 4, "dim": 16, "depth": 1, "heads": 2, "dim_head": 8, "mlp_dim": 16}
VIT_TINY = {"image_size": 8, "patch_size": 4, "layers": 1, "heads": 2, "hidden_dim": 16, "mlp_dim": 32}


def test_vmap_fallback_equals_sequential(make_run_config, run_engines, assert_same_metrics):
    """A buffer-free model stacked_forward cannot run (a small torchvision ViT) goes through vmap."""
    rc = make_run_config(dataset="digits", model="vit", model_options=VIT_TINY, rounds=1,
                         batch_size=16, sample_rate=0.5, optimizer={"lr": 0.05, "momentum": 0.9},
                         partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=20, seed=0))  # fmt: skip
    out = run_engines(rc)
    assert_same_metrics(out["sequential"][1], out["vectorized"][1])


@pytest.mark.parametrize("batched", [False, True])
def test_evaluate_stacked_equals_evaluate(batched):
    from fedforget.metrics import evaluate

    torch.manual_seed(0)  # a seeded init, not the test order's (an argmax near a tie would flip)
    for name, shape in (("cnn1d", (1, 40)), ("mlp", (6,)), ("resnet8", (1, 8, 8))):
        model = build_model(name, shape, 4, {"norm": "none"} if name == "resnet8" else {})
        p = _stacked_params(model, 3)
        sets = [{k: v[i] for k, v in p.items()} for i in range(3)]
        x = torch.randn(50, *shape, generator=torch.Generator().manual_seed(3))
        y = torch.randint(0, 4, (50,), generator=torch.Generator().manual_seed(4))
        got = evaluate_stacked(model, sets, x, y, batch_size=16, batched=batched)
        want = []
        for s in sets:
            model.load_state_dict(s)
            want.append(evaluate(model, x, y)[0])
        assert got == pytest.approx(want, abs=1e-9), name


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


@pytest.mark.cpu_paths  # a CPU's client-by-client steps on worker threads
def test_client_threads_equal_sequential_and_repeat_exactly(make_run_config, run_engines, assert_same_metrics, monkeypatch):
    """With 2 threads on a CPU, a Conv2d model's wide steps run client by client on 2 worker
    threads of one intra-op thread each: the same metrics as one client after another within
    1e-5, bit-identical from one run to the next, and the process keeps its thread count."""
    import fedforget.vectorized as vz

    maps = []

    class CountingPool(vz.ThreadPoolExecutor):
        def map(self, fn, *iterables, **kw):
            maps.append(fn)
            return super().map(fn, *iterables, **kw)

    monkeypatch.setattr(vz, "ThreadPoolExecutor", CountingPool)
    monkeypatch.setattr(vz, "_POOLS", {})  # the process's pools are kept across rounds
    before = torch.get_num_threads()
    try:
        rc = make_run_config(dataset="digits", model="cnn2d", device="cpu", threads=2, rounds=2, local_epochs=2,
                             batch_size=32, sample_rate=0.5, optimizer={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4},
                             partition=PartitionSpec("dirichlet", clients=8, alpha=0.3, seed=0))  # fmt: skip
        out = run_engines(rc)
        assert maps, "the worker threads were not used"
        (_, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
        assert_same_metrics(rows_s, rows_v)
        again = Simulation(replace(rc, train=replace(rc.train, client_engine="vectorized")))
        _, rows_again, _ = again.run(progress=False)
        assert_same_metrics(rows_v, rows_again, tol=0.0)
        assert all(torch.equal(v, again.global_params[k]) for k, v in vec.global_params.items())
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_step_graph_stack_keeps_its_tensors_across_rounds_and_grows() -> None:
    """The tensors CUDA graphs update in place stay at one address while the groups fit
    (a graph replays on those addresses), start every round from the global weights with
    zero momentum and loss, and are reallocated, graphs dropped, for a larger group."""
    from fedforget.cudagraph import StepGraphs

    g = StepGraphs()
    glob = {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(2), "mean": torch.full((2,), 0.5)}
    p, b, loss, st = g.stack(glob, ["w", "b"], 3, momentum=True, buffers=["mean"])
    assert p["w"].shape == (3, 2, 3) and torch.equal(p["w"][2], glob["w"]) and b["w"].abs().sum() == 0
    assert st["mean"].shape == (3, 2) and torch.equal(st["mean"][1], glob["mean"])
    p["w"].add_(1.0)
    b["b"].fill_(5.0)
    loss.fill_(2.0)
    st["mean"].fill_(7.0)  # the captured steps' BatchNorm updates
    g.graphs["k"], g.seen = ("graph", None), {"k"}
    p2, b2, loss2, st2 = g.stack(glob, ["w", "b"], 2, momentum=True, buffers=["mean"])
    assert p2["w"].data_ptr() == p["w"].data_ptr() and torch.equal(p2["w"][1], glob["w"])
    assert st2["mean"].data_ptr() == st["mean"].data_ptr() and torch.equal(st2["mean"][0], glob["mean"])
    assert b2["b"].abs().sum() == 0 and loss2.abs().sum() == 0 and "k" in g.graphs
    p3, _, _, st3 = g.stack(glob, ["w", "b"], 4, momentum=False)
    assert p3["w"].shape[0] == 4 and p3["w"].data_ptr() != p["w"].data_ptr() and not g.graphs and not st3


def test_the_tape_replays_what_a_cuda_graph_would(monkeypatch):
    """The CPU stand-in of a CUDA graph (cudagraph.Tape): a replay runs the captured operators
    on the captured tensors, so a step that copies its input into the static tensor replays
    right, and one that reads a tensor made after capture (a graph's classic bug) replays the
    captured value, visibly; a host read or a tensor made from host values cannot be captured."""
    from fedforget.cudagraph import StepGraphs, Tape, graphs_enabled

    monkeypatch.setenv("FEDFORGET_CUDA_GRAPHS", "tape")
    assert graphs_enabled(torch.device("cpu"))
    monkeypatch.setenv("FEDFORGET_CUDA_GRAPHS", "1")
    assert not graphs_enabled(torch.device("cpu"))
    w = torch.zeros(3)
    g = StepGraphs()

    def step(idx):
        w.add_(idx.float().mul(2).sum(0))

    for i in range(4):  # eager, captured (the tape's recording runs the step once), replayed twice
        g.run("k", torch.full((2, 3), i), step)
    assert g.captures == 1 and g.replays == 2 and torch.equal(w, torch.full((3,), 4.0 * (0 + 1 + 2 + 3)))

    fresh = {"v": torch.ones(3)}
    tape = Tape()
    with tape:
        w.add_(fresh["v"])
    fresh["v"] = torch.full((3,), 10.0)  # a new tensor: the replay still reads the captured one
    before = w.clone()
    tape.replay()
    assert torch.equal(w, before + 1)
    from fedforget.utils import host_to_device

    host_reads = (lambda: w.sum().item(), lambda: torch.tensor([1.0]) + w, lambda: w.nonzero(), lambda: w.tolist(),
                  lambda: host_to_device(torch.ones(3), w.device),
                  lambda: torch.randperm(3, generator=torch.Generator()) + w,
                  # shapes or checks a GPU reads from values (CUDA syncs the dispatcher does not show)
                  lambda: w[w > 0], lambda: w.clone().index_put_((w > 0,), w), lambda: torch.bincount(w.long()),
                  lambda: torch.repeat_interleave(w, w.long()), lambda: torch.linalg.eigh(torch.eye(3) * w),
                  lambda: torch.linalg.svd(torch.eye(3) * w), lambda: torch.linalg.solve(torch.eye(3) + w, w))  # fmt: skip
    for host in host_reads:
        with pytest.raises(RuntimeError, match="not capturable"), Tape():
            host()
    idx, reps = torch.tensor([0, 2]), torch.tensor([1, 2, 1])
    with Tape():  # their capturable forms pass: integer indices, output_size given
        w[idx], w.clone().index_put_((idx,), w[idx]), torch.repeat_interleave(w, reps, output_size=4)
    assert w.tolist() and torch.equal(host_to_device(w, w.device), w)  # after the tape: as ever


@pytest.mark.parametrize(
    "model,device",
    [("resnet8", "cpu"), ("mlp", "cpu"), ("cnn2d", "cuda"), ("resnet8", "cuda"), ("slvit", "cuda"),
     ("resnet18_imagenet", "cuda")],
)  # fmt: skip
def test_cuda_graphs_replay_the_eager_steps_bit_for_bit(make_run_config, monkeypatch, model, device) -> None:
    """On a GPU the batched steps are captured and replayed (fedforget.cudagraph): the same
    kernels on the same shapes, so the same bits as running each step eagerly, over rounds
    whose sampled groups differ in size; with BatchNorm (resnet8) each step's runs of clients
    with batches of one size are captured apart, and the running statistics updated in place.
    On a CPU the same through the tape (FEDFORGET_CUDA_GRAPHS=tape), at batch 8: narrow steps,
    which a CPU batches (wider ones of a convolutional model it runs client by client); a
    convolutional model without BatchNorm goes through the tape in tests/test_inputs.py and
    tests/test_dropout.py."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU (benchmarks/gpu.sh runs this where one is)")
    small = model == "resnet8" and device == "cpu"  # ResNet-8 at width 8 on a CPU (64: 10 s a round)
    options = {"width": 8} if small else SLVIT_TINY if model == "slvit" else None  # (the two stacked since 2026-12-02)
    rc = make_run_config(dataset="digits", model=model, model_options=options,
                         rounds=4, sample_rate=0.5, device=device,
                         client_engine="vectorized", max_parallel_clients=2, batch_size=32 if device == "cuda" else 8,
                         drop_last=small or model == "resnet18_imagenet",  # (a tail of 1 row: BatchNorm's 1x1 stage)
                         optimizer={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4},
                         partition=PartitionSpec("dirichlet", clients=8, alpha=0.3, min_size=5, seed=0))  # fmt: skip
    runs = {}
    for flag in ("0", "1" if device == "cuda" else "tape"):
        monkeypatch.setenv("FEDFORGET_CUDA_GRAPHS", flag)
        sim = Simulation(rc)
        status, rows, msg = sim.run(progress=False)
        assert status == "completed", msg
        runs[flag] = (sim, [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in rows])
    (eager, rows_e), (graphed, rows_g) = runs.values()
    assert eager.trainer.step_graphs is None and graphed.trainer.step_graphs.replays > 0
    assert rows_e == rows_g
    for k, v in eager.global_params.items():
        assert torch.equal(v, graphed.global_params[k]), k
    assert model != "resnet8" or any("running_var" in k for k in eager.global_params)


def test_a_decaying_lr_keeps_only_the_rounds_graphs(make_run_config, monkeypatch) -> None:
    """Graphs are keyed by the optimizer's constants: with an lr that decays every round,
    each round's graphs replace the last round's (kept, they would pile up, none replayable
    again), only shapes met at least 3 times in a round are captured, and the run is the
    eager steps' bit for bit (CPU, through the tape; the lr a number, as a CPU keeps it)."""
    import fedforget.vectorized as vz

    monkeypatch.setattr(vz, "lr_on_device", lambda device: False)
    rc = make_run_config(dataset="digits", model="mlp", rounds=4, sample_rate=0.5, client_engine="vectorized",
                         max_parallel_clients=2, batch_size=8, lr_decay=0.5, optimizer={"lr": 0.1, "momentum": 0.9},
                         partition=PartitionSpec("dirichlet", clients=8, alpha=0.3, min_size=5, seed=0))  # fmt: skip
    runs = {}
    for flag in ("0", "tape"):
        monkeypatch.setenv("FEDFORGET_CUDA_GRAPHS", flag)
        sim = Simulation(rc, device=torch.device("cpu"))
        status, rows, msg = sim.run(progress=False)
        assert status == "completed", msg
        runs[flag] = (sim, [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in rows])
    (eager, rows_e), (graphed, rows_g) = runs.values()
    g = graphed.trainer.step_graphs
    assert g.replays > 0 and g.graphs and rows_e == rows_g
    last_lr = 0.1 * 0.5**3
    assert {k[-5] for k in g.graphs} == {last_lr}  # the last round's lr only
    for k, v in eager.global_params.items():
        assert torch.equal(v, graphed.global_params[k]), k


def test_lr_in_a_tensor_updates_as_a_number():
    """lr_on_device's update, p.addcmul_(d, lr, value=-1) with lr a tensor, is the same bits
    as p.add_(d, alpha=-lr) with lr a number, on the test device (gpu.sh runs it on CUDA):
    the lengths of every vectorized tail, a decayed lr and one whose float32 rounds."""
    gen = torch.Generator().manual_seed(0)
    for n in (1, 3, 7, 8, 15, 16, 17, 31, 33, 64, 100, 1000, 4097, 100003):
        for lr in (0.1, 0.05, 0.025 * 0.99**7, 1e-3):
            p = (torch.randn(n, generator=gen) * 3).to(TEST_DEVICE)
            d = (torch.randn(n, generator=gen) * 10).to(TEST_DEVICE)
            number, tensor = p.clone(), p.clone()
            torch._foreach_add_([number], [d], alpha=-lr)
            tensor.addcmul_(d, torch.full((), lr, device=TEST_DEVICE), value=-1)
            assert torch.equal(number, tensor), (n, lr, (number != tensor).sum().item())


def test_an_lr_on_the_device_keeps_the_graphs_across_rounds(make_run_config, monkeypatch) -> None:
    """On a GPU SGD's lr is a tensor (``lr_on_device``; forced here on a CPU, through the
    tape): with a decaying lr every step shape is captured once and replayed in every later
    round and group (as a number, each round captures its shapes anew), and the run is
    the eager run's bits and the number's."""
    import fedforget.vectorized as vz

    rc = make_run_config(dataset="digits", model="mlp", rounds=4, sample_rate=1.0, client_engine="vectorized",
                         max_parallel_clients=3, batch_size=8, lr_decay=0.5, optimizer={"lr": 0.1, "momentum": 0.9},
                         partition=PartitionSpec("dirichlet", clients=6, alpha=0.3, min_size=5, seed=0))  # fmt: skip

    def run(flag, on_device):
        monkeypatch.setenv("FEDFORGET_CUDA_GRAPHS", flag)
        monkeypatch.setattr(vz, "lr_on_device", lambda device: on_device)
        sim = Simulation(rc, device=torch.device("cpu"))
        status, rows, msg = sim.run(progress=False)
        assert status == "completed", msg
        return sim, [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in rows]

    (graphed, rows_g), (number, rows_n) = run("tape", True), run("tape", False)
    g = graphed.trainer.step_graphs
    assert g.replays > 0 and g.captures == len(g.graphs) > 0  # each shape captured once: 4 rounds x 2 groups
    assert {k[-5] for k in g.graphs} == {None}  # the lr is no key
    assert number.trainer.step_graphs.captures > len(number.trainer.step_graphs.graphs)  # recaptured
    (eager, rows_e) = run("0", True)
    assert rows_e == rows_g == rows_n
    for k, v in eager.global_params.items():
        assert torch.equal(v, graphed.global_params[k]) and torch.equal(v, number.global_params[k]), k


def test_client_replicas_are_kept_across_rounds_and_remade_when_the_model_changes():
    """The client-by-client steps' model copies live across rounds (copying the model every
    round cost about a tenth of a digits round) and are made again when the model's
    parameters, modules or hooks change; each copy differentiates every parameter."""
    from fedforget.models import build_model
    from fedforget.vectorized import _replicas

    model = build_model("cnn2d", (1, 8, 8), 10)
    model.head.weight.requires_grad_(False)  # frozen or not, the step differentiates it
    first = _replicas(model, 2)
    assert _replicas(model, 2) == first and _replicas(model, 1) == first[:1]
    assert all(q.requires_grad for r in first for q in r.parameters()) and all(r.training for r in first)
    assert first[0] is not model and first[0] is not first[1]
    hook = model.register_forward_hook(lambda *_: None)
    hooked = _replicas(model, 2)
    assert hooked[0] is not first[0] and len(hooked[0]._forward_hooks) == 1
    hook.remove()
    plain = _replicas(model, 2)
    assert plain[0] is not hooked[0] and not plain[0]._forward_hooks
    model.body[2] = nn.Conv2d(32, 64, 3, padding=2)  # same weights' shapes, another module
    assert _replicas(model, 2)[0] is not plain[0]
    assert len(_replicas(model, 3)) == 3


def test_per_task_heads_stack_unless_the_method_has_live_terms():
    """A model with per-task heads trains batched (its active head in the stack, replayed rows
    routed to their own task's head; equality with the sequential trainer:
    tests/methods/test_fedprotip.py, test_der.py), except under a method whose live terms are
    written for one head: refused, naming the method."""
    model = build_model("mlp", (4,), 6, {})
    model.use_task_heads([[0, 1], [2, 3], [4, 5]])
    assert stacked_supported(model) is None
    for ok in ("fedavg", "fedprotip", "fedprox", "fot", "der", "agem"):
        assert why_not_vectorized(METHODS.get(ok), model, "sgd") is None, ok
    assert "per-task heads with method 'fedsam''s terms" in why_not_vectorized(METHODS.get("fedsam"), model, "sgd")


def test_join_run_grads_holds_what_a_run_holds():
    """A step's runs of clients (BatchNorm: batches of one size each) give one parameter's
    gradients joined in the stack's order: None where every run's map holds it (SCR's
    classifier), a Held naming the clients of a run that holds it, or of a run's own Held,
    the gradients where none does. (A GPU's paths on a CPU first met the all-None case:
    SCR on ResNet-8, every step stacked.)"""
    from fedforget.methods.base import Held
    from fedforget.vectorized import join_run_grads

    a, b = torch.ones(2, 3), torch.full((1, 3), 2.0)
    assert join_run_grads([None, None], [2, 1]) is None
    assert torch.equal(join_run_grads([a, b], [2, 1]), torch.cat([a, b]))
    mixed = join_run_grads([None, b], [2, 1])
    assert isinstance(mixed, Held) and mixed.held.tolist() == [True, True, False]
    assert torch.equal(mixed.grad, torch.cat([torch.zeros(2, 3), b]))
    inner = join_run_grads([Held(a, torch.tensor([False, True])), b], [2, 1])
    assert inner.held.tolist() == [False, True, False] and torch.equal(inner.grad, torch.cat([a, b]))
