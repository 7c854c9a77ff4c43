"""Schema validation of a raw config, with errors a user can act on: every key named by
its path (``experiments[0].train.optimizer.lr``), the bad value, and what is allowed, read
from the schema's types, bounds and descriptions. NaN and +-inf are refused before the
schema sees them (its range checks are false for NaN, so they would pass); a value that
matches no form of a oneOf (the public block, a model) is judged against the form it was
meant as, and the forms are listed."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import Any

import yaml

from .utils import FedForgetError


@cache
def schema() -> dict[str, Any]:
    text = resources.files("fedforget").joinpath("schemas/config.schema.yaml").read_text()
    return yaml.safe_load(text)


def _path(error_path) -> str:
    out = ""
    for p in error_path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "<top level>"


def _resolve(s: Any) -> Any:
    """A schema node with its ``$ref`` (``#/$defs/NAME``) followed."""
    while isinstance(s, dict) and "$ref" in s:
        s = schema()["$defs"][s["$ref"].rsplit("/", 1)[-1]]
    return s


def _schema_at(path: list[str | int]) -> dict[str, Any] | None:
    """The schema of the value at a key path (through $refs, array items and the first
    oneOf/anyOf alternative that has the key), or None where the schema leaves it open."""
    s: Any = schema()
    for p in path:
        s = _resolve(s)
        if not isinstance(s, dict):
            return None
        if isinstance(p, int):
            s = s.get("items")
            continue
        for alt in [s, *map(_resolve, s.get("oneOf", []) + s.get("anyOf", []))]:
            if p in (alt.get("properties") or {}):
                s = alt["properties"][p]
                break
        else:
            return None
    s = _resolve(s)
    return s if isinstance(s, dict) else None


def _allowed(s: dict[str, Any] | None) -> str:
    """'a finite number > 0 and <= 1' from a schema's type and bounds."""
    t = (s or {}).get("type")
    names = {"integer": "an integer", "boolean": "a boolean", "string": "a string"}
    what = " or ".join(names.get(x, "a finite number") for x in (t if isinstance(t, list) else [t]))
    ops = (("exclusiveMinimum", ">"), ("minimum", ">="), ("exclusiveMaximum", "<"), ("maximum", "<="))
    bounds = [f"{op} {s[k]}" for k, op in ops if s and k in s]
    return " ".join([what, " and ".join(bounds)]) if bounds else what


def describe_allowed(s: dict[str, Any]) -> str:
    """What a schema fragment allows, in words: 'a finite number >= 0', 'skip | init',
    'a list of 2 items, each a finite number', 'an integer >= 1 or auto'."""
    s = _resolve(s)
    if "enum" in s:
        return " | ".join("null" if v is None else str(v) for v in s["enum"])
    if "const" in s:
        return str(s["const"])
    forms = s.get("anyOf") or s.get("oneOf")
    if forms:
        return " or ".join(describe_allowed(f) for f in forms)
    t = s.get("type")
    if t == "null":
        return "null"
    if t == "boolean":
        return "true | false"
    if t == "object":
        return "a mapping"
    if t == "array":
        n = (s.get("minItems"), s.get("maxItems"))
        count = f"{n[0]} " if n[0] is not None and n[0] == n[1] else ""
        return f"a list of {count}items, each {describe_allowed(s.get('items') or {})}"
    return _allowed(s)


INT64 = (-(2**63), 2**63 - 1)  # the integers a config may hold
FLOAT32_MAX = 3.4028234663852886e38  # the largest real a config may hold: training's float32 arithmetic


def check_numbers(raw: Any, param_schema: Callable[[str, str], dict[str, Any] | None] | None = None) -> None:
    """Refuse NaN and +-inf (YAML ``.nan``, ``.inf``, ``-.inf``), reals beyond float32's range
    (``FLOAT32_MAX``) and integers beyond 64 bits (``INT64``) anywhere in a raw config, in one
    error naming every such key and what it allows (its schema's range within those limits;
    a method's hyperparameter's from ``param_schema(method, name)``, where the caller knows
    the methods): range checks are false for NaN, so the schema would pass them and every
    job would fail later; a real or an integer beyond those passed a range without a
    maximum, then overflowed torch inside a job (size_probe.py: --value 2**64, 5 tracebacks;
    --numbers at 1e300, 13)."""
    bad: list[tuple[list[str | int], float | int, str, dict[str, Any] | None]] = []

    def walk(v: Any, at: list[str | int], method: dict[str, Any] | None) -> None:
        if isinstance(v, float) and not (math.isfinite(v) and abs(v) <= FLOAT32_MAX) or (
            isinstance(v, int) and not isinstance(v, bool) and not INT64[0] <= v <= INT64[1]
        ):
            s = _schema_at(at) if method is None else _param_schema(method, at, param_schema)
            bad.append((at, v, f" (method '{method['name']}')" if method is not None else "", s))
        elif isinstance(v, dict):
            if len(at) > 1 and at[-2] == "methods" and isinstance(v.get("name"), str):
                method = v  # a hyperparameter's message names its method
            for k, x in v.items():
                walk(x, [*at, str(k)], method)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(x, [*at, i], method)

    walk(raw, [], None)
    if bad:
        lines = [f"{_path(at)}={v!r}{owner}: {_unrepresentable(v)}; allowed: {_allowed(_within(s, v))}"
                 for at, v, owner, s in bad]  # fmt: skip
        raise FedForgetError("invalid config:\n  " + "\n  ".join(lines))


FLOAT32_TEXT = f"{FLOAT32_MAX:.6g}"  # 3.40282e+38, itself within float32


def _param_schema(
    method: dict[str, Any], at: list[str | int], param_schema: Callable[[str, str], dict[str, Any] | None] | None
) -> dict[str, Any] | None:
    """The schema of the value at ``at`` inside ``method`` (a config's ``{name, params}``), as
    ``param_schema(method, name)`` knows it: a hyperparameter, or one of the base method's
    (``params: {base: der, base_params: {...}}``: FedGP, FedSOL); None elsewhere."""
    inner = at[at.index("methods") + 2 :] if "methods" in at else []
    params = method.get("params")
    if param_schema is None or not isinstance(params, dict):
        return None
    if len(inner) == 2 and inner[0] == "params":
        return param_schema(method["name"], str(inner[1]))
    if len(inner) == 3 and inner[:2] == ["params", "base_params"] and isinstance(params.get("base"), str):
        return param_schema(params["base"], str(inner[2]))
    return None


def _unrepresentable(v: float | int) -> str:
    """Why ``check_numbers`` refuses ``v``."""
    if isinstance(v, int):
        return "beyond a 64-bit integer"
    return "not a finite number" if not math.isfinite(v) else f"beyond float32's range (+-{FLOAT32_TEXT})"


def _within(s: dict[str, Any] | None, v: float | int) -> dict[str, Any]:
    """The range a key's schema ``s`` (None: a key without one) allows within what a config
    may hold at all, as ``_allowed`` words it: an integer's bounds capped to 64 bits, a
    real's open ends closed at +-float32's largest; of a oneOf/anyOf, its numeric form (an
    integer's first for an integer)."""
    s = _resolve(s) if s else {}
    alts = [_resolve(a) for a in s.get("oneOf", []) + s.get("anyOf", [])]
    order = ("integer", "number") if isinstance(v, int) else ("number", "integer")
    numeric = sorted((a for a in alts if a.get("type") in order), key=lambda a: order.index(a["type"]))
    s = {**(numeric[0] if numeric else s)}
    if isinstance(v, int) or s.get("type") == "integer":
        s.setdefault("type", "integer")
        for low, bound, limit, above in (("minimum", "exclusiveMinimum", INT64[0], False),
                                         ("maximum", "exclusiveMaximum", INT64[1], True)):  # fmt: skip
            have = s.get(low, s.get(bound))
            if have is None or (have > limit if above else have < limit):
                s.pop(bound, None)
                s[low] = limit
        return s
    if "minimum" not in s and "exclusiveMinimum" not in s:
        s["minimum"] = "-" + FLOAT32_TEXT
    if "maximum" not in s and "exclusiveMaximum" not in s:
        s["maximum"] = FLOAT32_TEXT
    return s


def _form(s: dict[str, Any]) -> str:
    """One alternative of a oneOf/anyOf as an error lists it: its description, else a sketch."""
    s = _resolve(s)
    if "description" in s:
        return str(s["description"])
    if "properties" in s:
        props = s["properties"].items()
        keys = [f"{k}: {v['const']}" if isinstance(v, dict) and "const" in v else k for k, v in props]
        return "{" + ", ".join(keys) + "}"
    t = s.get("type")
    if t == "null":
        return "null"
    if isinstance(t, str):
        return f"an {t}" if t[0] in "aeiou" else f"a {t}"
    return str(s)


def _tag(alts: list[Any]) -> tuple[str, list[tuple[Any, int]]] | None:
    """The key that every object alternative of a oneOf/anyOf fixes to a value of its own
    (``const``), e.g. the public block's ``source``: (key, [(value, alternative index)])."""
    objs = [
        (i, a.get("properties") or {}) for i, a in enumerate(map(_resolve, alts)) if a.get("type") == "object"
    ]
    for key in objs[0][1] if objs else ():
        if all(isinstance(props.get(key), dict) and "const" in props[key] for _, props in objs):
            return key, [(props[key]["const"], i) for i, props in objs]
    return None


def _alternatives(e) -> str:
    """A value that matches no alternative of a oneOf/anyOf: what is wrong with it, judged
    against the alternative it was meant as (the one whose ``const`` key it names, e.g.
    ``source: holdout``, else the only one of its type), and the allowed forms."""
    alts = e.validator_value
    errs: dict[int, list] = {}
    for c in e.context:
        errs.setdefault(c.relative_schema_path[0], []).append(c)
    inst, chosen, detail = e.instance, None, ""
    tag = _tag(alts)
    if isinstance(inst, dict) and tag:
        key, values = tag
        if key not in inst:
            detail = f"'{key}' is a required property"
        else:
            chosen = next((i for v, i in values if inst[key] == v), None)
            if chosen is None:
                detail = f"{key}: {inst[key]!r} is not one of {[v for v, _ in values]!r}"
    if chosen is None and not detail:  # the only alternative of the value's type
        # a const or enum of scalars cannot be what a mapping or list was meant as
        wrong_kind = ("type", "const", "enum") if isinstance(inst, (dict, list)) else ("type",)
        fits = [
            i for i in range(len(alts))
            if not any(c.validator in wrong_kind and not c.relative_path for c in errs.get(i, []))
        ]  # fmt: skip
        if len(fits) == 1:
            chosen = fits[0]
    if chosen is not None:
        subs = sorted(errs.get(chosen, []), key=lambda c: [str(p) for p in c.relative_path])
        detail = "; ".join(_leaf(c) for c in subs)
    head = f"{e.message.split(' is not valid')[0]} matches no allowed form"
    allowed = " | ".join(_form(a) for a in alts)
    return f"{head} ({detail}); allowed: {allowed}" if detail else f"{head}; allowed: {allowed}"


def nearest(value: Any, allowed: list[str]) -> str | None:
    """The allowed name nearest ``value`` (None when none is near): the one rule behind every
    'did you mean' of an unknown key, hyperparameter or name."""
    near = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.6)
    return near[0] if near else None


def did_you_mean(value: Any, allowed: list[str]) -> str:
    """' (did you mean 'x'?)' for ``nearest(value, allowed)``, '' when there is none."""
    near = nearest(value, allowed)
    return f" (did you mean {near!r}?)" if near else ""


def unknown_keys(given: Any, allowed: list[str]) -> str:
    """'\'resuts_dir\' was unexpected (did you mean \'results_dir\'?); allowed keys: ...'
    for the keys of ``given`` outside ``allowed``."""
    parts = []
    for k in [k for k in given if k not in allowed]:
        parts.append(f"{k!r} was unexpected{did_you_mean(k, allowed)}")
    return "; ".join(parts) + f"; allowed keys: {', '.join(allowed) or 'none'}"


RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "type")  # errors that get the allowed values


def _leaf(c) -> str:
    """An error inside the alternative a value was meant as: 'key=value; allowed: ...' for a
    value out of its range or of the wrong type (the field named, issue 34), else the message."""
    if c.validator in (*RANGE, "enum", "const") and c.relative_path:
        return f"{_path(c.relative_path)}={c.instance!r}; allowed: {describe_allowed(c.schema)}"
    return f"{_path(c.relative_path)}: {_message(c)}" if c.relative_path else _message(c)


def _message(e) -> str:
    if e.validator in ("oneOf", "anyOf") and e.context:
        return _alternatives(e)
    if e.validator == "additionalProperties" and isinstance(e.instance, dict) and e.validator_value is False:
        return unknown_keys(e.instance, list(e.schema.get("properties") or {}))
    if e.validator in RANGE:  # '...' is not of type 'number'; allowed: a finite number > 0
        return f"{e.message}; allowed: {describe_allowed(e.schema)}"
    return e.message


@cache
def _strict_class():
    import jsonschema

    base = jsonschema.Draft202012Validator
    # JSON Schema counts 20.0 as an integer; a config's 20.0 clients or 0.0 seed would name
    # its run k20.0 / seed0.0 and reload as another run: integers are ints here (not bools)
    integer = lambda _, x: isinstance(x, int) and not isinstance(x, bool)  # noqa: E731
    return jsonschema.validators.extend(base, type_checker=base.TYPE_CHECKER.redefine("integer", integer))


def strict_validator(fragment: dict[str, Any]):
    """A Draft 2020-12 validator of ``fragment`` whose integers are Python ints."""
    return _strict_class()(fragment)


def validate_schema(raw: dict[str, Any]) -> None:
    validator = strict_validator(schema())
    errors = sorted(validator.iter_errors(raw), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"{_path(e.absolute_path)}: {_message(e)}" for e in errors]
        raise FedForgetError("invalid config:\n  " + "\n  ".join(lines))
