"""Checkpoints of a run: its ``FedState`` (``fedforget.state``: global weights, the
method's server and per-client state, task progress, the metrics so far, the global RNG
states) with the format and config hash, and how it is put back. The runner writes them atomically after every ``train.checkpoint_every``
rounds; a resumed run equals an uninterrupted one byte for byte on a CPU."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from .config import RunConfig
from .state import FedState
from .utils import FedForgetError

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 2  # 2: the scenario's progress (tasks)
CHECKPOINT = "checkpoint.pt"  # in the run directory while the run is unfinished


def checkpoint_of(fed: FedState, config_hash: str) -> dict[str, Any]:
    """The checkpoint of a run after its round ``fed.round``: ``fed.state_dict()`` with the
    format and the config hash it belongs to."""
    return {"format": CHECKPOINT_FORMAT, "config_hash": config_hash, **fed.state_dict()}


def restore(fed: FedState, ckpt: dict[str, Any], config_hash: str) -> None:
    """Put a checkpoint into ``fed`` (checked: format, config hash, parameter keys)."""
    if ckpt.get("format") != CHECKPOINT_FORMAT:
        raise FedForgetError(f"checkpoint format {ckpt.get('format')!r}; this fedforget reads {CHECKPOINT_FORMAT}")
    if ckpt["config_hash"] != config_hash:
        raise FedForgetError(
            f"checkpoint is of config {ckpt['config_hash'][:12]}, not this run's {config_hash[:12]}"
        )
    if ckpt["global_params"].keys() != fed.global_params.keys():
        raise FedForgetError("checkpoint weights do not match the model's parameters")
    fed.load_state_dict(ckpt)


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
