"""Run one training job and write its outputs: metrics.csv (one row per round, rewritten
atomically after every round), run.json (resolved config, its hash, versions, device, wall
time, status), model.pt (final global weights) and, for the rounds in
train.save_client_models, snapshots/round<r>.pt (global model before and after the round and
every sampled client's local model)."""

from __future__ import annotations

import datetime as dt
import logging
import math
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from .config import RunConfig
from .engine import BASE_COLUMNS, Simulation
from .utils import atomic_write, atomic_write_json, atomic_write_text, package_versions

log = logging.getLogger(__name__)


def format_value(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        return repr(v)
    return str(v)


def metrics_csv(rows: list[dict[str, Any]]) -> str:
    extra = sorted({k for r in rows for k in r} - set(BASE_COLUMNS))
    cols = BASE_COLUMNS + extra
    lines = [",".join(cols)] + [",".join(format_value(r.get(c)) for c in cols) for r in rows]
    return "\n".join(lines) + "\n"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def run_training(
    cfg: RunConfig, out_dir: str | Path, progress: bool | None = None
) -> dict[str, Any]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "status": "running",
        "config": cfg.to_dict(),
        "config_hash": cfg.hash,
        "versions": package_versions(),
        "started_at": _now(),
        "engine": "sequential",
    }
    atomic_write_json(out / "run.json", record)
    t0 = time.perf_counter()
    try:
        sim = Simulation(cfg)
        record["device"] = str(sim.device)
        record["torch_threads"] = torch.get_num_threads()
        snap_dir = out / "snapshots"

        def save_snapshot(rnd: int, snap: dict[str, Any]) -> None:
            snap_dir.mkdir(exist_ok=True)
            atomic_write(snap_dir / f"round{rnd:04d}.pt", lambda tmp: torch.save(snap, tmp))

        status, rows, message = sim.run(progress=progress, on_snapshot=save_snapshot)
        atomic_write_text(out / "metrics.csv", metrics_csv(rows))
        atomic_write(
            out / "model.pt",
            lambda tmp: torch.save({k: v.cpu() for k, v in sim.global_params.items()}, tmp),
        )
    except BaseException as e:
        record.update(
            status="failed",
            error=f"{type(e).__name__}: {e}",
            traceback=traceback.format_exc(),
            wall_time_s=time.perf_counter() - t0,
            finished_at=_now(),
        )
        atomic_write_json(out / "run.json", record)
        raise
    accs = [
        r["global_model_test_acc"]
        for r in rows
        if r["round"] > 0 and r.get("global_model_test_acc") is not None
    ]
    record.update(
        status=status,
        message=message,
        rounds_completed=max(r["round"] for r in rows),
        final_global_model_test_acc=accs[-1] if accs and status == "completed" else None,
        best_global_model_test_acc=max(accs) if accs else None,
        wall_time_s=time.perf_counter() - t0,
        finished_at=_now(),
    )
    atomic_write_json(out / "run.json", record)
    log.info("%s: %s after %d rounds", out, status, record["rounds_completed"])
    return record
