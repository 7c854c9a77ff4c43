"""Joint training: the continual track's upper-bound reference row.

Every client trains on all of its data of every task from the first round on (all tasks'
data at once, through their transforms), with FedAvg's local step and
aggregation; the server's task schedule, the evaluation and the accuracy matrix are the
scenario's as for every method. It is what a federated model reaches with no stream at
all, the upper bound the continual papers compare against ("Joint" / "Ideal", fedgp.md
App. B) [D]. In a one-task scenario it is FedAvg, bit for bit.
"""

from __future__ import annotations

from .base import FedAvg
from .registry import METHODS


@METHODS.register("joint")
class Joint(FedAvg):
    name = "joint"
    sees_all_tasks = True  # the engine gives each client its data of every task, every round
