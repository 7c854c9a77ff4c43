"""Checkpoints of a run: what a run needs to continue after a round (global weights, the
method's server and per-client state, the metrics so far, the global RNG states), and how
it is put back. The runner writes them atomically after every ``train.checkpoint_every``
rounds; a resumed run equals an uninterrupted one byte for byte on a CPU."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .methods.base import to_device
from .utils import FedForgetError

if TYPE_CHECKING:
    from .config import RunConfig
    from .engine import Simulation

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 2  # 2: the scenario's progress (tasks)
CHECKPOINT = "checkpoint.pt"  # in the run directory while the run is unfinished


def capture(sim: Simulation, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Everything a run needs to continue after the last round in ``rows``: the global
    weights, the method's server and per-client state (``server.state``,
    ``ClientContext.state``: SCAFFOLD's control variates, FedDyn's h, teachers, ...),
    the metrics so far and the global RNG states (the engine's own randomness is keyed
    by (seed, round, client) and needs none; these cover models or methods that draw
    from the global generators). Tensors stay where they are; the writer moves them."""
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if sim.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(sim.device)
    return {
        "format": CHECKPOINT_FORMAT,
        "config_hash": sim.cfg.hash,
        "round": rows[-1]["round"],
        "global_params": sim.global_params,
        "server_state": sim.server.state,
        "client_state": sim.client_state,
        # the scenario's progress: the server's task, each client's last task, reports of
        # clients that ended a task before the server did (asynchronous boundaries)
        "tasks": {"server": sim.server.task, "clients": sim.client_task, "reports": sim.task_reports},
        "rows": rows,
        "rng": rng,
    }


def restore(sim: Simulation, ckpt: dict[str, Any]) -> None:
    """Put a checkpoint's state into ``sim`` (checked: format, config hash, parameter keys)."""
    if ckpt.get("format") != CHECKPOINT_FORMAT:
        raise FedForgetError(f"checkpoint format {ckpt.get('format')!r}; this fedforget reads {CHECKPOINT_FORMAT}")
    if ckpt["config_hash"] != sim.cfg.hash:
        raise FedForgetError(
            f"checkpoint is of config {ckpt['config_hash'][:12]}, not this run's {sim.cfg.hash[:12]}"
        )
    if ckpt["global_params"].keys() != sim.global_params.keys():
        raise FedForgetError("checkpoint weights do not match the model's parameters")
    sim.global_params = ckpt["global_params"]
    sim.server.global_params = sim.global_params
    sim.server.state = ckpt["server_state"]
    sim.client_state = ckpt["client_state"]
    sim.server.task = ckpt["tasks"]["server"]
    sim.client_task = ckpt["tasks"]["clients"]
    sim.task_reports = ckpt["tasks"]["reports"]
    if sim.offload_client_state:
        for st in sim.client_state.values():
            st.update(to_device(st, torch.device("cpu")))
    rng = ckpt["rng"]  # RNG states are CPU byte tensors (a checkpoint read with map_location=cuda moved them)
    torch.set_rng_state(rng["torch"].cpu())
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if "cuda" in rng and sim.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"].cpu(), sim.device)


def load_checkpoint(path: Path, cfg: RunConfig, device: torch.device) -> dict[str, Any] | None:
    """The run's checkpoint, or None if there is none or it belongs to another config (a
    stale file from before the config changed: removed, the run starts over)."""
    if not path.exists():
        return None
    try:
        ckpt = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling error means a damaged file
        raise FedForgetError(
            f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); delete it to start this run over"
        ) from None
    if not isinstance(ckpt, dict) or "config_hash" not in ckpt:
        raise FedForgetError(f"checkpoint {path} is not a fedforget checkpoint; delete it to start this run over")
    if ckpt["config_hash"] != cfg.hash:
        log.warning("%s: checkpoint of another config (%s), starting over", path, ckpt["config_hash"][:12])
        path.unlink()
        return None
    return ckpt
