"""The plug-in base (methods/plugin.py): a method over another method forwards every hook
of the API to its base, so a plug-in that overrides nothing is its base, bit for bit, for
every registered method (a contract over the registry), its diagnostics renamed
<plug-in>_<base>_<key>."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import pytest

from fedforget.methods import METHODS, FedAvg
from fedforget.methods.params import mapping, text
from fedforget.methods.plugin import HOOKS, OverBase

from .conftest import QUICK_PARAMS, run

PLUGINS = {n for n in METHODS.names() if issubclass(METHODS.get(n), OverBase)}
BASES = [n for n in METHODS.names() if n not in PLUGINS]


def test_the_plugin_forwards_every_hook_of_the_api():
    api = {
        n for n, f in vars(FedAvg).items()
        if inspect.isfunction(f) and not n.startswith("_")
    }  # fmt: skip
    # scratch: each method's own per-client namespace; batch_loss: a helper over client_loss;
    # task_mask: a helper over the data label_classes, which a plug-in takes from its base
    # (the exchanges a plug-in runs are its own and its base's: OverBase.exchanges, a
    # property, not a hook)
    assert set(HOOKS) == api - {"scratch", "batch_loss", "task_mask"}
    assert len(HOOKS) == 18 and all(h.split("_")[0] in ("model", "server", "client", "eval") for h in HOOKS)
    assert "fedsol" in PLUGINS


@dataclass(frozen=True)
class BareParams:
    base: str = text("fedavg")
    base_params: dict[str, Any] = mapping()


class Bare(OverBase):
    """A plug-in that changes nothing."""

    name = "bare"
    Params = BareParams


@pytest.mark.parametrize("base", BASES)
def test_a_plugin_that_overrides_nothing_is_its_base(public_run_cfg, monkeypatch, base):
    monkeypatch.setitem(METHODS._items, "bare", Bare)
    params = QUICK_PARAMS.get(base, {})
    _, rows_base = run(public_run_cfg(base, params, rounds=2, sample_rate=0.75))
    _, rows_bare = run(public_run_cfg("bare", {"base": base, "base_params": params}, rounds=2, sample_rate=0.75))
    # the base's diagnostics come out as <plug-in>_<base>_<key>
    renamed = [{k.replace(f"bare_{base}_", f"{base}_", 1): v for k, v in r.items()} for r in rows_bare]
    for a, b in zip(rows_base, renamed, strict=True):
        a, b = ({k: v for k, v in r.items() if not k.endswith("_s")} for r in (a, b))
        assert a == b, base
