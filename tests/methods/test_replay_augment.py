"""Replayed rows augmented as the methods' sources do (``ClientContext.augment_rows``,
``InputPipeline.replay_inputs``): the identity (the same object) without a dataset
augmentation; with one, crops and flips by ``crop_flip`` keyed by (seed, stream, round,
client, step, store index), new at every step, never the private rows' draws; iCaRL's and
GLFC's exemplars go through it in training, and an augmented iCaRL run is deterministic
and resumes exactly."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch

from fedforget.config import TrainSpec
from fedforget.engine import Simulation
from fedforget.inputs import AUGMENT_STREAM, REPLAY_AUGMENT_STREAM, InputPipeline, crop_flip
from fedforget.methods import ClientContext, RunInfo
from fedforget.methods.glfc import KEY as GLFC_KEY
from fedforget.methods.glfc import MEMORY_STREAM
from fedforget.methods.icarl import EXEMPLAR_STREAM, KEY, ICaRL
from fedforget.utils import torch_seed

from .conftest import CPU, checkpoint_keeper, digits_cfg, strip

AUG = {"kind": "crop_flip", "pad": 2}
_P = 2_147_483_647


def ctx_on(pipe, model=None, rnd=3, cid=1, steps=0, **kw):
    """A client context whose data carry the input pipeline ``pipe`` (None: no data)."""
    model = model or torch.nn.Linear(1, 1)
    data = None if pipe is None else SimpleNamespace(data=SimpleNamespace(inputs=pipe))
    ctx = ClientContext(
        cid=cid, round=rnd, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        global_params={}, broadcast={}, state={}, n_samples=4, lr=0.1, local_epochs=1,
        batch_size=4, data=data, **kw,
    )  # fmt: skip
    ctx.steps = steps
    return ctx


def padded_windows(x, pad):
    """Every crop (and its mirror) of each image of ``x`` from its zero-padded copy."""
    xp = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    h, w = x.shape[-2:]
    out = []
    for dy in range(2 * pad + 1):
        for dx in range(2 * pad + 1):
            win = xp[..., dy : dy + h, dx : dx + w]
            out += [win, win.flip(-1)]
    return out


def test_without_augmentation_replayed_rows_are_the_stored_object():
    x = torch.randn(3, 1, 4, 4)
    rows = torch.arange(3)
    assert ctx_on(None).augment_rows(x, rows, 7) is x  # outside a run
    assert ctx_on(InputPipeline()).augment_rows(x, rows, 7) is x  # dataset without augment
    assert InputPipeline(augment=None, seed=5).replay_inputs(x, rows, 1, 2) is x


def test_replayed_rows_are_keyed_crops_and_flips_of_the_stored_rows():
    pipe = InputPipeline(augment=AUG, seed=3)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(16, 2, 6, 6, generator=g) + 0.5  # no zero pixel: a crop shows its padding
    rows = torch.arange(16).flip(0)
    ctx = ctx_on(pipe, rnd=4, cid=2, steps=5)
    out = ctx.augment_rows(x, rows, EXEMPLAR_STREAM)
    salt = torch_seed(3, REPLAY_AUGMENT_STREAM, EXEMPLAR_STREAM, 4, 2, 5) % _P
    assert torch.equal(out, crop_flip(x, rows, salt, 2))  # the shared equation, these draws
    assert not torch.equal(out, x)
    # each row is one window of its padded image, or its mirror
    for i in range(len(x)):
        assert any(torch.equal(out[i], w[i]) for w in padded_windows(x, 2))
    # deterministic; new at the next step, for another stream, round or client
    assert torch.equal(
        out, ctx_on(pipe, rnd=4, cid=2, steps=5).augment_rows(x, rows, EXEMPLAR_STREAM)
    )
    for other in (
        ctx_on(pipe, rnd=4, cid=2, steps=6).augment_rows(x, rows, EXEMPLAR_STREAM),
        ctx.augment_rows(x, rows, MEMORY_STREAM),
        ctx_on(pipe, rnd=5, cid=2, steps=5).augment_rows(x, rows, EXEMPLAR_STREAM),
        ctx_on(pipe, rnd=4, cid=0, steps=5).augment_rows(x, rows, EXEMPLAR_STREAM),
    ):
        assert not torch.equal(out, other)
    # never the private rows' salt
    assert salt != torch_seed(3, AUGMENT_STREAM) % _P


def icarl_aug_cfg(make_run_config, **train):
    rc = digits_cfg(make_run_config, "icarl", {"buffer_size": 12}, **train)
    return replace(rc, dataset=replace(rc.dataset, augment=AUG))


def test_icarl_exemplar_batches_are_augmented_from_the_store(make_run_config):
    """On a real client's data (digits with crop_flip): the step's share of the exemplars is
    crop_flip of the stored rows keyed by their store index; a new crop at the next epoch."""
    sim = Simulation(icarl_aug_cfg(make_run_config), device=CPU)
    view = sim.clients.view(0, 1)
    stored = torch.rand(7, *sim.clients.batch(torch.arange(1))[0].shape[1:]) + 0.5
    state = {KEY: {"x": stored, "y": torch.zeros(7, dtype=torch.long), "task": torch.zeros(7, dtype=torch.long),
                   "rank": torch.arange(7), "seen": torch.ones(10, dtype=torch.bool), "refreshed": -1}}  # fmt: skip
    model = sim.model_with(sim.global_params)
    method = ICaRL(ICaRL.Params(), RunInfo(CPU, 10, sim.cfg.seed, 4, TrainSpec()))
    ctx = ctx_on(sim.clients.inputs, model=model, rnd=1, cid=0, steps=0)
    ctx.data, ctx.state, ctx.batch_size = view, state, len(view)
    method.client_begin(ctx)  # one step per epoch: every exemplar each step
    x, _ = method.exemplar_batch(ctx)
    idx = method.scratch(ctx).perm
    salt = torch_seed(sim.cfg.seed, REPLAY_AUGMENT_STREAM, EXEMPLAR_STREAM, 1, 0, 0) % _P
    assert torch.equal(x, crop_flip(stored[idx], idx, salt, AUG["pad"]))
    assert not torch.equal(x, stored[idx])
    ctx.steps = 1
    x2, _ = method.exemplar_batch(ctx)
    idx2 = method.scratch(ctx).perm
    salt2 = torch_seed(sim.cfg.seed, REPLAY_AUGMENT_STREAM, EXEMPLAR_STREAM, 1, 0, 1) % _P
    assert salt2 != salt and torch.equal(x2, crop_flip(stored[idx2], idx2, salt2, AUG["pad"]))


def test_glfc_memory_rows_pass_through_augment_rows(make_run_config, monkeypatch):
    """GLFC appends its memory slice through ctx.augment_rows (its stream, the slice's
    indices) and trains on what it returns."""
    rc = digits_cfg(make_run_config, "glfc", {"memory_size": 12, "proxy": False})
    rc = replace(rc, dataset=replace(rc.dataset, augment=AUG))
    sim = Simulation(rc, device=CPU)
    seen = []
    real = ClientContext.augment_rows

    def spy(self, x, rows, stream, step=None):
        assert torch.equal(x, self.state[GLFC_KEY]["x"][rows])  # the memory slice, as stored
        out = real(self, x, rows, stream, step)
        seen.append((x, rows, stream, out))
        return out

    monkeypatch.setattr(ClientContext, "augment_rows", spy)
    status, _, msg = sim.run(progress=False)
    assert status == "completed", msg
    assert seen and all(s == MEMORY_STREAM for _, _, s, _ in seen)
    for x, _, _, out in seen:
        assert out.shape == x.shape
    assert any(not torch.equal(out, x) for x, _, _, out in seen)


def test_augmented_icarl_is_deterministic_and_resumes_exactly(make_run_config):
    rc = icarl_aug_cfg(make_run_config, rounds=4, checkpoint_every=1, eval_every=1)
    rc = replace(
        rc, dataset=replace(rc.dataset, scenario={**rc.dataset.scenario, "rounds_per_task": 2})
    )
    rc = replace(rc, train=replace(rc.train, rounds=4))
    full = Simulation(rc, device=CPU)
    saved, keep = checkpoint_keeper()
    status, rows_full, _ = full.run(progress=False, on_checkpoint=keep)
    assert status == "completed"
    again = Simulation(rc, device=CPU)
    assert strip(again.run(progress=False)[1]) == strip(rows_full)
    ckpt = next(c for c in saved if c["round"] == 3)  # mid task 1: exemplars replayed after it
    resumed = Simulation(rc, device=CPU)
    status, rows_res, _ = resumed.run(progress=False, resume=ckpt)
    assert status == "completed"
    assert strip(rows_res) == strip(rows_full)
    for k, v in full.global_params.items():
        assert torch.equal(v, resumed.global_params[k])
