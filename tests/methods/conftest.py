"""Fixtures shared by the method tests: a data root with a held-out public set, tiny
distillation-method runs on it, and a Simulation runner."""

from __future__ import annotations

import math
import shutil
from dataclasses import replace

import pytest
import torch

from fedforget.data import prepare_public
from fedforget.engine import Simulation
from fedforget.partition import PartitionSpec

from .. import conftest as conftest_root
from ..conftest import GPU_TOL_FACTOR

CPU = torch.device("cpu")
PUBLIC = {"source": "holdout", "fraction": 0.1, "seed": 0}
# GLFC's and LGA's proxy server at a few iterations (the contract tests over every method
# check wiring and state, not the reconstruction, which tests/methods/test_glfc.py checks):
# at the defaults (250 reconstruction steps of 20 L-BFGS iterations) it is most of their time
GLFC_FAST = {"perturb_iters": 2, "recon_iters": 2, "recon_inner": 2, "recon_keep": 2}
# SCR on the contract tests' iris rows (not images): the dataset's views (the identity there;
# its image augmentation is tests/methods/test_scr.py's), a small buffer and memory batch
SCR_FAST = {"views": "dataset", "buffer_size": 40, "memory_batch_size": 16}
QUICK_PARAMS = {"glfc": GLFC_FAST, "lga": GLFC_FAST, "scr": SCR_FAST}


@pytest.fixture(scope="session")
def public_root(data_root, tmp_path_factory):
    """A copy of the prepared iris data with a 10% holdout public set (data_root stays
    read-only)."""
    root = tmp_path_factory.mktemp("public_data")
    shutil.copytree(data_root / "iris", root / "iris")
    prepare_public(PUBLIC, "iris", root)
    return root


@pytest.fixture(scope="session")
def digits_public_root(data_root, tmp_path_factory):
    """A copy of the prepared digits data with a 10 % holdout public set (~180 rows): CFeD's
    surrogate sets on a task stream."""
    root = tmp_path_factory.mktemp("digits_public")
    shutil.copytree(data_root / "digits", root / "digits")
    prepare_public(PUBLIC, "digits", root)
    return root


@pytest.fixture
def public_run_cfg(make_run_config, public_root):
    """Tiny run configs (iris, Dirichlet 0.5 over 4 clients, 3 rounds) with the public set;
    a method defined on one model alone (its class's ``needs_model``, or its base's: L2P's
    ViT) gets that model, tiny, on digits instead (no public set)."""

    def make(method, params=None, **train):
        if needs_model(method, params) == "vit":
            return make_run_config(
                dataset="digits", model="vit", model_options=TINY_VIT, method=method, params=params,
                partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=10, seed=0),
                **{"rounds": 3, **train},
            )  # fmt: skip
        rc = make_run_config(
            method=method,
            params=params,
            public=PUBLIC,
            partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=5, seed=0),
            **{"rounds": 3, **train},
        )
        return replace(rc, data_dir=str(public_root))

    return make


# a 1-layer ViT on the 1x8x8 digits: 2x2 patches of 4x4 pixels, width 16, 2 heads
TINY_VIT = {"image_size": 8, "patch_size": 4, "layers": 1, "heads": 2, "hidden_dim": 16, "mlp_dim": 32}


def needs_model(method, params=None):
    """The model ``method`` (or, for a plug-in, its ``base``) is defined on alone, else None."""
    from fedforget.methods import METHODS

    for name in (method, (params or {}).get("base")):
        if name in METHODS and getattr(METHODS.get(name), "needs_model", None):
            return METHODS.get(name).needs_model
    return None


def run(rc, device=CPU):
    """Run a Simulation on ``device`` (the CPU unless given) to the end; it must complete."""
    sim = Simulation(rc, device=device)
    status, rows, msg = sim.run(progress=False)
    assert status == "completed", msg
    return sim, rows


def run_method(make_run_config, method, params, **train):
    """A tiny run of ``method`` with ``params`` (see the make_run_config fixture), to the end."""
    return run(make_run_config(method=method, params=params, **train))


# ----------------------------------------------------------------------------- task streams
SPLIT = {"kind": "split", "tasks": 3, "classes_per_task": 2, "rounds_per_task": 1, "leftover_classes": "drop"}
SMALL_CNN = {"channels": [4, 8], "hidden": 16}
SMALL_RESNET = conftest_root.SMALL_RESNET


def digits_cfg(make_run_config, method, params=None, **train):
    """Split digits (3 tasks x 1 round), a small CNN, Dirichlet 0.5 over 4 clients."""
    return make_run_config(
        dataset="digits", model="cnn2d", model_options=SMALL_CNN, method=method, params=params, scenario=SPLIT,
        partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=10, seed=0),
        **{"rounds": 3, "batch_size": 32, "eval_local_models": False, "eval_every": 3, **train},
    )  # fmt: skip


def replay_stream_cfg(make_run_config, method, params, model="mlp", model_options=None, incremental="class",
                      heads="shared", class_order="natural", **train):  # fmt: skip
    """Split digits (3 tasks x 3 classes, 2 rounds each, 2 local epochs), 5 Dirichlet 0.5
    clients of unequal sizes, 3 of 4 sampled: replay buffers fill and are replayed, some
    clients' still empty early (the stacked replay methods' equality tests); ``heads``
    shared or per task; ``class_order`` natural or shuffled (scenario seed 0: class 0 in
    task 1, which the stacked trainer's padding rows of label 0 meet); ``train`` overrides."""
    scenario = {"kind": "split", "tasks": 3, "classes_per_task": 3, "rounds_per_task": 2,
                "leftover_classes": "drop", "incremental": incremental, "heads": heads}  # fmt: skip
    if class_order != "natural":
        scenario["class_order"] = class_order
    train = {"rounds": 6, "local_epochs": 2, "batch_size": 32, "sample_rate": 0.75,
             "optimizer": {"lr": 0.05, "momentum": 0.9}, "eval_local_models": False, **train}  # fmt: skip
    return make_run_config(dataset="digits", model=model, model_options=model_options, method=method, params=params,
                           scenario=scenario, partition=PartitionSpec("dirichlet", clients=5, alpha=0.5, min_size=5, seed=0),
                           **train)  # fmt: skip


# [D] The stacked-equals-sequential tests of the continual methods on ResNet-8 train 1 local
# epoch at lr 0.005: BatchNorm over minibatches of a few rows turns any rounding difference
# into a large one (FedAvg over replay_stream_cfg's ResNet-8 at lr 0.05, 2 epochs: one client
# after another on 1 and on 2 threads ended 0.14 apart in a weight; at 0.005, 0.012; at
# 0.0005, 1.8e-7; 2026-12-06). A CPU runs a wide step's clients in replicas, the kernels of a
# client alone, so those tests matched at lr 0.05; every step stacked (a GPU's paths:
# FEDFORGET_TEST_GPU_PATHS=1) they did not.
BN_SHORT = {"local_epochs": 1, "optimizer": {"lr": 0.005, "momentum": 0.9}}


def close_buffers(a, b, key="replay", tol=1e-5):
    """Every client's replay buffer in simulations ``a`` and ``b``: the same keys, rows
    within ``tol`` (on a GPU's code paths ``GPU_TOL_FACTOR`` times it), the same counters."""
    tol *= GPU_TOL_FACTOR
    assert a.fed.clients.keys() == b.fed.clients.keys()
    for cid, st in a.fed.clients.items():
        buf, other = st[key], b.fed.clients[cid][key]
        assert buf.keys() == other.keys(), cid
        for k, v in buf.items():
            same = torch.allclose(v.float(), other[k].float(), atol=tol) if isinstance(v, torch.Tensor) else v == other[k]
            assert same, (cid, k)


def strip(rows, method_prefix=None):
    """Metrics rows without timings (and without the method's own columns)."""
    from fedforget.engine import TIMING_COLUMNS

    return [
        {
            k: v
            for k, v in r.items()
            if k not in TIMING_COLUMNS and not (method_prefix and k.startswith(method_prefix))
        }
        for r in rows
    ]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def projector(u):
    u = u.double()
    return u @ u.T


def checkpoint_keeper():
    """(saved, keep): ``keep`` as a run's on_checkpoint appends each checkpoint to
    ``saved`` after a round trip through torch.save, as the runner's file would hold it."""
    import io

    saved = []

    def keep(ckpt):
        buf = io.BytesIO()
        torch.save(ckpt, buf)
        buf.seek(0)
        saved.append(torch.load(buf, weights_only=False))

    return saved, keep


def same(a, b) -> bool:
    """Nested dicts / lists of tensors and plain values, equal bit for bit (tensors of the
    same dtype; NaN floats equal): a method's state after a resume against an uninterrupted
    run's."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def held_stacks(monkeypatch) -> list[str]:
    """The parameters GPM's per-client maps hand the stacked trainer as ``Held`` (some clients
    of a stack hold them, others do not), recorded as they happen in a run: a test's proof
    that its stacks mixed held and free clients."""
    import fedforget.methods.shared as shared
    from fedforget.methods.base import Held

    names: list[str] = []
    original = shared.each_client

    def spy(maps, grads):
        out = original(maps, grads)
        names.extend(n for n, v in out.items() if isinstance(v, Held))
        return out

    monkeypatch.setattr("fedforget.methods.gpm.each_client", spy)
    return names
