"""Snakemake's SLURM executor with a group's jobs run at once in their submission (issue 32,
item 5: several training jobs share one GPU inside one SLURM submission).

snakemake-executor-plugin-slurm submits a group of jobs (``groups``, ``group-components``) as
one sbatch job and runs them inside it with ``--executor slurm-jobstep --jobs 1``, one after
another, even where they fit side by side (that plugin's issue #469; seen on this project's
test cluster). Training jobs that each leave most of a GPU idle then cannot share it.

``--executor slurm-packed`` is that plugin unchanged except inside a group's submission [D]:
there Snakemake's local executor runs the group's jobs, all at once (its ``--cores`` is the sum
of their threads), in the submission's allocation (its CPUs, memory and GPUs: every job sees
the same GPU), each as its rule's command; a job outside a group is submitted and run as the
SLURM plugin runs it. The submission asks what the SLURM plugin would ask for the group:
Snakemake lays the group's jobs out one after another wherever each needs the whole of a
capped resource (a GPU per submission), so it asks the largest job's memory and CPUs and the
sum of their runtimes. Give each grouped job the whole submission's memory and CPUs
(profiles/slurm); the summed runtime is an upper bound. Settings are the SLURM plugin's, under
this plugin's prefix (``--slurm-packed-no-account``; ``slurm-packed-status-command: squeue`` in
a profile). Tested against a real scheduler: tests/test_slurm.py.

Memory [D]: jobs run at once share the submission's memory (``mem_mb``, SLURM's limit for the
whole submission). Each is a process that takes some of it for itself (Python, torch, on a GPU
the CUDA context and its libraries, on a CPU the activations): the setting ``process-mb``
(``slurm-packed-process-mb``), by default ``PROCESS_MB``. And a method that keeps state per
client across rounds holds it there (copies of the model: SCAFFOLD, FedDyn, MOON, FedCurv;
replay buffers, exemplars, GPM's bases at their fullest): the train rule declares each job's as
its resource ``client_state_mb`` (``fedforget.parse.client_state_mb``). Where a group's jobs
need more together (their ``client_state_mb`` and ``process-mb`` each) than the submission's
``mem_mb``, the local executor inside runs at once only as many as fit (``packing``): at most K
of them (its ``--cores``: the threads of the K jobs with the fewest) with at most C MiB of per-client state
together (``--resources client_state_mb=C``), C + K x ``process-mb`` <= ``mem_mb``, so any jobs
it runs together fit; K is the one that runs the most of the largest jobs at once. A job whose
state and process do not fit ``mem_mb`` even alone runs alone. The submission's runtime, the
sum of its jobs', still covers them one after another. A warning names the jobs.

Two settings of its own: ``process-mb`` (above) and ``max-seconds-between-status-checks`` [D].
The SLURM plugin polls a submission 40 s (``init-seconds-before-status-checks``) after it is
sent, then waits 10 s longer each time no job has finished, up to 180 s: considerate of a shared
cluster's controller, but a half-minute job is then seen done after a minute. On a cluster of your own, a cap of a few
seconds lets short jobs (small embedded configs, a test cluster) follow one another at once;
unset (the default) keeps the SLURM plugin's schedule.
"""

import threading
from dataclasses import dataclass, field
from typing import Optional

from snakemake_executor_plugin_slurm import Executor as SlurmExecutor
from snakemake_executor_plugin_slurm import ExecutorSettings as SlurmSettings
from snakemake_executor_plugin_slurm import common_settings

__all__ = ["PROCESS_MB", "Executor", "ExecutorSettings", "common_settings", "machine_warning", "packing", "state_need",
           "state_of"]

STATE = "client_state_mb"  # the train rule's resource (workflow/rules/train.smk)
# [D] host MB one training process takes besides its per-client state, by default: the H200's
# ResNet-18 training process (2,857 MB: benchmarks/packing.py, results/h200-2026-11-27/run2,
# read as ru_maxrss, so at most that) rounded up; on a CPU a model's activations are in host
# memory too (benchmarks/process_memory.py: docs/cluster.md)
PROCESS_MB = 3000


def state_of(job) -> int:
    """The MiB of per-client state ``job`` keeps (its ``client_state_mb``; 0 where unset)."""
    return int(job.resources.get(STATE, 0) or 0)


def state_need(jobs) -> int:
    """The MiB of per-client state ``jobs`` keep together."""
    return sum(state_of(j) for j in jobs)


def packing(jobs, mem_mb, process_mb: int = PROCESS_MB) -> tuple[int, int | None] | None:
    """How the local executor runs ``jobs`` in one submission of ``mem_mb`` MB, each job a
    process of ``process_mb`` MB besides its ``client_state_mb``: None where they all fit at
    once (or the submission asks no memory); else (K, C): at most K of them at once, with at
    most C MiB of per-client state together (None: no cap beyond K), C + K x ``process_mb``
    <= ``mem_mb``. Of the K whose C lets the largest job run, the one that runs the most of
    the largest jobs together (the larger K on a tie); (1, None) where none does."""
    if isinstance(mem_mb, bool) or not isinstance(mem_mb, int | float) or mem_mb <= 0:
        return None
    states = sorted(state_of(j) for j in jobs)
    n, mem_mb = len(states), int(mem_mb)
    if sum(states) + n * process_mb <= mem_mb:
        return None
    best: tuple[int, int, int] | None = None  # (largest jobs together, K, C)
    for k in range(n, 0, -1):
        cap = mem_mb - k * process_mb
        if cap < states[-1]:
            continue  # the largest job could not run
        together, held = 0, 0
        for s in reversed(states[-k:]):
            if held + s > cap:
                break
            together, held = together + 1, held + s
        if best is None or together > best[0]:
            best = (together, k, cap)
    if best is None:
        return 1, None
    _, k, cap = best
    return k, (cap if sum(states[-k:]) > cap else None)


def machine_warning(jobs, slots: int | None, cores: int | None, threads: int, limit: tuple[int, str],
                    process_mb: int = PROCESS_MB) -> str | None:  # fmt: skip
    """The same rule on one machine (Snakemake's local executor: profiles/gpu) [D]: of the
    training ``jobs`` to run, at most ``slots`` (gpu_slots) and ``cores // threads`` run
    together, in the machine's memory ``limit`` (bytes and what sets it:
    fedforget.utils.host_memory_limit). None where any of them that run together fit (their
    ``client_state_mb`` and ``process_mb`` each); else the warning that says how much the
    largest could keep, names them, and what to run with (``packing`` of the ones that keep
    the most: ``--resources client_state_mb=C``, or fewer at once)."""
    jobs = sorted(jobs, key=state_of, reverse=True)
    at_once = min([len(jobs)] + [n for n in (slots, None if cores is None else max(1, cores // threads)) if n is not None])
    mem_mb = limit[0] // 2**20
    plan = packing(jobs[:at_once], mem_mb, process_mb) if jobs else None
    if plan is None:
        return None
    k, cap = plan
    flag = f"`--resources gpu_slots={k}`" if slots is not None else f"`--cores {k * threads}`"
    if state_of(jobs[0]) + process_mb > mem_mb:  # packing's (1, None)
        advice = "the largest may not fit even alone (fewer clients, or a machine with more memory)"
        advice += f"; run the others one at a time ({flag})" if at_once > 1 else ""
    else:  # (K, C): a cap, fewer at once, or both (K < at_once where there is no cap)
        runs = ([f"`--resources {STATE}={cap}`"] if cap is not None else []) + (
            [f"at most {k} at once ({flag})"] if k < at_once else [])
        advice = f"run with {' and '.join(runs)}, so that the jobs run together fit"
    largest = ", ".join(f"{j.wildcards.get('experiment')}/{j.wildcards.get('method')}/seed{j.wildcards.get('seed')} "
                        f"({state_of(j):,} MiB)" for j in jobs[:3])  # fmt: skip
    jobs_at_once = f"{at_once} training jobs that may run at once" if at_once > 1 else "1 training job to run"
    return (f"the {jobs_at_once} here could keep {state_need(jobs[:at_once]):,} MiB of per-client state "
            f"({STATE}; the largest: {largest}), and each job's process takes about {process_mb:,} MB besides (on a "
            f"CPU more: docs/cluster.md), more than {limit[1]} ({mem_mb:,} MiB): {advice}")


@dataclass
class ExecutorSettings(SlurmSettings):
    process_mb: int = field(
        default=PROCESS_MB,
        metadata={
            "help": "Host memory in MB one training job's process takes besides its per-client "
            "state (Python, torch, a CUDA context, activations): set aside per job run at once "
            f"in a submission's mem_mb. Default {PROCESS_MB:,}.",
            "env_var": False,
            "required": False,
        },
    )
    # Optional[int], not int | None: Snakemake builds its command-line types from it
    max_seconds_between_status_checks: Optional[int] = field(  # noqa: UP045
        default=None,
        metadata={
            "help": "The longest wait in seconds between two status checks of the submitted "
            "jobs (the SLURM plugin's: 180). Unset: the SLURM plugin's schedule.",
            "env_var": False,
            "required": False,
        },
    )

    def __post_init__(self):
        mb = self.process_mb
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < 0:
            raise ValueError(f"slurm-packed-process-mb must be a whole number of MB >= 0, got {mb!r}")
        cap = self.max_seconds_between_status_checks
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(
                f"slurm-packed-max-seconds-between-status-checks must be a whole number of "
                f"seconds >= 1, got {cap!r}"
            )
        super().__post_init__()


class Executor(SlurmExecutor):
    # While a group's command is formatted, its jobs' threads: per thread [D], as the SLURM
    # plugin submits from a pool of 2 threads (an attribute of the executor, cleared by one
    # submission while the other formatted its group, sent that group to slurm-jobstep
    # --jobs 1: one job after another; seen on the test cluster)
    _formatting = threading.local()

    @property
    def _group_cores(self) -> int | None:
        return getattr(self._formatting, "group_cores", None)

    def format_job_exec(self, job) -> str:
        """The SLURM plugin's command for ``job``; for a group, run by the local executor with
        cores for all its jobs at once, or for as many as fit the submission's memory
        (``packing``), their per-client state capped where it must be."""
        if not job.is_group():
            return super().format_job_exec(job)
        threads = sorted(max(1, int(j.threads)) for j in job.jobs)
        process_mb = self.workflow.executor_settings.process_mb
        plan = packing(job.jobs, job.resources.get("mem_mb"), process_mb)
        at_once, cap = (len(threads), None) if plan is None else plan
        self._formatting.group_cores = sum(threads[:at_once])  # any more jobs would need more cores
        self._formatting.state_cap = cap
        if plan is not None:
            n, mem_mb, need = len(job.jobs), int(job.resources["mem_mb"]), state_need(job.jobs)
            largest = max(state_of(j) for j in job.jobs)
            how = (f"one at a time, and the largest ({largest:,} MiB of state) may not fit even alone"
                   if largest + process_mb > mem_mb else f"at most {at_once} at once"
                   + ("" if cap is None else f", with at most {cap:,} MiB of per-client state together"))  # fmt: skip
            self.logger.warning(
                f"slurm-packed: the {n} training jobs of one submission (jobids {', '.join(str(j.jobid) for j in job.jobs)}) "
                f"keep {need:,} MiB of per-client state together ({STATE}) and take {process_mb:,} MB each for their "
                f"process (slurm-packed-process-mb), {need + n * process_mb:,} in all, more than its mem_mb {mem_mb:,}: "
                f"they run there {how} (raise mem_mb or lower group-components to run them all at once)"
            )
        try:
            return super().format_job_exec(job)
        finally:
            self._formatting.group_cores = self._formatting.state_cap = None

    @property
    def next_seconds_between_status_checks(self):
        """The SLURM plugin's wait before the next status check, at most the cap (if set)."""
        wait = SlurmExecutor.next_seconds_between_status_checks.fget(self)
        cap = self.workflow.executor_settings.max_seconds_between_status_checks
        return wait if cap is None or wait is None else min(wait, cap)

    @next_seconds_between_status_checks.setter
    def next_seconds_between_status_checks(self, value):
        SlurmExecutor.next_seconds_between_status_checks.fset(self, value)

    @property
    def cores(self):
        return self._group_cores or super().cores

    def additional_general_args(self) -> str:
        """The SLURM plugin's (``--executor slurm-jobstep --jobs 1``) for a job alone; for a
        group, Snakemake's default, the local executor, runs its jobs: no executor, and the
        cap on their per-client state where there is one."""
        if not self._group_cores:
            return super().additional_general_args()
        cap = getattr(self._formatting, "state_cap", None)
        return "" if cap is None else f"--resources {STATE}={cap}"
