"""Federated methods. Each is one module on the hook API of ``base.py``."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any

from .base import (
    ClientContext,
    ClientShape,
    FedAvg,
    RunInfo,
    ServerContext,
    Upload,
    weighted_average,
)
from .params import make_params
from .registry import METHODS

# import every method module so that it registers itself: adding a method is adding a file
for _m in pkgutil.iter_modules(__path__):
    if _m.name not in ("base", "registry"):
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = [
    "METHODS",
    "ClientContext",
    "ClientShape",
    "FedAvg",
    "RunInfo",
    "ServerContext",
    "Upload",
    "check_params",
    "make_params",
    "weighted_average",
]


def check_params(name: str, params: dict[str, Any], key: str = "params") -> dict[str, Any]:
    """Validate a method's hyperparameters; return them with defaults filled in."""
    return dataclasses.asdict(make_params(name, params, key))
