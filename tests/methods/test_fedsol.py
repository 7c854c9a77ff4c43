"""FedSOL: the perturbation (Eq. 5, 7, 8), its partial and fixed variants, the step at the
perturbed weights with a bit-exact restore, rho = 0 and the first step are FedAvg, the
direct projection (Eq. 3) and loss (Eq. 2) variants, combined mode with a base method,
config validation, short runs."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from fedforget.config import TrainSpec
from fedforget.engine import Simulation
from fedforget.methods import ClientContext, RunInfo, make_params
from fedforget.methods.base import total_loss
from fedforget.methods.fedsol import FedSOL
from fedforget.models import build_model
from fedforget.parse import parse_config
from fedforget.utils import FedForgetError

CPU = torch.device("cpu")


# not `setup`: pytest 7 calls a module's setup() with the module (nose style) before its tests
def client_setup(params, seed=0, shift=0.3):
    """A 4-5-3 MLP, a batch of 8, the global model w_g and a local model w = w_g + noise
    (as after some local steps), with FedSOL's client_begin done."""
    torch.manual_seed(seed)
    model = build_model("mlp", (4,), 3, {"hidden": [5]})
    global_params = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(shift * torch.randn_like(p))
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    method = FedSOL(make_params("fedsol", params), RunInfo(CPU, 3, 0, 4, TrainSpec()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = ClientContext(0, 1, model, opt, global_params, {}, {}, 8, 0.1, 1, 8)
    method.client_begin(ctx)
    return method, model, ctx, x, y


def kl_grad(model, global_params, x, t=3.0):
    """grad of batch-mean KL(softmax(z_g/T) || softmax(z/T)) by plain autograd on a copy."""
    m, g = copy.deepcopy(model), copy.deepcopy(model)
    g.load_state_dict(global_params)
    with torch.no_grad():
        p_g = F.softmax(g(x) / t, dim=1)
    loss = F.kl_div(F.log_softmax(m(x) / t, dim=1), p_g, reduction="batchmean")
    loss.backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}, float(loss.detach())


def ce_grad(model, x, y, shift=None):
    """grad of CE at w (+ shift, a dict by parameter name), on a copy."""
    m = copy.deepcopy(model)
    if shift:
        with torch.no_grad():
            for n, p in m.named_parameters():
                if n in shift:
                    p.add_(shift[n])
    F.cross_entropy(m(x), y).backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def record_eps(method):
    """The perturbations of the method's steps, each one client's (a stack of one)."""
    seen, orig = [], method.perturbation

    def record(*args):
        out = orig(*args)
        seen.append(None if out is None else [e[0] for e in out])
        return out

    method.perturbation = record
    return seen


def names(model, part):
    return [n for n, _ in model.named_parameters() if part == "all" or n.startswith("head.") == (part == "head")]


def flat_norm(ts):
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in ts))


@pytest.mark.parametrize("perturb", ["all", "body", "head"])
def test_fixed_eps_has_norm_rho_and_is_parallel_to_the_kl_gradient(perturb):
    method, model, ctx, x, y = client_setup({"rho": 0.7, "adaptive": False, "perturb": perturb})
    seen = record_eps(method)
    method.client_step(ctx, x, y)
    (eps,) = seen
    g, _ = kl_grad(model, ctx.global_params, x)
    sel = names(model, perturb)
    g_sel = [g[n] for n in sel]
    assert flat_norm(eps) == pytest.approx(0.7, rel=1e-5)
    gn = flat_norm(g_sel)
    for e, gi in zip(eps, g_sel):  # eps = rho g_p / ||g_p||, element by element
        torch.testing.assert_close(e.double(), 0.7 * gi.double() / gn, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("norm", ["layer", "column"])
def test_adaptive_eps_is_eq8_with_eq7_lambda(norm):
    method, model, ctx, x, y = client_setup({"rho": 1.3, "perturb": "all", "lambda_norm": norm})
    seen = record_eps(method)
    method.client_step(ctx, x, y)
    (eps,) = seen
    g, _ = kl_grad(model, ctx.global_params, x)
    gn = flat_norm(g.values())
    for e, (n, p) in zip(eps, model.named_parameters()):
        d = (p.detach() - ctx.global_params[n]).abs().double()
        if norm == "layer":  # Eq. 7: one L2 norm per tensor
            lam = d / d.norm()
        else:  # per dim-0 slice, for a 2-D weight: each column divided by its own norm
            lam = d / d.norm(dim=0, keepdim=True)
        torch.testing.assert_close(e.double(), 1.3 * lam * g[n].double() / gn, rtol=1e-4, atol=1e-8)
        if norm == "layer":
            assert float(lam.norm()) == pytest.approx(1.0)


def test_lambda_hand_computed():
    method, *_ = client_setup({"lambda_norm": "layer"})
    w, wg = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1.0, 5.0], [7.0, 4.0]])
    # |w - w_g| = [[0, 3], [4, 0]]: layer norm 5 -> [[0, .6], [.8, 0]]
    (lam,) = method.lambdas([w[None]], [wg])  # one client: a stack of one
    torch.testing.assert_close(lam[0], torch.tensor([[0.0, 0.6], [0.8, 0.0]]))
    # a stack of two: each client's own norm (the second: |w - w_g| = [[0, 0], [0, 2]] -> [[0, 0], [0, 1]])
    (lam,) = method.lambdas([torch.stack([w, wg + torch.tensor([[0.0, 0.0], [0.0, 2.0]])])], [wg])
    torch.testing.assert_close(lam, torch.tensor([[[0.0, 0.6], [0.8, 0.0]], [[0.0, 0.0], [0.0, 1.0]]]))
    method, *_ = client_setup({"lambda_norm": "column"})
    # per column (dim 0): column 0 = [0, 4] -> [0, 1]; column 1 = [3, 0] -> [1, 0]
    (lam,) = method.lambdas([torch.stack([w, w])], [wg])
    torch.testing.assert_close(lam, torch.tensor([[[0.0, 1.0], [1.0, 0.0]]] * 2))
    (lam,) = method.lambdas([wg[None]], [wg])  # w = w_g: Lambda = 0, no 0/0
    assert torch.equal(lam, torch.zeros(1, 2, 2))


@pytest.mark.parametrize("perturb", ["all", "body", "head"])
def test_step_uses_ce_gradient_at_perturbed_weights_and_restores_them(perturb):
    method, model, ctx, x, y = client_setup({"rho": 1.0, "perturb": perturb})
    w0 = {k: v.clone() for k, v in model.state_dict().items()}
    seen = record_eps(method)
    loss = method.client_step(ctx, x, y)
    (eps,) = seen
    sel = names(model, perturb)
    shift = dict(zip(sel, eps))
    expected = ce_grad(model, x, y, shift)
    plain = ce_grad(model, x, y)
    for k, v in model.state_dict().items():
        assert torch.equal(v, w0[k]), k  # restored bit-exactly
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-7)
    assert any(not torch.allclose(expected[n], plain[n]) for n in sel)  # eps mattered
    assert float(loss) == pytest.approx(float(F.cross_entropy(model(x), y).detach()), rel=1e-6)  # loss at w


def test_batchnorm_statistics_are_updated_by_the_first_pass_only():
    """With BatchNorm the step's gradient is CE's at w + eps (batch statistics), and the
    running statistics are those one forward at w leaves (the second pass's are undone)."""
    torch.manual_seed(0)
    model = build_model("resnet8", (3, 8, 8), 3, {"norm": "batch"})
    global_params = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 3, (8,))
    method = FedSOL(make_params("fedsol", {"rho": 1.0, "perturb": "all"}), RunInfo(CPU, 3, 0, 4, TrainSpec()))
    ctx = ClientContext(0, 1, model, torch.optim.SGD(model.parameters(), lr=0.1), global_params, {}, {}, 8, 0.1, 1, 8)
    method.client_begin(ctx)
    once = copy.deepcopy(model)
    once(x)  # one train-mode forward at w
    seen = record_eps(method)
    method.client_step(ctx, x, y)
    (eps,) = seen
    assert eps is not None
    expected = ce_grad(model, x, y, dict(zip(names(model, "all"), eps)))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-4, atol=1e-6)
    bufs = dict(once.named_buffers())
    assert any("running_mean" in n for n in bufs)
    for n, b in model.named_buffers():
        assert torch.equal(b, bufs[n]), n


def test_head_only_leaves_the_body_unperturbed():
    method, model, ctx, x, y = client_setup({"rho": 2.0, "perturb": "head"})
    seen = []
    orig_add = torch._foreach_add_

    def spy(tensors, other, *a, **k):  # what is added to which parameter
        if isinstance(other, list) and len(other) == len(tensors):
            seen.append([id(t) for t in tensors])
        return orig_add(tensors, other, *a, **k)

    torch._foreach_add_ = spy
    try:
        method.client_step(ctx, x, y)
    finally:
        torch._foreach_add_ = orig_add
    head_ids = {id(p) for p in model.head.parameters()}
    assert seen and all(set(ids) == head_ids for ids in seen)
    # and the body gradient is grad CE with only the head shifted
    method2, model2, ctx2, *_ = client_setup({"rho": 2.0, "perturb": "head"})
    eps_seen = record_eps(method2)
    method2.client_step(ctx2, x, y)
    shift = dict(zip(names(model2, "head"), eps_seen[0]))
    expected = ce_grad(model2, x, y, shift)
    for n, p in model2.body.named_parameters():
        torch.testing.assert_close(p.grad, expected[f"body.{n}"], rtol=1e-5, atol=1e-7)


def test_first_local_step_is_fedavg_step():
    # at the first step w = w_g: Lambda = 0 and g_p = 0 (KL of identical outputs) -> eps = 0,
    # decided on the device: the second pass runs at w + 0 and gives CE's gradient at w exactly
    for params in ({"rho": 2.0, "perturb": "all"}, {"rho": 2.0, "perturb": "all", "adaptive": False}):
        method, model, ctx, x, y = client_setup(params, shift=0.0)
        seen = record_eps(method)
        method.client_step(ctx, x, y)
        (eps,) = seen
        assert all(torch.count_nonzero(e) == 0 for e in eps)
        plain = ce_grad(model, x, y)
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, plain[n]), n


def test_kl_proximal_gradient_and_loss_match_autograd():
    method, model, ctx, x, y = client_setup({"perturb": "all"})
    features, logits = model.forward_with_features(x)
    g_p, value = method.proximal_grad(ctx, x, y, features, logits)
    ref, ref_value = kl_grad(model, ctx.global_params, x)
    assert value == pytest.approx(ref_value, rel=1e-5)
    for gp, (n, _) in zip(g_p, model.named_parameters()):
        torch.testing.assert_close(gp, ref[n], rtol=1e-4, atol=1e-8)


def test_projection_removes_the_conflicting_component_only():
    method, model, ctx, x, y = client_setup({"update": "project", "perturb": "all"})
    g_p, _ = kl_grad(model, ctx.global_params, x)
    g_l = ce_grad(model, x, y)
    gp = torch.cat([g_p[n].flatten() for n, _ in model.named_parameters()]).double()
    gl = torch.cat([g_l[n].flatten() for n, _ in model.named_parameters()]).double()
    method.client_step(ctx, x, y)
    gu = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    if gl @ gp < 0:  # Eq. 3
        expected = gl - (gl @ gp) / (gp @ gp) * gp
        assert abs(float(gu @ gp)) < 1e-6 * float(gu.norm() * gp.norm())
    else:
        expected = gl
    torch.testing.assert_close(gu, expected, rtol=1e-4, atol=1e-7)
    # find a seed with conflict and one without, so both branches are exercised
    conflicts = set()
    for seed in range(30):
        m, mod, c, xx, yy = client_setup({"update": "project", "perturb": "all"}, seed=seed)
        m.client_step(c, xx, yy)
        conflicts.add(m.scratch(c).log.means()["conflict_rate"] > 0)
    assert conflicts == {True, False}


def test_loss_variant_is_ce_plus_beta_kl_and_l2_is_fedprox():
    method, model, ctx, x, y = client_setup({"update": "loss", "beta": 0.5, "proximal": "kl", "perturb": "head"})
    method.client_step(ctx, x, y)
    g_p, _ = kl_grad(model, ctx.global_params, x)
    g_l = ce_grad(model, x, y)
    for n, p in model.named_parameters():  # all parameters, though perturb says head
        torch.testing.assert_close(p.grad, g_l[n] + 0.5 * g_p[n], rtol=1e-4, atol=1e-7)
    method, model, ctx, x, y = client_setup({"update": "loss", "beta": 0.5, "proximal": "l2"})
    method.client_step(ctx, x, y)
    g_l = ce_grad(model, x, y)
    for n, p in model.named_parameters():  # FedProx with mu = 0.5: + mu (w - w_g)
        torch.testing.assert_close(p.grad, g_l[n] + 0.5 * (p.detach() - ctx.global_params[n]))


def test_l2_proximal_direction_is_w_minus_wg():
    method, model, ctx, x, y = client_setup({"proximal": "l2", "adaptive": False, "rho": 0.4, "perturb": "all"})
    seen = record_eps(method)
    method.client_step(ctx, x, y)
    d = [p.detach() - ctx.global_params[n] for n, p in model.named_parameters()]
    dn = flat_norm(d)
    for e, di in zip(seen[0], d):
        torch.testing.assert_close(e, 0.4 * di / dn)


def run(make_run_config, method, params, **kw):
    train = {"rounds": 2, "local_epochs": 2, "sample_rate": 0.5, "optimizer": {"lr": 0.1, "momentum": 0.9}}
    rc = make_run_config(method=method, params=params, **{**train, **kw})
    sim = Simulation(rc, device=CPU)
    status, rows, msg = sim.run(progress=False)
    assert status == "completed", msg
    return sim, rows


@pytest.mark.parametrize(
    "perturb,engine,data",
    [("all", "sequential", {}), ("head", "sequential", {}), ("all", "vectorized", {}),
     ("head", "vectorized", {"dataset": "digits", "model": "cnn2d", "batch_size": 20})],
    ids=["all-sequential", "head-sequential", "all-stacked", "head-stacked-conv"],
)  # fmt: skip
def test_rho_zero_is_fedavg_bit_exact(make_run_config, perturb, engine, data):
    """On either trainer (the stacked one: an MLP's batched steps; a Conv2d model's wide
    steps client by client in replicas on a CPU, its tails batched), against FedAvg on it."""
    kw = {"client_engine": engine, **data}
    ref, ref_rows = run(make_run_config, "fedavg", {}, **kw)
    sim, rows = run(make_run_config, "fedsol", {"rho": 0.0, "perturb": perturb}, **kw)
    assert sim.engine_info["client_engine"] == engine
    for k, v in ref.global_params.items():
        assert torch.equal(sim.global_params[k], v), k
    for a, b in zip(rows, ref_rows):
        assert a.get("sampled_clients_local_train_loss_mean") == b.get("sampled_clients_local_train_loss_mean")
    assert rows[-1]["fedsol_eps_norm"] == 0.0
    assert math.isfinite(rows[-1]["fedsol_prox_loss"]) and rows[-1]["fedsol_prox_loss"] > 0


@pytest.mark.parametrize("base", ["fedprox", "feddyn", "scaffold", "moon"])
def test_combined_base_direction_is_the_base_term_gradient(make_run_config, base):
    # after one real round the base state is non-trivial; then the proximal gradient FedSOL
    # perturbs with must equal the gradient the base method adds to CE
    sim, _ = run(make_run_config, "fedsol", {"base": base, "proximal": "base", "perturb": "all", "rho": 1.0},
                 rounds=1, sample_rate=1.0)  # fmt: skip
    method = sim.method
    model = sim.model
    sim.trainer.load_params(model, sim.global_params)
    cid = 0
    state = sim.client_state[cid]
    ctx = ClientContext(cid, 2, model, torch.optim.SGD(model.parameters(), lr=0.1), sim.global_params,
                        method.server_broadcast(sim.server), state, 10, 0.1, 1, 16)  # fmt: skip
    with torch.no_grad():  # move off w_g so every term is non-zero
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    method.client_begin(ctx)
    x, y = sim.clients.slice(cid)
    x, y = x[:16], y[:16]
    features, logits = model.forward_with_features(x)
    g_p, _ = method.proximal_grad(ctx, x, y, features, logits)
    # reference: (CE + base extra, base transform) minus CE alone, through the base itself
    model.zero_grad(set_to_none=True)
    f2, l2 = model.forward_with_features(x)
    total_loss(method.base.client_loss(ctx, x, y, f2, l2)).backward()  # CE first, then its term
    method.base.client_grad(ctx)
    full = [p.grad.clone() for p in model.parameters()]
    ce = ce_grad(model, x, y)
    diff = [f - ce[n] for f, (n, _) in zip(full, model.named_parameters())]
    assert flat_norm(diff) > 1e-4  # the base term is active
    for a, b in zip(g_p, diff):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "params",
    [{"base": "scaffold", "proximal": "base", "perturb": "all"},
     {"base": "feddyn", "proximal": "base", "perturb": "all", "base_loss": True},
     {"base": "fednova", "perturb": "all"},
     {"base": "moon", "proximal": "base", "perturb": "all", "base_params": {"mu": 0.1, "tau": 1.0}},
     {"base": "fedprox", "proximal": "base", "perturb": "all", "base_params": {"mu": 0.5}}],
)  # fmt: skip
def test_combined_runs_keep_the_base_server(make_run_config, params):
    sim, rows = run(make_run_config, "fedsol", params)
    assert math.isfinite(rows[-1]["global_model_test_acc"])
    base = params["base"]
    if base == "scaffold":
        assert rows[-1]["fedsol_scaffold_c_norm"] > 0  # SCAFFOLD's c moved (a base's columns: <plug-in>_<base>_<key>)
    if base == "feddyn":
        assert rows[-1]["fedsol_feddyn_h_norm"] > 0
    if base == "fednova":
        assert rows[-1]["fedsol_fednova_tau_eff"] > 0
    if base == "moon":
        assert all("prev" in s for s in sim.client_state.values() if s)


def test_fednova_base_aggregation_is_fednovas(make_run_config):
    # FedSOL with rho = 0 on the FedNova server is FedNova exactly
    ref, _ = run(make_run_config, "fednova", {})
    sim, _ = run(make_run_config, "fedsol", {"base": "fednova", "rho": 0.0})
    for k, v in ref.global_params.items():
        assert torch.equal(sim.global_params[k], v), k


@pytest.mark.parametrize(
    "params,field",
    [({"rho": -1}, "rho"), ({"perturb": "tail"}, "perturb"), ({"adaptive": 1}, "adaptive"),
     ({"lambda_norm": "row"}, "lambda_norm"), ({"proximal": "js"}, "proximal"),
     ({"temperature": 0}, "temperature"), ({"base": "fedsam"}, "base"),
     ({"proximal": "base"}, "proximal"), ({"proximal": "base", "base": "fednova"}, "proximal"),
     ({"base": "fedprox", "base_params": {"mu": -1}}, "mu"), ({"base": "moon", "base_params": {"x": 1}}, "x"),
     ({"update": "sgd"}, "update"), ({"update": "loss", "proximal": "base", "base": "fedprox"}, "update"),
     ({"beta": -0.1}, "beta")],
)  # fmt: skip
def test_bad_params_rejected(minimal_config, params, field):
    minimal_config["experiments"][0]["methods"] = [{"name": "fedsol", "params": params}]
    with pytest.raises(FedForgetError) as ei:
        parse_config(minimal_config)
    assert field in str(ei.value) and "fedsol" in str(ei.value)


def test_short_digits_run_records_the_analyses(make_run_config):
    rc = make_run_config(dataset="digits", model="cnn2d", method="fedsol", params={"perturb": "all", "rho": 2.0},
                         rounds=2, batch_size=32)  # fmt: skip
    sim = Simulation(rc, device=CPU)
    status, rows, msg = sim.run(progress=False)
    assert status == "completed", msg
    last = rows[-1]
    assert last["fedsol_eps_norm"] > 0 and last["fedsol_prox_loss"] > 0
    assert -1.0 <= last["fedsol_cos_update_prox"] <= 1.0
