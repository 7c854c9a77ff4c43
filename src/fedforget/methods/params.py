"""Method hyperparameters: typed fields that state each default and range once, and the
JSON-schema fragment validated from them.

A method's ``Params`` is a dataclass whose every field is declared with one of the
constructors below; the field's default, type and bounds live there and nowhere else::

    @dataclass(frozen=True)
    class Params:
        mu: float = number(1.0, minimum=0)                 # proximal weight [P]
        tau: float = number(0.5, exclusiveMinimum=0)       # temperature [C]
        weighting: str = choice("uniform", WEIGHTINGS)     # [D]
        buffer_size: int = integer(200, minimum=0)         # rows per client [P]

``schema(Params)`` is the JSON-schema fragment of those fields (type, bounds, choices,
default; no other key is allowed), and ``validate_params`` checks a config's raw mapping
against it with the same validator as the config file (``fedforget.validation``) before the
dataclass is built; ``Params.check()``, where a method writes one, is left to the rules that
tie fields together (FedSOL's ``proximal: base`` needs a base with a proximal term).

Why JSON-schema fragments generated from the dataclasses and not pydantic models [D]: the
config file is already checked by JSON schema, so method hyperparameters get the same errors
(key, bad value, what is allowed) from one validator; nothing is coerced (an int stays an
int), so a value reaches the config hash exactly as written and no shipped config changes
its hash; and there is no second model library beside the dataclasses the engine uses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from ..utils import FedForgetError
from ..validation import describe_allowed, nearest, strict_validator
from .registry import METHODS

SCHEMA = "schema"  # the field metadata key holding the field's JSON-schema fragment
ADDED = "added"  # the field metadata key marking a field added after results existed


def _field(default: Any, schema: dict[str, Any], added: bool = False) -> Any:
    meta = {SCHEMA: schema, ADDED: added}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def number(default: float, **bounds: float) -> Any:
    """A finite real number (an int is accepted as written, a bool is not); ``bounds``:
    JSON schema's minimum, exclusiveMinimum, maximum, exclusiveMaximum."""
    return _field(default, {"type": "number", **bounds})


def integer(default: int, **bounds: int) -> Any:
    """An integer (not a bool), with JSON schema's minimum / maximum."""
    return _field(default, {"type": "integer", **bounds})


def boolean(default: bool) -> Any:
    return _field(default, {"type": "boolean"})


def choice(default: Any, options: Sequence[Any], added: bool = False) -> Any:
    """One of ``options`` (strings, numbers, or None). ``added``: a field added to a method
    after results existed (see ``recorded``)."""
    return _field(default, {"enum": list(options)}, added)


def text(default: str) -> Any:
    """Any string (a registered name is checked by ``check()``)."""
    return _field(default, {"type": "string"})


def mapping(default: dict[str, Any] | None = None) -> Any:
    """A mapping with string keys (a base method's hyperparameters, checked by it)."""
    return _field({} if default is None else default, {"type": "object"})


def sequence(default: Sequence[Any], items: dict[str, Any], **size: int) -> Any:
    """A list (a tuple default is kept as written) of values of schema ``items``;
    ``size``: minItems / maxItems."""
    return _field(default, {"type": "array", "items": items, **size})


def one_of(default: Any, *forms: dict[str, Any], added: bool = False) -> Any:
    """A value of any of the JSON-schema ``forms`` (a number or ``"auto"``, ...); ``added``:
    as ``choice``'s."""
    return _field(default, {"anyOf": list(forms)}, added)


def recorded(params: Any) -> dict[str, Any]:
    """The hyperparameters a run records (its config, and so its hash): every field, with its
    default filled in, except a field marked ``added`` while it has its default [D]. A switch
    added to a method later (GPM's ``task0_rank``) so leaves the identity of every run from
    before it unchanged (no rerun of finished results), and a run that sets it gets its own."""
    out = dataclasses.asdict(params)
    for f in dataclasses.fields(params):
        if f.metadata.get(ADDED) and out[f.name] == _default(f):
            del out[f.name]
    return out


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def redefault(base: type, name: str, default: Any) -> Any:
    """Field ``name`` of the ``Params`` dataclass ``base`` with another default: a subclass
    that fixes its paper's value states that value, not the field's range again."""
    f = next((f for f in dataclasses.fields(base) if f.name == name), None)
    if f is None or SCHEMA not in f.metadata:
        raise TypeError(f"{base.__qualname__} has no declared field {name!r}")
    return _field(default, dict(f.metadata[SCHEMA]))


def schema(params_cls: type) -> dict[str, Any]:
    """The JSON-schema fragment of a ``Params`` dataclass: each field's declared schema
    with its default; no other key. Raises TypeError for a field declared without one of
    this module's constructors (``tests/methods/test_params.py`` runs it over every method)."""
    props: dict[str, Any] = {}
    for f in dataclasses.fields(params_cls):
        if SCHEMA not in f.metadata:
            raise TypeError(f"{params_cls.__qualname__}.{f.name} is declared without a schema (fedforget.methods.params)")
        default = _default(f)
        props[f.name] = {**f.metadata[SCHEMA], "default": list(default) if isinstance(default, tuple) else default}
    return {"type": "object", "properties": props, "additionalProperties": False}


def _non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return any(_non_finite(v) for v in value)
    return False


def field_errors(params_cls: type, raw: dict[str, Any]) -> list[str]:
    """What is wrong with ``raw``'s known fields, one ``field=value; allowed: ...`` per bad
    field (the JSON-schema check of ``schema(params_cls)``; NaN and +-inf refused, which
    range checks would let through)."""
    frag = schema(params_cls)
    props = frag["properties"]
    bad: dict[str, str] = {}
    for name, value in raw.items():
        if name in props and _non_finite(value):
            bad[name] = f"{name}={value!r}; allowed: {describe_allowed(props[name])}"
    validator = strict_validator({**frag, "additionalProperties": True})
    for e in validator.iter_errors(raw):
        name = str(e.absolute_path[0]) if e.absolute_path else ""
        if name in props and name not in bad:
            bad[name] = f"{name}={raw[name]!r}; allowed: {describe_allowed(props[name])}"
    return [bad[k] for k in sorted(bad)]


def _unknown_hint(k: str, allowed: list[str]) -> str:
    """' (a hyperparameter of m1, m2)' where other methods take ``k``, else the nearest
    allowed name's ' (did you mean ...)', else ''."""
    owners = sorted(n for n in METHODS.names() if k in {f.name for f in dataclasses.fields(METHODS.get(n).Params)})
    if owners:
        return f" ({k!r} is a hyperparameter of {', '.join(owners)})"
    near = nearest(k, allowed)
    return f" (did you mean {near!r} for {k!r}?)" if near else ""


def validate_params(method: str, params_cls: type, raw: dict[str, Any], key: str = "params") -> Any:
    """``raw`` (a config's mapping) as ``params_cls``: unknown keys, then each field against
    its schema, then ``check()`` (rules across fields); one FedForgetError naming the key,
    the method, every bad field, its value and what is allowed."""
    if not isinstance(raw, dict):
        raise FedForgetError(f"{key} (method '{method}'): {raw!r}; allowed: a mapping of hyperparameters")
    allowed = sorted(f.name for f in dataclasses.fields(params_cls))
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        hints = "".join(_unknown_hint(k, allowed) for k in unknown)
        raise FedForgetError(
            f"{key}: unknown hyperparameter(s) {unknown} for method '{method}'{hints}; allowed: {allowed or 'none'}"
        )
    errors = field_errors(params_cls, raw)
    if errors:
        raise FedForgetError(f"{key} (method '{method}'): " + "; ".join(errors))
    try:
        p = params_cls(**raw)
        check = getattr(p, "check", None)
        if check is not None:
            check()
    except (TypeError, ValueError) as e:
        raise FedForgetError(f"{key} (method '{method}'): {e}") from None
    return p


def param_schema(method: str, name: str) -> dict[str, Any] | None:
    """The schema fragment of registered method ``method``'s hyperparameter ``name``, or
    None where there is no such method or hyperparameter (``validation.check_numbers``
    words its range from it)."""
    if method not in METHODS.names():
        return None
    return next((f.metadata.get(SCHEMA) for f in dataclasses.fields(METHODS.get(method).Params) if f.name == name), None)


def make_params(name: str, params: dict[str, Any], key: str = "params") -> Any:
    """Registered method ``name``'s ``Params`` from a config's mapping (``validate_params``)."""
    return validate_params(name, METHODS.get(name).Params, params, key)
