"""Peak memory per phase of a run (FedProTIP Fig. 7: "the maximum GPU memory allocated at
each training phase").

``PhaseMemory(device).phase(name)`` around each phase of a round (``PHASES``, as the engine
names them: local training, aggregation, the task-end exchanges, the round-end exchange,
evaluation)
resets the peak before it and keeps the largest peak seen in it over the run, in MB
(2^20 bytes): on a GPU ``torch.cuda.max_memory_allocated`` (what torch allocated, as run.json's
``peak_gpu_memory_mb``); on a CPU the process's peak resident memory (``VmHWM``, reset by
writing 5 to /proc/self/clear_refs, Linux), which includes the data and models held
throughout, so a phase's number is the process's size at that phase's peak [D]. Where the
peak cannot be reset (no such file, or it refuses the write) nothing is recorded on a CPU:
an unreset peak is the run's so far, not the phase's. Resetting lowers the process's peak
(``process_peak_mb``) too, so the run's peak is the largest of the phases' (``run_peak_mb``)."""

from __future__ import annotations

import resource
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from .utils import host_memory_limit

CLEAR_REFS, STATUS = Path("/proc/self/clear_refs"), Path("/proc/self/status")
PHASES = ("train", "aggregate", "task_end", "round_end", "evaluate")  # in the order of a round


class PhaseMemory:
    """``enabled`` (``train.phase_memory``): off, a phase measures nothing and resets no peak
    (the run's peak stays what ``torch`` and ``process_peak_mb`` report, as benchmark scripts read)."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.device, self.enabled = device, enabled
        self.peaks: dict[str, float] = {}  # phase -> MB, the largest over the run
        self.cpu_ok = enabled and (device.type == "cuda" or (reset_process_peak() and _vm_hwm_mb() is not None))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.cpu_ok:
            self.cpu_ok = reset_process_peak()
        try:
            yield
        finally:
            mb = self.peak_mb()
            if mb is not None:
                self.peaks[name] = max(self.peaks.get(name, 0.0), mb)

    def peak_mb(self) -> float | None:
        """The peak since the last reset (MB), or None where it cannot be told apart."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        return _vm_hwm_mb() if self.cpu_ok else None

    def run_peak_mb(self) -> float | None:
        """The largest peak of the phases (None before any was recorded)."""
        return max(self.peaks.values()) if self.peaks else None


def reset_process_peak() -> bool:
    """Reset the process's peak resident memory (``process_peak_mb`` counts from here: Linux,
    writing 5 to /proc/self/clear_refs); False where the system refuses."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def _vm_hwm_mb() -> float | None:
    return status_mb("VmHWM")


def process_peak_mb() -> float:
    """This process's own peak resident memory in MB: ``VmHWM`` (its address space's peak since
    it was made, or since a phase reset it), else ``getrusage``'s ``ru_maxrss``.

    [D] Not ``ru_maxrss`` first: Linux carries into it the peak of the address space a process
    replaced when it started its program (``exec``), and Python's ``subprocess`` starts one from
    its parent's (vfork), so a job started by a large process (a benchmark that prepared its
    data, Snakemake, a shell that ``exec``s the command) reports its parent's peak where that is
    larger: torchvision's ResNet-18 training on 60,000 CIFAR-shaped rows read 3,654 MiB so
    (benchmarks/results/cpu-2026-12-07-m/) where its own peak was 2,119 (cpu-2026-12-08/)."""
    own = _vm_hwm_mb()
    return own if own is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def status_mb(field: str) -> float | None:
    """The process's ``field`` of /proc/self/status (VmHWM: its peak resident memory since the
    last reset, VmRSS: its resident memory now) in MB (2^20 bytes); None where it cannot be read."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_limit(device: torch.device) -> tuple[int, str] | None:
    """The memory of ``device`` (bytes) and its name: a GPU's own, else ``host_memory_limit``."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"the memory of {device} ({props.name})"
    return host_memory_limit() if device.type == "cpu" else None
