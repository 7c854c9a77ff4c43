"""The method protocol's declared capabilities, over every registered method (a contract, not
a list): the extra exchanges a method runs are declared by name, from ``EXCHANGES``; a method
that writes a ``client_reply`` or a ``server_collect`` declares an exchange for it, and one that declares an
exchange writes at least one of them; a plug-in runs its own exchanges and its base's. Summed
shares in messages fold into one running total with the bits of a sum in the clients' order."""

from __future__ import annotations

import pytest
import torch

from fedforget.methods import METHODS, FedAvg, RunInfo, Upload, make_params
from fedforget.methods.base import (
    EXCHANGES,
    ROUND_END,
    TASK_END,
    Summed,
    SummedTotal,
    fold_summed,
    summed_total,
)
from fedforget.methods.plugin import HOOKS, OverBase
from fedforget.train_spec import TrainSpec

from .conftest import CPU


def _instance(name: str, params: dict | None = None) -> FedAvg:
    info = RunInfo(CPU, num_classes=10, seed=0, num_clients=4, train=TrainSpec())
    return METHODS.get(name)(make_params(name, params or {}), info)


def _writes(cls: type, hook: str) -> bool:
    """Whether ``cls`` or a class between it and FedAvg (or OverBase) defines ``hook``."""
    assert hook in HOOKS, hook  # a renamed hook fails here, not silently
    stop = (FedAvg, OverBase)
    return any(hook in vars(k) for k in cls.__mro__ if issubclass(k, FedAvg) and k not in stop)


@pytest.mark.parametrize("name", METHODS.names())
def test_exchanges_are_declared_by_name_and_written(name):
    cls = METHODS.get(name)
    declared = cls.own_exchanges if issubclass(cls, OverBase) else cls.exchanges
    assert set(declared) <= set(EXCHANGES), (name, declared)
    assert len(set(declared)) == len(declared)
    writes = _writes(cls, "client_reply") or _writes(cls, "server_collect")
    assert bool(declared) == writes, f"{name}: exchanges {declared}, writes reply/collect: {writes}"
    # a reply stated for a stack is of an exchange the method runs, written in client_replies
    assert set(cls.stacked_replies) <= set(declared), (name, cls.stacked_replies)
    assert bool(cls.stacked_replies) == _writes(cls, "client_replies"), name


def test_the_continual_methods_declare_their_exchanges():
    assert METHODS.get("gpm").exchanges == (TASK_END,)
    assert set(METHODS.get("icarl").exchanges) == {TASK_END, ROUND_END}
    assert METHODS.get("fedavg").exchanges == ()


@pytest.mark.parametrize("base", ["fedavg", "icarl", "gpm"])
def test_a_plugin_runs_its_own_exchanges_and_its_bases(base):
    m = _instance("fedgp", {"base": base})
    assert m.exchanges == tuple(dict.fromkeys((ROUND_END, *METHODS.get(base).exchanges)))



def test_a_plugin_without_exchanges_of_its_own_runs_its_bases():
    sol = _instance("fedsol", {"base": "scaffold"})
    assert sol.exchanges == () == METHODS.get("scaffold").exchanges
    gp = _instance("fedgp", {"base": "der"})
    assert gp.exchanges == (ROUND_END,)


# ----------------------------------------------------------------------------- capabilities
TRAINING_HOOKS = ("client_begin", "client_loss", "client_step", "client_grad")
TERM_HOOKS = ("client_begin",)  # what per-step terms may need
# live terms (a second pass, a loss of the step's logits): the sequential step written out
# over the same equations (FedSAM's client_step calls its perturbation, FedNTD's client_loss
# its distillation, on a stack of one), and a map of the step's gradient (``LiveStep.gmap``)
# written out in client_grad (L2P's clip)
LIVE_HOOKS = ("client_begin", "client_loss", "client_step", "client_grad")


@pytest.mark.parametrize("name", [n for n in METHODS.names() if not issubclass(METHODS.get(n), OverBase)])
def test_declared_capabilities_match_the_code(name):
    """What a method declares is what its code does: ``stacked`` only if every hook that shapes
    local training is FedAvg's, or it states its change as per-step terms (and writes only
    the hooks those need), or as live terms (``client_live_terms``, beside its sequential
    ``client_step``); ``step_terms``, ``live_terms``, ``own_upload``, ``own_predict`` exactly
    when it writes ``client_step_terms``, ``client_live_terms``, ``client_end``, ``eval_predict``. A wrong declaration would let
    the stacked trainer run a step the method does not take."""
    cls = METHODS.get(name)
    written = [h for h in TRAINING_HOOKS if _writes(cls, h)]
    terms = _writes(cls, "client_step_terms")
    live = _writes(cls, "client_live_terms")
    def says(attr: str, hook: str, writes: bool) -> str:
        return f"{name}: declares {attr} = {getattr(cls, attr)} but {'writes' if writes else 'does not write'} {hook}"

    assert cls.step_terms == terms, says("step_terms", "client_step_terms", terms)
    assert cls.live_terms == live, says("live_terms", "client_live_terms", live)
    assert cls.stacked == (
        not written or (terms and set(written) <= set(TERM_HOOKS)) or (live and set(written) <= set(LIVE_HOOKS))
    ), (f"{name}: declares stacked = {cls.stacked} but writes the training hooks {written} "
        f"(stacked needs none, or only {TERM_HOOKS} with step terms, or {LIVE_HOOKS} with live terms)")
    assert cls.own_upload == _writes(cls, "client_end"), says("own_upload", "client_end", _writes(cls, "client_end"))
    assert cls.own_predict == _writes(cls, "eval_predict"), says("own_predict", "eval_predict", _writes(cls, "eval_predict"))


@pytest.mark.parametrize("name", [n for n in METHODS.names() if not issubclass(METHODS.get(n), OverBase)])
def test_a_method_that_cuts_its_epochs_has_terms_or_trains_sequentially(name):
    """The stacked trainer reads ``ClientContext.epoch_steps`` where it calls ``client_begin``
    before its pass: for a method with step or live terms. A stacked method that set it
    without them would train whole epochs there (TARGET's code rule has its KD term)."""
    import inspect

    cls = METHODS.get(name)
    sets = any("epoch_steps =" in inspect.getsource(c) for c in cls.__mro__ if c not in (FedAvg, object)
               and c.__module__.startswith("fedforget.methods"))  # fmt: skip
    if sets and cls.trait("stacked", make_params(name, {})):
        assert cls.step_terms or cls.live_terms, name


def test_a_plugin_trains_sequentially():
    for name in METHODS.names():
        cls = METHODS.get(name)
        if issubclass(cls, OverBase):
            assert not cls.stacked and cls.own_upload and cls.own_predict, name


@pytest.mark.parametrize("name", METHODS.names())
def test_table_note_is_text_from_recorded_params(name):
    """Every method's variant note reads the recorded params dict (defaults: {}) and is text."""
    assert isinstance(METHODS.get(name).table_note({}), str)


def _shares(k: int, n: int = 6) -> list[Summed]:
    g = torch.Generator().manual_seed(k)
    # float32 shares of mixed scale: their float64 sum depends on the order of the additions
    return [Summed({"a": torch.randn(3, 4, generator=g) * 10.0 ** (i % 5 * 3), "b": torch.randn(2, generator=g)})
            for i in range(n)]  # fmt: skip


def _ordered_sum(shares: list[Summed]) -> dict[str, torch.Tensor]:
    """Each part's float64 sum begun at zero, in the shares' order (FOT's server before the fold)."""
    want = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in shares[0].parts.items()}
    for s in shares:
        for k, v in want.items():
            v += s.parts[k].to(torch.float64)
    return want


@pytest.mark.parametrize("n", [1, 2, 6])
def test_summed_shares_fold_into_one_total_with_the_bits_of_the_ordered_sum(n):
    shares = _shares(0, n)
    want = _ordered_sum(shares)
    totals, messages = {}, []
    for i, s in enumerate(shares):  # uploads and replies, nested, folded as each arrives
        m = Upload(i, 1, {}, 1, {"m": {"n": i, "y": s}}) if i % 2 else {"m": {"n": i, "y": s}}
        fold_summed(totals, m)
        fold_summed(totals, m)  # folding twice adds nothing
        messages.append(m)
        # held as float32 shares: the first alone; from the second on none, the sums float64
        assert [len(x.parts) for x in shares[: i + 1]] == ([2] if i == 0 else [0] * (i + 1))
    (total,) = totals.values()
    assert list(totals) == [("m", "y")] and isinstance(total, SummedTotal) and total.clients == n
    ys = [(m.extras if isinstance(m, Upload) else m)["m"]["y"] for m in messages]
    assert all(y is total for y in ys) and summed_total(ys) is total
    assert total.names() == ["a", "b"] and total.shape("a") == (3, 4)
    for k, v in want.items():
        assert torch.equal(total.part(k), v), k


def test_unfolded_shares_are_summed_part_by_part_in_their_order_and_kept():
    shares = _shares(2)
    want = _ordered_sum(shares)
    total = summed_total(shares)  # shares left unfolded (asynchronous task ends): summed here
    for k, v in want.items():
        assert torch.equal(total.part(k), v), k
    assert all(len(s.parts) == 2 for s in shares) and total.clients == 6  # read, not consumed
    reordered = summed_total(shares[::-1])  # not vacuous: the order changes the bits
    assert not all(torch.equal(reordered.part(k), v) for k, v in want.items())


def test_summed_shares_of_other_parts_are_refused():
    a, b = _shares(1)[:2]
    b.parts.pop("b")
    with pytest.raises(ValueError, match=r"summed parts differ: \['a'\] against \['a', 'b'\]"):
        summed_total([a, b])
    totals = {}
    fold_summed(totals, {"y": Summed({"a": torch.zeros(1)})})
    with pytest.raises(ValueError, match=r"2 values to sum: shares, or one folded total, expected"):
        summed_total([totals[("y",)], a])


def test_a_folded_total_is_read_for_every_client_folded_into_it():
    """The server reads one folded total as the clients' it holds; read for fewer (a reply
    left out after its share was folded), it is an error, not a sum over other clients."""
    totals, messages = {}, [{"y": s} for s in _shares(3, 3)]
    for m in messages:
        fold_summed(totals, m)
    assert summed_total(m["y"] for m in messages).clients == 3
    with pytest.raises(ValueError, match=r"a total of 3 clients' shares read as 2 clients'"):
        summed_total(m["y"] for m in messages[:2])


def test_shares_without_parts_fold():
    """A model with no layer to sketch sends empty shares: they fold into an empty total."""
    totals, messages = {}, [{"y": Summed({})} for _ in range(3)]
    for m in messages:
        fold_summed(totals, m)
    total = summed_total(m["y"] for m in messages)
    assert total.names() == [] and total.clients == 3
