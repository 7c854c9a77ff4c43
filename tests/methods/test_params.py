"""Method hyperparameters declared once, as typed fields (``fedforget.methods.params``): every
registered method's fields carry their schema, defaults validate, and a bad value gets one
error naming the key, the method, the field, the value and what is allowed."""

from __future__ import annotations

import dataclasses

import pytest

from fedforget.methods import METHODS, check_params, make_params
from fedforget.methods.distill import DistillParams
from fedforget.methods.params import integer, number, redefault, schema, validate_params
from fedforget.utils import FedForgetError


@pytest.mark.parametrize("name", METHODS.names())
def test_every_field_is_declared_and_the_defaults_validate(name):
    cls = METHODS.get(name).Params
    frag = schema(cls)  # raises for a field declared without a schema
    assert frag["additionalProperties"] is False
    assert set(frag["properties"]) == {f.name for f in dataclasses.fields(cls)}
    defaults = check_params(name, {})
    for field, value in defaults.items():
        default = frag["properties"][field]["default"]
        assert (list(value) if isinstance(value, tuple) else value) == default, (name, field)


@dataclasses.dataclass(frozen=True)
class Toy:
    lr: float = number(0.1, exclusiveMinimum=0)
    k: int = integer(2, minimum=1)
    momentum: float = number(0.0, minimum=0, exclusiveMaximum=1)


def test_bad_values_are_named_with_what_is_allowed():
    with pytest.raises(FedForgetError) as e:
        validate_params("toy", Toy, {"lr": -1, "k": True, "momentum": 1.0}, "experiments[0].methods[0].params")
    assert str(e.value) == (
        "experiments[0].methods[0].params (method 'toy'): k=True; allowed: an integer >= 1; "
        "lr=-1; allowed: a finite number > 0; momentum=1.0; allowed: a finite number >= 0 and < 1"
    )
    with pytest.raises(FedForgetError, match=r"lr=nan; allowed: a finite number > 0"):
        validate_params("toy", Toy, {"lr": float("nan")})
    with pytest.raises(FedForgetError, match=r"unknown hyperparameter\(s\) \['l_r'\] for method 'toy' \(did you mean 'lr' for 'l_r'\?\); allowed: \['k', 'lr', 'momentum'\]"):
        validate_params("toy", Toy, {"l_r": 0.1})


def test_values_are_kept_as_written():
    """No coercion: an int given for a number stays an int (the config hash sees what was written)."""
    p = validate_params("toy", Toy, {"lr": 1})
    assert p.lr == 1 and isinstance(p.lr, int)


def test_a_redefault_keeps_the_range():
    @dataclasses.dataclass(frozen=True)
    class Mine(DistillParams):
        distill_lr: float = redefault(DistillParams, "distill_lr", 5e-5)

    assert schema(Mine)["properties"]["distill_lr"] == {"type": "number", "exclusiveMinimum": 0, "default": 5e-5}
    with pytest.raises(FedForgetError, match=r"distill_lr=0; allowed: a finite number > 0"):
        validate_params("mine", Mine, {"distill_lr": 0})
    with pytest.raises(TypeError, match="no declared field 'nope'"):
        redefault(DistillParams, "nope", 1)


def test_real_methods_reject_with_the_same_words():
    with pytest.raises(FedForgetError, match=r"params \(method 'moon'\): first_prev='x'; allowed: skip \| init"):
        make_params("moon", {"first_prev": "x"})
    with pytest.raises(FedForgetError, match=r"levels=\[\]; allowed: all \| last or a list of items, each an integer >= 0"):
        make_params("fedrcl", {"levels": []})
    with pytest.raises(FedForgetError, match=r"top_k=11; allowed: an integer in 1..pool_size=10"):
        make_params("l2p", {"top_k": 11})  # a rule across fields: Params.check()


def test_a_field_added_later_leaves_old_runs_their_identity():
    """GPM's task0_rank (added after results existed): left out of the recorded params, so
    out of the run hash, while it has its default; recorded when set (issue 36)."""
    from fedforget.methods.params import recorded

    assert "task0_rank" not in recorded(make_params("gpm", {}))
    assert "task0_rank" not in recorded(make_params("gpm", {"task0_rank": "paper"}))
    assert recorded(make_params("gpm", {"task0_rank": "code"}))["task0_rank"] == "code"
    assert recorded(make_params("gpm", {}))["samples"] == 125  # other defaults are filled in
