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
"""

from snakemake_executor_plugin_slurm import Executor as SlurmExecutor
from snakemake_executor_plugin_slurm import ExecutorSettings, common_settings

__all__ = ["Executor", "ExecutorSettings", "common_settings"]


class Executor(SlurmExecutor):
    _group_cores: int | None = None  # while a group's command is formatted: its jobs' threads

    def format_job_exec(self, job) -> str:
        """The SLURM plugin's command for ``job``; for a group, run by the local executor with
        cores for all its jobs at once."""
        if not job.is_group():
            return super().format_job_exec(job)
        self._group_cores = sum(max(1, int(j.threads)) for j in job.jobs)
        try:
            return super().format_job_exec(job)
        finally:
            self._group_cores = None

    @property
    def cores(self):
        return self._group_cores or super().cores

    def additional_general_args(self) -> str:
        """The SLURM plugin's (``--executor slurm-jobstep --jobs 1``) for a job alone; none for
        a group: Snakemake's default, the local executor, runs its jobs."""
        return "" if self._group_cores else super().additional_general_args()
