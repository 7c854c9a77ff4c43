"""Federated methods. Each is one module on the hook API of ``base.py``."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any

from ..utils import FedForgetError
from .base import ClientContext, FedAvg, RunInfo, ServerContext, Upload, weighted_average
from .registry import METHODS

# import every method module so that it registers itself: adding a method is adding a file
for _m in pkgutil.iter_modules(__path__):
    if _m.name not in ("base", "registry"):
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = [
    "METHODS",
    "ClientContext",
    "FedAvg",
    "RunInfo",
    "ServerContext",
    "Upload",
    "check_params",
    "make_params",
    "weighted_average",
]


def make_params(name: str, params: dict[str, Any], key: str = "params") -> Any:
    cls = METHODS.get(name)
    allowed = {f.name for f in dataclasses.fields(cls.Params)}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise FedForgetError(
            f"{key}: unknown hyperparameter(s) {unknown} for method '{name}'; allowed: {sorted(allowed) or 'none'}"
        )
    try:
        p = cls.Params(**params)
        p.check()
    except (TypeError, ValueError) as e:
        raise FedForgetError(f"{key} (method '{name}'): {e}") from None
    return p


def check_params(name: str, params: dict[str, Any], key: str = "params") -> dict[str, Any]:
    """Validate a method's hyperparameters; return them with defaults filled in."""
    return dataclasses.asdict(make_params(name, params, key))
