"""Every method the batched client engine runs equals the sequential engine within 1e-5 (a
contract over the registry, not a list): FedAvg; those that train clients as FedAvg does
but upload something of their own (FedNova's effective step count, FedDF's and FedET's
public logits: their client_end runs per client on its trained weights); and those whose
local change is a per-step loss/gradient term (FedProx, FedDyn, SCAFFOLD: stated for the
whole stack in ``client_step_terms``), with their per-client state carried over rounds."""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
import torch

from fedforget.engine import Simulation
from fedforget.methods import METHODS, make_params
from fedforget.partition import PartitionSpec
from fedforget.vectorized import method_not_vectorized

from ..conftest import GPU_CODE_PATHS, GPU_TOL_FACTOR
from .conftest import CPU, QUICK_PARAMS, SMALL_CNN, SMALL_RESNET, replay_stream_cfg

# every registered method whose local training the batched engine can run, discovered from
# the hook API (no hand-written list: a new method that qualifies is tested here by itself)
# (each with its default hyperparameters: FedGP over FedAvg)
BATCHED = [n for n in METHODS.names() if method_not_vectorized(METHODS.get(n), "sgd", params=make_params(n, {})) is None]
SEQUENTIAL = [n for n in METHODS.names() if n not in BATCHED]
# exemplar memories kept in herding order: a client's class of two rows is an exact tie (both
# as far from their mean), which the trainers' rounding breaks either way (GLFC, LGA on iris:
# the same rows in the other order), so these are compared as sets of rows
HERDED = {"glfc"}


def test_discovery_finds_the_batched_methods():
    assert {"fedavg", "fednova", "feddf", "fedet", "fedprox", "feddyn", "scaffold", "fedgp"} <= set(BATCHED)
    assert {"fedsol", "fedsam", "fedasam", "fedntd", "moon", "fedrcl"} <= set(BATCHED)  # client_live_terms
    assert {"fedproj"} <= set(BATCHED)  # step terms that see the step: its memory batch
    assert {"icarl", "glfc", "lga", "target", "lander"} <= set(BATCHED)  # joined rows; synthetic batches (issue 32)
    assert "l2p" in BATCHED  # its prompted forward: the frozen ViT once over the stack's rows
    assert "cfed" in BATCHED  # a reviewer's surrogate rows in place of its minibatch
    assert SEQUENTIAL == []  # since the second session of 2026-12-03: forms of methods stay (below)
    lr_step = make_params("fedproj", {"local_lr_step": True})  # each client's lr falls within its round
    assert "declares stacked = False" in method_not_vectorized(METHODS.get("fedproj"), "sgd", params=lr_step)


@pytest.mark.parametrize(
    "method,params", [(m, QUICK_PARAMS.get(m, {})) for m in BATCHED] + [("scaffold", {"weighting": "samples"})],
    ids=[*BATCHED, "scaffold-samples"],
)  # fmt: skip
def test_every_batched_method_equals_sequential(public_run_cfg, run_engines, assert_same_metrics, method, params):
    """Within 1e-5, metrics and per-client state; 4 rounds at 3 of 4 clients, so clients come
    back with state from an earlier round (FedDyn's gradient, SCAFFOLD's c_i)."""
    rc = public_run_cfg(method, params, rounds=4, sample_rate=0.75, local_epochs=2, batch_size=8,
                        optimizer={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3})  # fmt: skip
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    kept = {cid: st for cid, st in seq.client_state.items() if st}  # FedAvg keeps none
    assert kept.keys() == {cid for cid, st in vec.client_state.items() if st}
    for cid, st in kept.items():
        for k, v in st.items():
            if k in HERDED:
                same_rows(v, vec.client_state[cid][k], (cid, k))
            else:
                close(v, vec.client_state[cid][k], (cid, k))


def same_rows(a, b, where):
    """Two memories {x, y, ...} hold the same rows (x with its label), in any order."""
    def rows(m):
        r = torch.cat([m["y"][:, None].to(m["x"].dtype), m["x"].flatten(1)], 1)
        return torch.unique(r, dim=0, return_counts=True)

    (ra, ca), (rb, cb) = rows(a), rows(b)
    assert torch.equal(ra, rb) and torch.equal(ca, cb), where


def close(a, b, where):
    """Client state within 1e-5 (tensors; on a GPU ``GPU_TOL_FACTOR`` times it), equal otherwise,
    nested dicts (a replay buffer) entry by entry."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            close(a[k], b[k], (*where, k))
    elif isinstance(a, torch.Tensor):
        assert torch.allclose(a.float(), b.float(), atol=1e-5 * GPU_TOL_FACTOR), where
    else:
        assert a == b, where


def test_step_terms_on_conv_steps_client_by_client(make_run_config, run_engines, assert_same_metrics):
    # digits cnn2d on a CPU: wide steps client by client (the terms per client), tails batched
    rc = make_run_config(dataset="digits", model="cnn2d", method="feddyn", params={"alpha": 0.1}, rounds=2,
                         local_epochs=2, batch_size=32, sample_rate=0.5, device="cpu",
                         optimizer={"lr": 0.05, "momentum": 0.9}, partition=PartitionSpec("dirichlet", clients=6, alpha=0.5, seed=0))  # fmt: skip
    out = run_engines(rc)
    assert_same_metrics(out["sequential"][1], out["vectorized"][1])


# the forms of methods whose local step the stacked trainer does not take (every registered
# method stacks at its defaults: test_discovery_finds_the_batched_methods)
OWN_STEP = [(m, {}) for m in SEQUENTIAL] + [("l2p", {"selection": "batch"}), ("fedproj", {"local_lr_step": True})]


@pytest.mark.parametrize("method,params", OWN_STEP, ids=[f"{m}-{i}" for i, (m, _) in enumerate(OWN_STEP)])
def test_methods_that_change_local_training_stay_sequential(public_run_cfg, method, params):
    rc = public_run_cfg(method, params)
    sim = Simulation(replace(rc, train=replace(rc.train, client_engine="auto")), device=CPU)
    assert sim.engine_info["client_engine"] == "sequential", method
    assert "local step of its own" in sim.engine_info["client_engine_reason"]


# the methods whose step has live terms (client_live_terms: a second pass at perturbed weights,
# a loss of the step's logits), on each path of the stacked trainer: an MLP's steps all
# batched (stacked_forward); a Conv2d model on a CPU: its wide steps client by client in
# replicas (live_alone), its short tails batched; FedSOL's head perturbation runs the head
# alone on the first pass's features, its body and all perturbations a full second pass
LIVE = [
    ("fedsol", {"rho": 1.0}, "cnn2d"),
    ("fedsol", {"rho": 0.5, "perturb": "all", "proximal": "l2", "adaptive": False}, "cnn2d"),
    ("fedsol", {"rho": 2.0, "perturb": "body", "lambda_norm": "column"}, "mlp"),
    ("fedsol", {"update": "loss", "proximal": "kl", "beta": 1.0}, "cnn2d"),  # Table 1's forms
    ("fedsol", {"update": "project", "proximal": "l2", "perturb": "all"}, "mlp"),
    ("fedsol", {"update": "project", "proximal": "kl", "perturb": "all"}, "cnn2d"),
    ("fedsam", {"rho": 0.1}, "cnn2d"),
    ("fedasam", {"rho": 0.5, "eta": 0.01}, "mlp"),
    ("fedntd", {"beta": 1.0, "tau": 2.0}, "cnn2d"),
    ("fedntd", {"beta": 0.5, "tau": 1.0}, "mlp"),
    ("moon", {"mu": 1.0, "tau": 0.5}, "cnn2d"),  # round 2: some clients with a previous model, some without
    ("moon", {"mu": 5.0, "tau": 1.0, "first_prev": "init"}, "mlp"),
    ("fedrcl", {}, "cnn2d"),  # one level: the penultimate features
    ("fedsol", {"rho": 1.0}, "slvit"),  # FedSOL Table 3's SL-ViT (stacked_forward since 2026-12-02)
    ("fedrcl", {"pairs": "topk", "beta": 0.5, "tau": 0.5}, "mlp"),
    # Table 4's combined mode: g_p the gradient of the base's term, its state carried over rounds
    ("fedsol", {"rho": 2.0, "perturb": "all", "base": "fedprox", "proximal": "base"}, "cnn2d"),
    ("fedsol", {"rho": 2.0, "perturb": "all", "base": "scaffold", "proximal": "base"}, "mlp"),
    ("fedsol", {"rho": 2.0, "perturb": "all", "base": "feddyn", "base_params": {"alpha": 0.1}, "proximal": "base"}, "cnn2d"),
    ("fedsol", {"rho": 2.0, "perturb": "all", "base": "fednova", "proximal": "kl"}, "mlp"),
    ("fedsol", {"rho": 2.0, "perturb": "all", "base": "moon", "base_params": {"mu": 0.1, "tau": 1.0}, "proximal": "base"}, "cnn2d"),
]


@pytest.mark.parametrize("method,params,model", LIVE, ids=[f"{m}-{'-'.join(str(v) for k, v in p.items() if k != 'base_params')}-{mo}" for m, p, mo in LIVE])
def test_live_terms_equal_sequential(make_run_config, run_engines, assert_same_metrics, assert_same_weights, method, params, model):
    """Within 1e-5: metrics (the methods' diagnostics included) and weights, 2 rounds (3 in
    combined mode: clients come back with their base's state) of 2 local epochs at batch 20
    over Dirichlet clients of unequal sizes."""
    if (method, model) == ("fedrcl", "cnn2d") and GPU_CODE_PATHS:
        pytest.skip("FedRCL's stacked convolutions over 2 rounds: test_fedrcl_one_step_per_client_stacked_equals_alone")
    part = PartitionSpec("dirichlet", clients=6, alpha=0.5, min_size=10, seed=0)
    rounds = 3 if "base" in params else 2
    options = {"cnn2d": SMALL_CNN, "slvit": {"patch_size": 4, "dim": 16, "depth": 1, "heads": 2, "dim_head": 8, "mlp_dim": 16}}
    rc = make_run_config(dataset="digits", model=model, model_options=options.get(model),
                         method=method, params=params, rounds=rounds, local_epochs=2, batch_size=20, sample_rate=0.5,
                         optimizer={"lr": 0.05, "momentum": 0.9}, partition=part)  # fmt: skip
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    assert_same_weights(seq, vec)
    assert any(k.startswith(f"{method}_") for k in rows_v[-1])  # the diagnostics came through


BN_LIVE = [
    ("fedsol", {"rho": 1.0}),  # the head perturbed: the second pass runs no BatchNorm
    # a second full pass; [D] adaptive: false, as Lambda from w - w_g is rounding noise at lr 1e-6
    ("fedsol", {"rho": 0.5, "perturb": "all", "proximal": "kl", "adaptive": False}),
    ("fedsam", {"rho": 0.1}),
    ("fedntd", {"beta": 1.0, "tau": 2.0}),
    ("moon", {"mu": 1.0, "tau": 0.5, "first_prev": "init"}),  # the previous model's statistics
    ("fedrcl", {}),  # the ResNet's five levels (forward_levels), stacked
]


# batch 12: every step batched; 20: on a CPU client by client (two methods: a second full pass, a frozen one)
BN_CASES = [(m, p, 12, "batch") for m, p in BN_LIVE] + [(m, p, 20, "batch") for m, p in BN_LIVE if m in ("fedsam", "moon", "fedrcl")]
# FedSOL Table 3's ResNet-18 (norm: batch_stateless, the FedNTD code's ResNets): every batch, a frozen
# global model's too, normalised by its own statistics, each client's rows alone in the stack
BN_CASES += [("fedsol", {"rho": 1.5}, 12, "batch_stateless"), ("fedntd", {"beta": 1.0, "tau": 1.0}, 12, "batch_stateless")]


@pytest.mark.parametrize("method,params,batch_size,norm", BN_CASES,
                         ids=[f"{m}-{'-'.join(str(v) for v in p.values())}-{b}-{n}" for m, p, b, n in BN_CASES])  # fmt: skip
def test_live_terms_with_batchnorm_equal_sequential(
    make_run_config, run_engines, assert_same_metrics, assert_same_weights, method, params, batch_size, norm
):
    """ResNet-8 with BatchNorm (issue 32): the running statistics are updated by the step's
    first pass alone (a second pass at w + eps updates copies, as FedSAM and FedSOL restore
    them on a client alone), and a frozen pass (FedSOL's global logits, MOON's previous
    model) normalises by the statistics of the weights it is given. One round: the weights,
    with the running statistics, within 1e-5, which a wrong update or a frozen pass with the
    wrong statistics moves by far more; the losses and the methods' diagnostics (FedSAM's
    sharpness, the second pass's loss; FedSOL's cosines, of the update gradient) within 2e-4:
    FedSOL's cosine of the update and the proximal gradient (0.003, nearly orthogonal) was
    5.3e-5 apart on one CI machine, 8e-9 on this one (its kernels round otherwise). [D] lr 1e-6:
    BatchNorm over 12 rows grows rounding differences (test_batchnorm_stacked_equals_
    sequential), at perturbed weights the more (FedSAM's loss there 1.8 above the step's at
    rho 0.1); at lr 1e-2 or 1e-3 the two trainers' mean training losses or FedSOL's cosines
    came apart beyond 1e-5, case by case, at lr 1e-6 they did not (ad-hoc probes). Batch
    12: every step batched, a step's clients with batches of different sizes in several
    runs; batch 20: on a CPU the steps of >= 16 rows client by client in replicas
    (``live_alone``)."""
    rc = make_run_config(dataset="digits", model="resnet8", model_options={**SMALL_RESNET, "norm": norm}, method=method,
                         params=params, rounds=1, local_epochs=1, batch_size=batch_size, eval_batch_size=batch_size,
                         sample_rate=0.1, optimizer={"lr": 1e-6, "momentum": 0.5, "weight_decay": 1e-4},
                         partition=PartitionSpec("iid", clients=40, seed=0))  # fmt: skip
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert vec.engine_info["client_engine"] == "vectorized"
    assert_same_metrics(rows_s, rows_v, tol=2e-4)
    assert_same_weights(seq, vec)
    assert any("running_mean" in k for k in vec.global_params) == (norm == "batch")


@pytest.mark.parametrize("model", ["cnn2d", "mlp"])
def test_fedrcl_one_step_per_client_stacked_equals_alone(make_run_config, run_engines, assert_same_metrics, assert_same_weights, model):
    """FedRCL's terms for a stack of 20 clients (one step each, at the global weights): its
    diagnostics (each client's L_SCL and L_DIV) and the weights within 1e-6 of the clients
    one after another. [D] Over several steps a stack whose convolutions are batched (a
    GPU's paths) does not stay within 1e-5 of one client's kernels: the thresholded
    penalty (a same-class pair crossing lambda = 0.7 adds exp(s / tau) to L_DIV, tau =
    0.05) and tau itself amplify rounding; with every step stacked the 2-round cnn2d case of
    test_live_terms_equal_sequential ended 6e-4 apart in a weight (float32), and one step per
    client agrees (measured 2026-12-06 under FEDFORGET_TEST_GPU_PATHS=1). On a CPU's paths
    that case runs each wide step in the client's replica, the same kernels as alone."""
    part = PartitionSpec("dirichlet", clients=40, alpha=0.5, min_size=10, seed=0)
    rc = make_run_config(dataset="digits", model=model, model_options=SMALL_CNN if model == "cnn2d" else None,
                         method="fedrcl", rounds=1, local_epochs=1, batch_size=256, sample_rate=0.5,
                         optimizer={"lr": 0.01}, partition=part, eval_local_models=False)  # fmt: skip
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert rows_v[-1]["fedrcl_l_div"] > 0
    assert_same_metrics(rows_s, rows_v, tol=1e-6)
    assert_same_weights(seq, vec, tol=1e-6)


@pytest.mark.parametrize("levels", ["all", [0, 2]])
def test_fedrcl_levels_of_a_resnet_stacked_equal_sequential(make_run_config, run_engines, assert_same_metrics, assert_same_weights, levels):
    """FedRCL's multi-level terms on ResNet-8 with GroupNorm (the FedRCL code's norm): the
    stacked forward gives the stem's and each stage's pooled pre-ReLU output, as
    ``forward_levels``; the weights within 1e-4 of the clients one after another, the metrics,
    its l_scl and l_div included, within 2e-4 (a CPU: steps of 12 rows batched, of 20 client by
    client in replicas). [D] 2e-4: after a round at lr 0.01 one CI machine's two test losses were
    3.0e-5 apart (0 on this one); levels 'all' against [0, 2] moves that loss by 0.17."""
    rc = make_run_config(dataset="digits", model="resnet8", model_options={"norm": "group", **SMALL_RESNET}, method="fedrcl",
                         params={"levels": levels}, rounds=1, local_epochs=1, batch_size=12, sample_rate=0.1,
                         optimizer={"lr": 0.01, "momentum": 0.5}, partition=PartitionSpec("iid", clients=40, seed=0))  # fmt: skip
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v, tol=2e-4)
    assert_same_weights(seq, vec, tol=1e-4)
    assert rows_v[-1]["fedrcl_l_scl"] > 0


FEDPROJ = [
    ({"memory_batch_size": 5}, "sgd"),  # each client's own random memory rows per step
    ({"memory_batch_size": 5, "proj_dropout": 0.5, "coef_clamp": 1.0}, "sgd"),  # some clients idle
    ({"memory_loss": "ce", "alpha": 0.0}, "adam"),  # the paper's optimizer, labelled memory
]


@pytest.mark.parametrize("params,opt", FEDPROJ, ids=["random-memory", "dropout-clamp", "ce-adam"])
def test_fedproj_trains_stacked_as_sequential(public_run_cfg, run_engines, assert_same_metrics, assert_same_weights, params, opt):
    """FedProj's memory gradient and Eq. 14 for a stack (issue 32): within 1e-5 of the
    clients one after another, its diagnostics (proj_share, cos_before) included; 4 rounds
    at 3 of 4 clients (projection from round 2, the memory then the last round's logits)."""
    optimizer = {"name": "adam", "lr": 0.005} if opt == "adam" else {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}
    rc = public_run_cfg("fedproj", {"distill_epochs": 1, "distill_batch_size": 4, **params}, rounds=4,
                        sample_rate=0.75, local_epochs=2, batch_size=8, optimizer=optimizer)  # fmt: skip
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    assert_same_weights(seq, vec)
    assert any(r.get("fedproj_proj_share", 0) > 0 for r in rows_v)  # it projected


def test_live_terms_under_task_masks_equal_sequential(make_run_config, run_engines, assert_same_metrics, assert_same_weights):
    """Task-incremental split digits: the task loss masks each row's logits to its task,
    FedSOL's KL term reads the unmasked logits, as alone."""
    rc = replay_stream_cfg(make_run_config, "fedsol", {"rho": 1.0}, incremental="task", local_epochs=1)
    out = run_engines(rc)
    assert_same_metrics(out["sequential"][1], out["vectorized"][1])
    assert_same_weights(out["sequential"][0], out["vectorized"][0])


@pytest.mark.parametrize(
    "params,model,ulp",
    [({"rho": 1.0}, "mlp", False), ({"update": "project", "proximal": "kl", "perturb": "all"}, "mlp", False),
     ({"update": "project", "proximal": "kl", "perturb": "all"}, "mlp", True),
     ({"rho": 1.0, "adaptive": False}, "mlp", True)],
    ids=["kl-perturb-head", "kl-project", "kl-project-ulp", "kl-fixed-ulp"],
)  # fmt: skip
def test_fedsol_step_records_equal_sequential(make_run_config, run_engines, monkeypatch, params, model, ulp):
    """Each step's logged diagnostic inputs (FedSOL's prox_loss, eps_norm, conflict_rate and
    cos_update_prox's g_u . g_p, ||g_u||^2 and ||g_p||), client by client in step order, equal
    the sequential trainer's within 1e-5 relative, and so do the clients' first steps, where
    w = w_g makes the KL gradient exactly 0 (no record). ``ulp``: nn.Linear's module forward
    (a frozen model's; the stack runs its own batched matmuls) one float32 step above its
    value (``nextafter``), as a GPU's kernels for the two differed in the last bits (H200, 2026-11-27: the
    batched trainer then logged and projected on a rounding vector at w = w_g; its round
    means of cos_update_prox were 0.01-0.02 off while training agreed)."""
    from fedforget.methods.fedsol import FedSOL

    if ulp and os.environ.get("FEDFORGET_TEST_DEVICE", "cpu") != "cpu":
        # on a GPU the difference is real (the plain cases test it; H200, 2026-11-27, third session: they pass)
        pytest.skip("the ulp cases reproduce on a CPU the GPU's last-bit difference")
    if ulp:
        linear = torch.nn.Linear.forward
        def above(self, x):  # the next float32 up, on the tensor's own device; its gradient the identity's
            out = linear(self, x)
            # nextafter's own derivative came after torch 2.11 (the GPU machines' release: "not implemented"):
            # out plus the (exact) one-ulp step, the step computed off the graph
            step = torch.nextafter(out.detach(), torch.full_like(out, math.inf)) - out.detach()
            return out + step

        monkeypatch.setattr(torch.nn.Linear, "forward", above)

    logs: dict[str, dict] = {}
    current: list[str] = []
    real = FedSOL._record

    def spy(self, ctxs, key, *values, **where):
        for j, ctx in enumerate(ctxs):  # a host read per record: a test only
            row = [float(v[j] if isinstance(v, torch.Tensor) and v.dim() else v) for v in values]
            logs[current[0]].setdefault((ctx.cid, key), []).append(row)
        return real(self, ctxs, key, *values, **where)

    monkeypatch.setattr(FedSOL, "_record", spy)
    monkeypatch.setenv("FEDFORGET_CUDA_GRAPHS", "0")  # the spy reads the host: no step captured

    real_run = Simulation.run

    def run(sim, *a, **k):  # which engine's run is recording: Simulation.run is called once per engine
        current[:] = [sim.engine_info["client_engine"]]
        logs[current[0]] = {}
        return real_run(sim, *a, **k)

    monkeypatch.setattr(Simulation, "run", run)
    part = PartitionSpec("dirichlet", clients=5, alpha=0.5, min_size=3, seed=1)
    rc = make_run_config(model=model, method="fedsol", params=params, partition=part, rounds=2, local_epochs=2,
                         batch_size=7, optimizer={"lr": 0.1, "momentum": 0.9})  # fmt: skip
    run_engines(rc)
    seq, vec = logs["sequential"], logs["vectorized"]
    assert set(seq) == set(vec) and any(k == "cos_update_prox" for _, k in seq)
    names = {"cos_update_prox": ("g_u . g_p", "||g_u||^2", "||g_p||")}
    for (cid, key), rows in seq.items():
        # NaN: no record (a step without g_p logs one, a client alone too since 2026-12-06)
        rows = [r for r in rows if not any(math.isnan(v) for v in r)]
        other = [r for r in vec[(cid, key)] if not any(math.isnan(v) for v in r)]
        assert len(rows) == len(other), (cid, key)
        for step, (a, b) in enumerate(zip(rows, other)):
            for i, (x, y) in enumerate(zip(a, b)):
                what = names.get(key, (key,) * len(a))[i]
                assert abs(x - y) <= 1e-5 * max(1.0, abs(x)), f"client {cid}, {key}, step {step}: {what} {x} vs {y}"
