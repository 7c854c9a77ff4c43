"""``FedState``: everything a federated run carries from one round to the next, in one
object. The engine (``fedforget.engine``) and the methods (through ``ServerContext`` and
``ClientContext.state``) read and write it; a checkpoint (``fedforget.checkpoint``) is its
``state_dict()`` and nothing else, so what a resumed run continues from is exactly this.

Lifetimes [D]:

- the run: ``global_params`` (the global weights: their one home), ``server`` (the method's
  server state: SCAFFOLD's c, FedDyn's h, GPM's bases, teachers, ...), ``clients`` (each
  client's own state, kept across the rounds it is sampled in: SCAFFOLD's c_i, replay
  buffers, ...), the task progress (``task``, ``client_task``, ``task_reports``), the
  metrics rows so far (``rows``) and, in the state dict, the global RNG states;
- a round: ``ServerContext.broadcast``, the uploads and their extras, the clients'
  ``ClientContext`` with its ``scratch`` and ``stats`` (never checkpointed);
- a step: the locals of the method's ``client_step``.

The engine's own randomness is keyed by (seed, round, client) and needs no state; the
global RNG states cover models or methods that draw from the global generators.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

Params = dict[str, torch.Tensor]


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor inside (dicts, lists, tuples) moved to ``device``; other
    values unchanged. Tensors already there are returned as they are (no copy). Per-client
    method state goes to host memory between a client's rounds this way on a GPU."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_device(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_device(v, device) for v in obj)
    return obj


def model_copies(obj: Any, params: Params) -> tuple[float, int]:
    """How many copies of the model ``params`` (a state dict) ``obj`` holds: the bytes of its
    tensors (inside dicts, lists and tuples) shaped as one of ``params``' tensors or as all of
    them flattened, each storage counted once (a view of one is not another copy), over
    ``params``' bytes; and its other tensors' bytes (replay buffers, bases, ...). What a
    method's ``client_model_copies`` declares (tests/methods/test_resume_all_methods.py) and
    ``benchmarks/checkpoint_cost.py`` projects to a paper setting."""
    shapes = {tuple(v.shape) for v in params.values()}
    numel = sum(v.numel() for v in params.values())
    seen: set[tuple[int, str]] = set()
    model = other = 0

    def walk(x: Any) -> None:
        nonlocal model, other
        if isinstance(x, torch.Tensor):
            key = (x.untyped_storage().data_ptr(), str(x.device))
            if key in seen or x.numel() == 0:
                return
            seen.add(key)
            if tuple(x.shape) in shapes or x.numel() == numel:
                model += x.nbytes
            else:
                other += x.nbytes
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(obj)
    return model / sum(v.nbytes for v in params.values()), other


class OnFed:
    """An attribute of an object with a ``fed`` (a ``FedState``) that is that state's field
    ``name``: read and written there, its one home (``ServerContext.state`` is
    ``FedState.server``, ``Simulation.client_state`` is ``FedState.clients``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(obj.fed, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.fed, self.name, value)


@dataclass
class FedState:
    """The state of one run after its last completed round (``round``; 0: none yet)."""

    global_params: Params
    server: dict[str, Any] = field(default_factory=dict)
    clients: dict[int, dict[str, Any]] = field(default_factory=dict)
    round: int = 0
    task: int = 0  # the server's current task (fedforget.data.scenario)
    # the task each client last trained on; what clients that moved on to a later task sent
    # at their task's end, until the server's task ends (asynchronous boundaries)
    client_task: dict[int, int] = field(default_factory=dict)
    task_reports: dict[int, Any] = field(default_factory=dict)
    # per client, the task reports a later one replaced before the server's task end
    reports_replaced: dict[int, int] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)  # the metrics rows so far
    # not state, how it is kept: the training device (its RNG is saved on a GPU), and whether
    # per-client state lives in host memory between a client's rounds (on a GPU, so device
    # memory does not grow with the number of clients)
    device: torch.device = torch.device("cpu")
    offload_clients: bool = False

    def client(self, cid: int) -> dict[str, Any]:
        """Client ``cid``'s state (created empty the first time), on the training device."""
        st = self.clients.setdefault(cid, {})
        if self.offload_clients:
            st.update(to_device(st, self.device))
        return st

    def client_dicts(self) -> dict[str, dict[int, Any]]:
        """The fields keyed by client (``clients``, ``client_task``, ``task_reports``,
        ``reports_replaced``)."""
        return {"clients": self.clients, "client_task": self.client_task, "task_reports": self.task_reports,
                "reports_replaced": self.reports_replaced}  # fmt: skip

    def order_clients(self, before: dict[str, set[int]], cids: list[int]) -> None:
        """The entries of the fields keyed by client that are new since ``before`` (each
        field's keys then), in the order of ``cids``, after the older ones: the order in which
        clients trained one after another would have added them (clients trained at once add
        theirs as they finish; the order shows in the checkpoint and in any loop over a
        field), in place."""
        rank = {c: i for i, c in enumerate(cids)}
        for name, d in self.client_dicts().items():
            old = before.get(name, set())
            new = sorted((k for k in d if k not in old), key=lambda k: rank.get(k, len(rank)))
            items = [(k, d[k]) for k in d if k in old] + [(k, d[k]) for k in new]
            d.clear()
            d.update(items)

    def park(self, cid: int) -> None:
        """Client ``cid``'s state back to host memory until it is sampled again (on a GPU)."""
        if self.offload_clients and cid in self.clients:
            st = self.clients[cid]
            st.update(to_device(st, torch.device("cpu")))

    def state_dict(self) -> dict[str, Any]:
        """Everything a run needs to continue after ``round``, the global RNG states
        included. Tensors stay where they are (the checkpoint writer moves them); the layout
        is that of checkpoint format 3 (``checkpoint.restore`` says which older ones load)."""
        rng: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        }
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "round": self.round,
            "global_params": self.global_params,
            "server_state": self.server,
            "client_state": self.clients,
            "tasks": {"server": self.task, "clients": self.client_task, "reports": self.task_reports,
                      "replaced": self.reports_replaced},
            "rows": self.rows,
            "rng": rng,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s output (its parameter keys are checked by the
        caller); the global RNGs are set to where they were."""
        self.round = d["round"]
        self.global_params = d["global_params"]
        self.server = d["server_state"]
        self.clients = d["client_state"]
        self.task = d["tasks"]["server"]
        self.client_task = d["tasks"]["clients"]
        self.task_reports = d["tasks"]["reports"]
        self.reports_replaced = dict(d["tasks"].get("replaced", {}))  # (counted since 2026-12-06)
        self.rows = [dict(r) for r in d["rows"]]
        for cid in self.clients:
            self.park(cid)
        rng = d["rng"]  # RNG states are CPU byte tensors (a checkpoint read with map_location=cuda moved them)
        torch.set_rng_state(rng["torch"].cpu())
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"].cpu(), self.device)
