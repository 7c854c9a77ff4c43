"""Run one training job and write its outputs: metrics.csv (one row per round, rewritten
atomically after every round; deterministic: no wall-clock values), timings.csv (the
per-round wall-clock times), tasks.csv (the global model's accuracy on every task of the
scenario after every evaluated round) and accuracy_matrix.csv (a[t][i] after each task t,
``fedforget.continual``), checkpoint.pt while the run is unfinished, run.json (resolved
config, its hash, versions, device, wall time, status), model.pt (final global weights) and, for the rounds in
train.save_client_models, snapshots/round<r>.pt (global model before and after the round and
every sampled client's local model)."""

from __future__ import annotations

import datetime as dt
import logging
import math
import os
import shutil
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from .checkpoint import CHECKPOINT, CODE_DIGEST, load_checkpoint
from .config import RunConfig
from .continual import accuracy_matrix_rows
from .engine import BASE_COLUMNS, TIMING_COLUMNS, Simulation
from .memory import PhaseMemory, process_peak_mb
from .methods import METHODS
from .provenance import NUMERIC, git_commit, inputs_of, training_code, versions_differ
from .utils import (
    FedForgetError,
    atomic_torch_save,
    atomic_write_json,
    atomic_write_text,
    dir_lock,
    first_line,
    is_out_of_memory,
    package_versions,
)

log = logging.getLogger(__name__)

TASK_COLUMNS = ["round", "current_task", "task", "accuracy", "loss"]



def format_value(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        return repr(v)
    return str(v)


def table_csv(rows: list[dict[str, Any]], first: list[str], exclude: frozenset[str] = frozenset()) -> str:
    """CSV of ``rows``: the ``first`` columns in order, then every other key (sorted)."""
    extra = sorted({k for r in rows for k in r} - set(first) - exclude)
    cols = first + extra
    lines = [",".join(cols)] + [",".join(format_value(r.get(c)) for c in cols) for r in rows]
    return "\n".join(lines) + "\n"


def metrics_csv(rows: list[dict[str, Any]]) -> str:
    """metrics.csv: BASE_COLUMNS then the method's and diagnostics' columns; no timings
    and no per-task rows (tasks.csv)."""
    return table_csv(rows, BASE_COLUMNS, frozenset([*TIMING_COLUMNS, "_tasks"]))


def tasks_csv(rows: list[dict[str, Any]]) -> str:
    """tasks.csv: the global model's accuracy and loss on every task after every evaluated
    round (``fedforget.evaluation``), one row per (round, task)."""
    return table_csv([r for row in rows for r in row.get("_tasks", [])], TASK_COLUMNS)


def timings_csv(rows: list[dict[str, Any]]) -> str:
    """timings.csv: the wall-clock columns only."""
    return table_csv([{c: r.get(c) for c in TIMING_COLUMNS} for r in rows], TIMING_COLUMNS)


def peak_memory(device: torch.device, phases: PhaseMemory | None = None) -> dict[str, float]:
    """run.json's memory record of the process that ran the job (its last segment, if it was
    resumed): ``peak_rss_mb``, the process's own peak resident memory
    (``fedforget.memory.process_peak_mb``; the process may have run other work before, as
    tests do), and on a GPU ``peak_gpu_memory_mb``, the
    most memory torch allocated on it during the run (``torch.cuda.max_memory_allocated``,
    reset when the run started). Each phase resets the peak it measures (``phases``,
    ``fedforget.memory``), so the run's peak is the largest of the phases' and the peak
    since the last reset. FedProTIP Fig. 6 (figure ``run_cost``); per phase, Fig. 7
    (run.json's ``peak_memory_by_phase_mb``, figure ``phase_memory``)."""
    run = phases.run_peak_mb() if phases is not None else None
    out = {"peak_rss_mb": process_peak_mb()}
    if device.type == "cuda":
        out["peak_gpu_memory_mb"] = max(torch.cuda.max_memory_allocated(device) / 2**20, run or 0.0)
    elif run is not None:
        out["peak_rss_mb"] = max(out["peak_rss_mb"], run)
    return out


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def where_it_runs(device: torch.device) -> dict[str, Any]:
    """The machine and scheduler slot a run executes on, for run.json: the host, the GPU it
    was given (CUDA_VISIBLE_DEVICES as the scheduler set it; torch numbers the visible GPUs
    from 0) and whether TF32 was allowed there, and, under SLURM, the job and step ids (a
    resumed run records the job that finished it; the run it resumed is in
    ``resumed_after_round``)."""
    out: dict[str, Any] = {"hostname": socket.gethostname()}
    for key in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_JOB_PARTITION"):
        if key in os.environ:
            out[key.lower()] = os.environ[key]
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        # [D] PyTorch's defaults are left as they are (what code that sets no flag runs with): on
        # Ampere and newer GPUs cuDNN's convolutions may use TF32 (10-bit mantissa inputs,
        # fp32 accumulation) in an fp32 run, matrix products not; recorded with the run
        out["tf32"] = {"cudnn_conv": torch.backends.cudnn.allow_tf32, "matmul": torch.backends.cuda.matmul.allow_tf32}
    return out


RESUME_HOST = "resume_host"  # the checkpoint's record of what else computed it (resume_host)


def resume_host(cfg: RunConfig, device: torch.device, versions: dict[str, str]) -> dict[str, Any]:
    """What a checkpoint's rounds were computed from besides config and code: the input files
    (``provenance.inputs_of``: dataset, public set, partition), the versions of the numeric
    packages (of ``versions``, run.json's ``package_versions``), the device type and GPU
    model; a run resumes only where all are the same."""
    return {
        "inputs": inputs_of(cfg),
        "versions": {k: versions.get(k) for k in NUMERIC},
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }


def check_resume_host(ckpt: dict[str, Any], now: dict[str, Any], path: Path) -> tuple[bool, str | None]:
    """Whether checkpoint ``ckpt`` may continue on ``now`` (``resume_host``), and a note for
    run.json [D]. Other input files (the data or partition prepared again): no, another
    computation, as another config is (the caller starts over). Other package versions or
    device type: a FedForgetError (a resume there would equal neither run; delete the
    checkpoint, or ``--fresh``, to start over). Another GPU model (a cluster's retry on another
    node): yes, with a warning and the note, as GPU results are not bit-reproducible across
    models anyway. A checkpoint written before the record resumes."""
    had = ckpt.get(RESUME_HOST)
    if had is None:
        return True, None
    if had["inputs"] != now["inputs"]:
        changed = [f for f in set(had["inputs"]) | set(now["inputs"]) if had["inputs"].get(f) != now["inputs"].get(f)]
        log.warning("%s: checkpoint computed from other input files (%s), starting over", path, ", ".join(sorted(changed)))
        return False, None
    other = versions_differ(had["versions"], now["versions"])
    if had["device"] != now["device"]:
        other.append(f"device {had['device']} (now {now['device']})")
    if other:
        raise FedForgetError(
            f"checkpoint {path} was computed with {', '.join(other)}: a resumed run would equal neither run; "
            "resume where it was computed, or delete the checkpoint (fedforget train --fresh) to start this run over"
        )
    if had["gpu"] != now["gpu"]:
        note = f"rounds up to the checkpoint's trained on a {had['gpu']}, the rest on a {now['gpu']}"
        log.warning("%s: %s", path, note)
        return True, note
    return True, None


def config_sizes(cfg: RunConfig) -> list[tuple[str, int | float]]:
    """The numbers a run's config sets that may size what it allocates (the batch sizes, the
    clients, a dataset's, model's or method's numeric options as written: a real one may
    scale a size, FOT's ``sketch_factor`` its sketches' width), largest first."""
    t, ds = cfg.train, cfg.dataset
    found = [("train.batch_size", t.batch_size), ("train.eval_batch_size", t.eval_batch_size),
             ("train.max_parallel_clients", t.max_parallel_clients), ("train.concurrent_clients", t.concurrent_clients),
             ("partition.clients", cfg.partition.clients)]  # fmt: skip
    for prefix, opts in (("dataset.options", ds.options), ("dataset.model.options", ds.model_options),
                         ("method.params", cfg.method.params)):  # fmt: skip
        for k, v in (opts or {}).items():
            vs = v if isinstance(v, list) else [v]
            if vs and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vs):
                found.append((f"{prefix}.{k}", max(vs)))
    return sorted(found, key=lambda kv: -kv[1])


def out_of_memory_error(e: BaseException, cfg: RunConfig, device: str, rnd: int | None) -> FedForgetError:
    """[D] One error for a job out of memory anywhere (building the model, a method's modules
    or buffers, a round): what failed, where, and the sizes the config sets, largest first
    (a value typed too large, ``buffer_size: 10**12``, heads the list), in place of a
    traceback. The batched engine's own groups name their knob (``LocalTrainer.out_of_memory``)."""
    first = first_line(e)
    where = "while setting up the run" if rnd is None else f"in round {rnd}"  # (round 0: the first evaluation)
    sizes = ", ".join(f"{k}={v}" for k, v in config_sizes(cfg)[:6])
    return FedForgetError(
        f"out of memory on {device} {where} ({first}); the largest sizes this run's config sets: {sizes}"
    )


def run_training(
    cfg: RunConfig, out_dir: str | Path, progress: bool | None = None, resume: bool = True
) -> dict[str, Any]:
    """Train one job into ``out_dir``. With ``resume`` (default) a checkpoint.pt left there
    by an interrupted run of the same config is continued from its round; the outputs are
    then identical to an uninterrupted run's (metrics.csv byte for byte on CPU). Without it
    the checkpoint is deleted first. One process at a time (``dir_lock``)."""
    out = Path(out_dir)
    with dir_lock(out, "training a run"):
        return _run_training(cfg, out, progress, resume)


def _run_training(cfg: RunConfig, out: Path, progress: bool | None, resume: bool) -> dict[str, Any]:
    for tmp in out.glob(".*.tmp"):  # left by a writer killed mid-write (atomic_write, finished.keep)
        if tmp.is_dir():
            shutil.rmtree(tmp)
        else:
            tmp.unlink(missing_ok=True)
    ckpt_path = out / CHECKPOINT
    if not resume:  # --fresh / --force: a later plain start must not resume it either
        ckpt_path.unlink(missing_ok=True)
    code = training_code(cfg.method.name, cfg.method.params)
    config = cfg.to_dict()
    record: dict[str, Any] = {
        "status": "running",
        "config": config,
        # the method's variant in words, for the tables' notes (FedAvg.table_note), so that
        # aggregating needs neither the methods nor torch
        "method_note": METHODS.get(cfg.method.name).table_note(config["method"].get("params") or {}),
        "config_hash": cfg.hash,
        "code_digest": code.digest,  # fedforget.provenance: the source this run executes
        "code_digest_form": code.form,  # its canonical form (provenance.recorded_form)
        "code_files": code.files,
        "git": git_commit(),
        "versions": package_versions(),
        "started_at": _now(),
    }
    atomic_write_json(out / "run.json", record)
    t0 = time.perf_counter()
    sim: Simulation | None = None
    written: list[dict[str, Any]] = []
    try:
        sim = Simulation(cfg)
        if sim.device.type == "cuda":  # this run's peak (run.json: peak_gpu_memory_mb)
            torch.cuda.reset_peak_memory_stats(sim.device)
        record["device"] = str(sim.device)
        record["host"] = where_it_runs(sim.device)
        record["torch_threads"] = torch.get_num_threads()
        record["client_threads"] = sim.trainer.client_threads()  # fewer with train.concurrent_clients
        record.update(sim.engine_info)
        ckpt = load_checkpoint(ckpt_path, cfg, sim.device, code.digest) if resume else None
        host = resume_host(cfg, sim.device, record["versions"])
        if ckpt is not None:
            resumes, note = check_resume_host(ckpt, host, ckpt_path)
            if not resumes:
                ckpt_path.unlink()
                ckpt = None
            elif note:
                record["resumed_on_another_gpu"] = note
        if ckpt is not None:
            record["resumed_after_round"] = ckpt["round"]
        else:  # a run from round 0: snapshots an earlier run left here are not this run's
            shutil.rmtree(out / "snapshots", ignore_errors=True)
        atomic_write_json(out / "run.json", record)  # where it runs, while it runs
        written[:] = list(ckpt["rows"]) if ckpt else []

        def on_row(row: dict[str, Any]) -> None:  # metrics so far, complete after every round
            written.append(row)
            atomic_write_text(out / "metrics.csv", metrics_csv(written))
            atomic_write_text(out / "timings.csv", timings_csv(written))
            atomic_write_text(out / "tasks.csv", tasks_csv(written))

        def on_checkpoint(state: dict[str, Any]) -> None:
            atomic_torch_save(ckpt_path, {**state, CODE_DIGEST: code.digest, RESUME_HOST: host})
        snap_dir = out / "snapshots"

        def save_snapshot(rnd: int, snap: dict[str, Any]) -> None:
            snap_dir.mkdir(exist_ok=True)
            atomic_torch_save(snap_dir / f"round{rnd:04d}.pt", snap)

        status, rows, message = sim.run(
            on_row=on_row,
            progress=progress,
            on_snapshot=save_snapshot,
            on_checkpoint=on_checkpoint,
            resume=ckpt,
        )  # on_row has written metrics.csv, timings.csv and tasks.csv with every row
        sc = sim.scenario
        matrix = accuracy_matrix_rows([r for row in rows for r in row.get("_tasks", [])], sc.tasks, sc.rounds_per_task)
        atomic_write_text(out / "accuracy_matrix.csv", table_csv(matrix, ["after_task", "task", "accuracy"]))
        atomic_torch_save(out / "model.pt", {k: v.cpu() for k, v in sim.global_params.items()})
    except BaseException as e:
        oom = None
        if is_out_of_memory(e):
            where = str(sim.device) if sim else f"train.device {cfg.train.device!r}"
            oom = out_of_memory_error(e, cfg, where, None if sim is None else max((r["round"] for r in written), default=-1) + 1)
        record.update(
            status="failed",
            error=f"{type(e).__name__}: {e}" if oom is None else f"FedForgetError: {oom}",
            traceback=traceback.format_exc(),
            wall_time_s=time.perf_counter() - t0,
            finished_at=_now(),
        )
        if sim is not None:
            record.update(checkpoints_written=sim.checkpoints.written, checkpoint_write_s=sim.checkpoints.write_s)
        atomic_write_json(out / "run.json", record)
        if oom is not None:
            raise oom from None
        raise
    accs = [
        r["global_model_test_acc"]
        for r in rows
        if r["round"] > 0 and r.get("global_model_test_acc") is not None
    ]
    record.update(  # the thread counts it ran on (a resume continues on its checkpoint's)
        torch_threads=torch.get_num_threads(),
        client_threads=sim.trainer.client_threads(),
        status=status,
        message=message,
        rounds_completed=max(r["round"] for r in rows),
        final_global_model_test_acc=accs[-1] if accs and status == "completed" else None,
        best_global_model_test_acc=max(accs) if accs else None,
        wall_time_s=time.perf_counter() - t0,
        finished_at=_now(),
        checkpoints_written=sim.checkpoints.written,  # by this process (train.checkpoint_every)
        checkpoint_write_s=sim.checkpoints.write_s,
        **peak_memory(sim.device, sim.memory),
    )
    if sim.memory.enabled:  # train.phase_memory
        record["peak_memory_by_phase_mb"] = dict(sim.memory.peaks)
    if sim.fed.reports_replaced:  # asynchronous boundaries: task reports a later one replaced
        record["task_reports_replaced"] = sum(sim.fed.reports_replaced.values())
    atomic_write_json(out / "run.json", record)
    ckpt_path.unlink(missing_ok=True)  # the run is over: its outputs are complete
    log.info("%s: %s after %d rounds", out, status, record["rounds_completed"])
    return record
