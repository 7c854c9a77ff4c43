"""FedAvg: the base class in ``base.py`` is FedAvg; this registers it by name."""

from .base import FedAvg
from .registry import METHODS

METHODS.register("fedavg")(FedAvg)
