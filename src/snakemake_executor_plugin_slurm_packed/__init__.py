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
whole submission), and a method that keeps state per client across rounds holds it there
(copies of the model: SCAFFOLD, FedDyn, MOON, FedCurv; replay buffers, exemplars, GPM's bases
at their fullest): the train rule declares each job's as its resource ``client_state_mb``
(``fedforget.parse.client_state_mb``). Where a group's jobs need more of it
together than the submission's ``mem_mb``, the local executor inside gets ``--resources
client_state_mb=<mem_mb>`` and runs at once only as many as fit (one alone where it does not fit
with any other); the submission's runtime, the sum of its jobs', still covers them one after
another. A warning names the jobs.

One setting of its own: ``max-seconds-between-status-checks`` [D]. The SLURM plugin polls a
submission 40 s (``init-seconds-before-status-checks``) after it is sent, then waits 10 s longer
each time no job has finished, up to 180 s: considerate of a shared cluster's controller, but a
half-minute job is then seen done after a minute. On a cluster of your own, a cap of a few
seconds lets short jobs (small embedded configs, a test cluster) follow one another at once;
unset (the default) keeps the SLURM plugin's schedule.
"""

import threading
from dataclasses import dataclass, field
from typing import Optional

from snakemake_executor_plugin_slurm import Executor as SlurmExecutor
from snakemake_executor_plugin_slurm import ExecutorSettings as SlurmSettings
from snakemake_executor_plugin_slurm import common_settings

__all__ = ["Executor", "ExecutorSettings", "common_settings", "state_cap", "state_need"]

STATE = "client_state_mb"  # the train rule's resource (workflow/rules/train.smk)


def state_need(jobs) -> int:
    """The MiB of per-client state ``jobs`` keep together (their ``client_state_mb``)."""
    return sum(int(j.resources.get(STATE, 0) or 0) for j in jobs)


def state_cap(jobs, mem_mb) -> int | None:
    """The cap on ``client_state_mb`` for the local executor running ``jobs`` at once in one
    submission of ``mem_mb`` MB: ``mem_mb`` where their ``client_state_mb`` together exceed
    it, None where they fit (or the submission asks no memory)."""
    if isinstance(mem_mb, bool) or not isinstance(mem_mb, int | float) or mem_mb <= 0:
        return None
    return int(mem_mb) if state_need(jobs) > mem_mb else None


@dataclass
class ExecutorSettings(SlurmSettings):
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
        cores for all its jobs at once, and their per-client state capped at the
        submission's memory where they do not all fit in it (``state_cap``)."""
        if not job.is_group():
            return super().format_job_exec(job)
        self._formatting.group_cores = sum(max(1, int(j.threads)) for j in job.jobs)
        cap = self._formatting.state_cap = state_cap(job.jobs, job.resources.get("mem_mb"))
        if cap is not None:
            self.logger.warning(
                f"slurm-packed: the {len(job.jobs)} training jobs of one submission (jobids "
                f"{', '.join(str(j.jobid) for j in job.jobs)}) keep {state_need(job.jobs):,} MiB of per-client state "
                f"together ({STATE}), more than its mem_mb {cap:,}: they run there at once only as many as "
                "fit (raise mem_mb or lower group-components to run them all at once)"
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
