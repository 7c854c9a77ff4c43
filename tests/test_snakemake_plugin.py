"""fedforget's Snakemake plugin (src/snakemake_logger_plugin_fedforget): the wrap of Snakemake's
--configfile loader is in place and leaves files that load untouched, Snakemake registers the
plugin as a valid logger, and the job timeline's lines. The real commands are in
tests/test_workflow.py (a bad --configfile; the end-to-end run with --logger fedforget)."""

from __future__ import annotations

import json
import logging
import re

import pytest

snakemake_types = pytest.importorskip("snakemake.settings.types")
plugin = pytest.importorskip("snakemake_logger_plugin_fedforget")


def test_the_configfile_loader_is_wrapped_and_passes_good_files_through(tmp_path):
    import snakemake.common.configfile as common
    from snakemake.exceptions import CliException

    # the command line's --configfile and a Snakefile's configfile: directive read the wrap
    assert getattr(snakemake_types.load_configfile, "fedforget_wrapped", False)
    assert common.load_configfile is snakemake_types.load_configfile
    original = common.load_configfile.__wrapped__
    assert original.__module__ == "snakemake.common.configfile"
    wrapped = snakemake_types.load_configfile
    assert plugin._wrap_config_loader() and snakemake_types.load_configfile is wrapped  # once
    good = tmp_path / "good.yaml"
    good.write_text("results_dir: r\nexperiments:\n  - {name: a, seeds: [0, 1]}\n")
    as_json = tmp_path / "good.json"
    as_json.write_text(json.dumps({"results_dir": "r", "n": 1.5}))
    for path in (good, as_json):
        assert snakemake_types.load_configfile(path) == original(path)
    (tmp_path / "bad.yaml").write_text("a: 1\n b: 2\n")
    (tmp_path / "empty.yaml").write_text("# nothing set\n")
    (tmp_path / "list.yaml").write_text("[1, 2]\n")
    for name, message in [
        ("bad.yaml", f"config file {tmp_path / 'bad.yaml'}, line 2, column 3 is not valid YAML: mapping values are not allowed here"),
        ("empty.yaml", f"config file {tmp_path / 'empty.yaml'} is empty: expected a mapping of config keys"),
        ("list.yaml", f"config file {tmp_path / 'list.yaml'}: expected a mapping at the top level (of config keys), got a list"),
        ("missing.yaml", f"config file not found: {tmp_path / 'missing.yaml'}"),  # Snakemake alone: a traceback
    ]:
        with pytest.raises(CliException) as e:
            snakemake_types.load_configfile(tmp_path / name)
        assert str(e.value) == message
    # and Snakemake prints a CliException in one line (the real command: tests/test_workflow.py)
    from snakemake.exceptions import format_exception_to_string

    assert format_exception_to_string(e.value) == f"Error: {message}"


def test_snakemake_registers_the_logger():
    from snakemake_interface_logger_plugins.registry import LoggerPluginRegistry

    p = LoggerPluginRegistry().get_plugin("fedforget")
    assert p.log_handler is plugin.LogHandler and p.settings_cls is plugin.LogHandlerSettings


def record(msg: str, **extra) -> logging.LogRecord:
    r = logging.LogRecord("snakemake", logging.INFO, __file__, 1, msg, None, None)
    r.__dict__.update(extra)
    return r


def test_the_timeline_keeps_job_events_only(tmp_path):
    from snakemake_interface_logger_plugins.common import LogEvent

    class Common:
        dryrun = False

    path = tmp_path / "log" / "jobs.jsonl"
    handler = plugin.LogHandler(Common(), plugin.LogHandlerSettings(path=str(path)))
    records = [
        record("Building DAG of jobs..."),
        record(" Rule: train, Jobid: 3", event=LogEvent.JOB_INFO, jobid=3, rule_name="train",
               wildcards={"method": "fedavg", "seed": "0"}, resources={"mem_mb": 1}),
        record("Shell command: x", event=LogEvent.SHELLCMD, shellcmd="x"),
        record("", event=LogEvent.JOB_STARTED, jobs=[3, 4]),
        record("Finished jobid: 3", event=LogEvent.JOB_FINISHED, job_id=3),
        record("Error in rule train, jobid: 4", event=LogEvent.JOB_ERROR, jobid=4, rule_name="train"),
        record("1 of 2 steps (50%) done", event=LogEvent.PROGRESS, done=1, total=2),
    ]
    for r in records:
        handler.emit(r)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    t = records[1].created
    assert lines == [
        {"time": t, "event": "job_info", "jobs": [3], "rule": "train", "wildcards": {"method": "fedavg", "seed": "0"}},
        {"time": records[3].created, "event": "job_started", "jobs": [3, 4]},
        {"time": records[4].created, "event": "job_finished", "jobs": [3]},
        {"time": records[5].created, "event": "job_error", "jobs": [4], "rule": "train"},
    ]
    Common.dryrun = True  # a dry run writes no timeline
    plugin.LogHandler(Common(), plugin.LogHandlerSettings(path=str(path))).emit(records[1])
    assert len(path.read_text().splitlines()) == 4


def packed_executor(**settings):
    """A `slurm-packed` executor with no workflow behind it: its resource and executor
    settings (the SLURM plugin's pass_command_as_script off, process_mb its default, plus
    ``settings``) stand-ins."""
    from types import SimpleNamespace

    import snakemake_executor_plugin_slurm_packed as packed

    ex = object.__new__(packed.Executor)
    ex.workflow = SimpleNamespace(
        resource_settings=SimpleNamespace(cores=None),
        executor_settings=SimpleNamespace(**{"pass_command_as_script": False, "process_mb": packed.PROCESS_MB, **settings}),
    )
    ex.logger = logging.getLogger("test-slurm-packed")
    return ex


def group_of(*jobs, mem_mb=16000, name="group"):
    """A group job stand-in: ``jobs`` as (threads, client_state_mb) pairs, the submission's
    ``mem_mb`` (Snakemake's group resources)."""
    from types import SimpleNamespace

    members = [SimpleNamespace(threads=t, jobid=i + 1, resources={"client_state_mb": mb}) for i, (t, mb) in enumerate(jobs)]
    return SimpleNamespace(is_group=lambda: True, jobs=members, resources={"mem_mb": mem_mb}, name=name)


def test_slurm_packed_runs_a_group_at_once_and_a_job_alone_as_the_slurm_plugin(monkeypatch):
    """The `slurm-packed` executor (profiles/slurm): registered with Snakemake under that name
    with the SLURM plugin's settings; a group's command has no `--executor slurm-jobstep --jobs
    1` (the local executor runs its jobs) and cores for all its jobs at once; a job alone's is
    the SLURM plugin's. (Against a real scheduler: tests/test_slurm.py.)"""
    from types import SimpleNamespace

    import snakemake_executor_plugin_slurm as slurm
    from snakemake_interface_executor_plugins.registry import ExecutorPluginRegistry

    import snakemake_executor_plugin_slurm_packed as packed

    p = ExecutorPluginRegistry().get_plugin("slurm-packed")
    assert p.executor is packed.Executor and p.settings_cls is packed.ExecutorSettings and p.cli_prefix == "slurm-packed"
    assert issubclass(packed.ExecutorSettings, slurm.ExecutorSettings)
    # the command's two parts this executor changes, as the interface's format_job_exec reads them
    monkeypatch.setattr(slurm.Executor, "format_job_exec", lambda self, job: f"--cores {self.cores} {self.additional_general_args()}".strip())
    ex = packed_executor()
    alone = SimpleNamespace(is_group=lambda: False, threads=2)
    group = group_of((2, 0), (1, 0), (1, 0))
    assert ex.format_job_exec(alone) == "--cores all --executor slurm-jobstep --jobs 1"
    assert ex.format_job_exec(group) == "--cores 4"
    assert ex.format_job_exec(alone) == "--cores all --executor slurm-jobstep --jobs 1"  # nothing left behind


def test_slurm_packed_formats_two_groups_at_once_each_with_its_own_cores(monkeypatch):
    """The SLURM plugin submits from 2 threads: while one group's command is formatted, another
    thread formats a group and a job alone start to end; each command is its own (the state of
    the group being formatted is per thread; an attribute of the executor sent the first group
    to slurm-jobstep --jobs 1, one job after another)."""
    import threading
    from types import SimpleNamespace

    import snakemake_executor_plugin_slurm as slurm

    ex = packed_executor()
    alone = SimpleNamespace(is_group=lambda: False, threads=1, name="alone")
    small = group_of((1, 0), (1, 0), name="small")
    big = group_of((3, 5000), (3, 5000), mem_mb=14000, name="big")  # 2 x 3,000 MB of processes besides
    others: dict[str, str] = {}

    def other_thread() -> None:
        for job in (small, alone):
            others[job.name] = ex.format_job_exec(job)

    def fmt(self, job) -> str:
        if job is big:  # in the middle of formatting: the other thread runs to its end
            t = threading.Thread(target=other_thread)
            t.start()
            t.join()
        return f"--cores {self.cores} {self.additional_general_args()}".strip()

    monkeypatch.setattr(slurm.Executor, "format_job_exec", fmt)
    assert ex.format_job_exec(big) == "--cores 6 --resources client_state_mb=8000"
    assert others == {"small": "--cores 2", "alone": "--cores all --executor slurm-jobstep --jobs 1"}


def test_slurm_packed_runs_at_once_only_the_jobs_that_fit_the_submissions_memory(monkeypatch, caplog):
    """Jobs whose per-client state (the train rule's resource client_state_mb) and processes
    (slurm-packed-process-mb each) together exceed the submission's mem_mb: the local executor
    inside gets the cores of at most K jobs and, where K of them could exceed it, --resources
    client_state_mb=C, C + K x process_mb <= mem_mb (Snakemake then starts at once only jobs
    that fit together: the workflow test runs that part), and a warning names the jobs and the
    sizes; jobs that fit, or a submission that asks no memory, are run all at once as before."""
    from types import SimpleNamespace

    import snakemake_executor_plugin_slurm as slurm

    import snakemake_executor_plugin_slurm_packed as packed

    monkeypatch.setattr(slurm.Executor, "format_job_exec", lambda self, job: f"--cores {self.cores} {self.additional_general_args()}".strip())
    ex = packed_executor()
    four = [(1, 4300)] * 4  # FedProj Table 1/3b's FedDyn on the ResNet-18 at 100 clients, 4 to a submission
    with caplog.at_level(logging.WARNING, logger="test-slurm-packed"):
        # 3 at once would hold 12,900 MiB of state and 9,000 MB of processes: 2 of them, no cap beyond
        assert ex.format_job_exec(group_of(*four)) == "--cores 2"
        assert ex.format_job_exec(group_of((2, 20000), (2, 0))) == "--cores 2"
    assert caplog.messages == [
        "slurm-packed: the 4 training jobs of one submission (jobids 1, 2, 3, 4) keep 17,200 MiB of per-client state "
        "together (client_state_mb) and take 3,000 MB each for their process (slurm-packed-process-mb), 29,200 in "
        "all, more than its mem_mb 16,000: they run there at most 2 at once (raise mem_mb or lower group-components "
        "to run them all at once)",
        "slurm-packed: the 2 training jobs of one submission (jobids 1, 2) keep 20,000 MiB of per-client state "
        "together (client_state_mb) and take 3,000 MB each for their process (slurm-packed-process-mb), 26,000 in "
        "all, more than its mem_mb 16,000: they run there one at a time, and the largest (20,000 MiB of state) may "
        "not fit even alone (raise mem_mb or lower group-components to run them all at once)",
    ]
    mixed = [(1, 6000), (1, 1000), (1, 1000), (1, 1000)]
    for jobs, mem, process, plan in [
        (four, 29200, 3000, None), (four, 29199, 3000, (4, 17199)), (four, 17200, 0, None), (four, 17199, 0, (4, 17199)),
        ([(1, 0)] * 4, 1, 0, None), ([(1, 0)] * 4, 10000, 3000, (3, None)), ([(2, 20000), (2, 0)], 16000, 0, (1, None)),
        (mixed, 16000, 2000, (4, 8000)),  # 4 at once, at most 8,000 MiB: the 6,000 job with two others
        ([(2, 0), (1, 0), (1, 0)], 7000, 3000, (2, None)),  # the two of one thread each: 2 cores
        (four, None, 3000, None), (four, "16000", 3000, None),
    ]:  # fmt: skip
        group = group_of(*jobs, mem_mb=mem)
        assert packed.packing(group.jobs, mem, process) == plan, (jobs, mem, process)
        at_once, cap = (len(jobs), None) if plan is None else plan
        cores = sum(sorted(t for t, _ in jobs)[:at_once])
        expected = f"--cores {cores}" + ("" if cap is None else f" --resources client_state_mb={cap}")
        assert packed_executor(process_mb=process).format_job_exec(group) == expected
    alone = SimpleNamespace(is_group=lambda: False, threads=1)
    assert ex.format_job_exec(alone) == "--cores all --executor slurm-jobstep --jobs 1"  # nothing left behind


def test_a_machine_s_training_jobs_that_may_not_fit_its_memory_are_warned_of():
    """On one machine (the local executor: profiles/gpu), common.smk's check_host_memory warns
    before the first job where the training jobs that may run at once (gpu_slots, --cores
    over their threads) could keep more per-client state with their processes than the
    machine's memory, with slurm-packed's rule: the largest named, and the --resources cap
    (or fewer at once) that fits."""
    from types import SimpleNamespace

    import snakemake_executor_plugin_slurm_packed as packed

    def jobs(*states):
        return [SimpleNamespace(resources={"client_state_mb": s}, wildcards={"experiment": "t13b", "method": f"m{i}", "seed": 0})
                for i, s in enumerate(states)]  # fmt: skip

    gib = 2**30
    machine = (32 * gib, "this machine's memory and swap")  # 32,768 MiB
    feddyn = jobs(4263, 4263, 4263, 4263, 0, 0)  # FedProj Table 1/3b's FedDyn, and two FedAvg jobs
    # 4 slots: 17,052 MiB of state + 4 x 3,000 = 29,052 <= 32,768: no warning; nor on 2 cores of 1 thread
    assert packed.machine_warning(feddyn, 4, 8, 2, machine) is None
    assert packed.machine_warning(feddyn, None, 2, 1, (24 * gib, "x")) is None
    # 24 GiB: 3 of them at once fit (12,789 + 9,000 <= 24,576), so no cap beyond 3 slots
    assert packed.machine_warning(feddyn, 4, 8, 2, (24 * gib, "its control group's memory limit (/m)")) == (
        "the 4 training jobs that may run at once here could keep 17,052 MiB of per-client state "
        "(client_state_mb; the largest: t13b/m0/seed0 (4,263 MiB), t13b/m1/seed0 (4,263 MiB), t13b/m2/seed0 "
        "(4,263 MiB)), and each job's process takes about 3,000 MB besides (on a CPU more: docs/cluster.md), more "
        "than its control group's memory limit (/m) (24,576 MiB): run with at most 3 at once "
        "(`--resources gpu_slots=3`), so that the jobs run together fit"
    )
    # the default profile (no gpu_slots): --cores 8 over 2 threads each is 4 at once; the cap in cores
    assert "run with at most 3 at once (`--cores 6`)" in packed.machine_warning(feddyn, None, 8, 2, (24 * gib, "x"))
    # one large job and small ones, processes of 2,000 MB: 4 at once with at most 8,000 MiB of state
    # together (8,000 + 4 x 2,000 <= 16,000): the large one with two others (packing's own case)
    mixed = packed.machine_warning(jobs(6000, 1000, 1000, 1000), 4, 8, 1, (16000 * 2**20, "x"), process_mb=2000)
    assert "keep 9,000 MiB" in mixed and "run with `--resources client_state_mb=8000`, so" in mixed
    # two large ones: at most 3 at once, the two together (10,000 + 3 x 2,000 <= 16,000)
    two = packed.machine_warning(jobs(5000, 5000, *[100] * 4), 6, 8, 1, (16000 * 2**20, "x"), process_mb=2000)
    assert "run with `--resources client_state_mb=10000` and at most 3 at once (`--resources gpu_slots=3`), so" in two
    # a job that cannot fit even alone (the run's own job refuses it before round 1: tests/test_workflow.py)
    assert packed.machine_warning(jobs(30000, 10), 4, 8, 1, (32 * gib, "x")).endswith(
        "the largest may not fit even alone (fewer clients, or a machine with more memory); run the others one at a "
        "time (`--resources gpu_slots=1`)")
    assert packed.machine_warning(jobs(30000), None, 2, 1, (32 * gib, "x")).startswith(
        "the 1 training job to run here could keep 30,000 MiB")
    assert packed.machine_warning([], 4, 8, 1, machine) is None


def test_slurm_packed_never_runs_together_more_than_the_submissions_memory():
    """``packing``'s promise over random groups: any jobs the local executor may start together
    (at most K of them, their client_state_mb at most C) fit mem_mb with their processes, and
    the largest job may run (C at least its state) wherever it fits alone; jobs that all fit run
    all at once."""
    import itertools
    import random
    from types import SimpleNamespace

    import snakemake_executor_plugin_slurm_packed as packed

    rng = random.Random(0)
    for _ in range(400):
        states = [rng.choice([0, 0, 100, 1000, 2500, 4300, 9000, 20000]) for _ in range(rng.randint(1, 6))]
        mem, process = rng.choice([1000, 8000, 16000, 32000]), rng.choice([0, 500, 3000])
        jobs = [SimpleNamespace(resources={"client_state_mb": s}) for s in states]
        plan = packed.packing(jobs, mem, process)
        if plan is None:
            assert sum(states) + len(states) * process <= mem, (states, mem, process)
            continue
        k, cap = plan
        if max(states) + process > mem:
            assert plan == (1, None), (states, mem, process, plan)
            continue
        assert 1 <= k <= len(states) and (k < len(states) or cap is not None), (states, mem, process, plan)
        assert cap is None or cap >= max(states), (states, mem, process, plan)
        for n in range(1, k + 1):
            for some in itertools.combinations(states, n):
                if cap is None or sum(some) <= cap:
                    assert sum(some) + n * process <= mem, (states, mem, process, plan, some)


def test_slurm_packed_caps_the_wait_between_status_checks():
    """`slurm-packed-max-seconds-between-status-checks`: the SLURM plugin's growing wait
    (1, 11, 21 s ... 180 s) at most the cap; unset, the SLURM plugin's; not a whole number
    of seconds >= 1, one error naming the setting and the value."""
    import snakemake_executor_plugin_slurm_packed as packed

    for cap, waits in [(None, [1, 11, 21, 31]), (5, [1, 5, 5, 5]), (15, [1, 11, 15, 15])]:
        ex = packed_executor(max_seconds_between_status_checks=cap)
        ex.next_seconds_between_status_checks = 1
        seen = []
        for _ in range(4):
            seen.append(ex.next_seconds_between_status_checks)
            # the SLURM plugin's step where no job finished (check_active_jobs)
            ex.next_seconds_between_status_checks = min(ex.next_seconds_between_status_checks + 10, 180)
        assert seen == waits, (cap, seen)
    assert packed.ExecutorSettings(max_seconds_between_status_checks=3).max_seconds_between_status_checks == 3
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match=rf"^slurm-packed-max-seconds-between-status-checks must be a whole number of seconds >= 1, got {bad!r}$"):
            packed.ExecutorSettings(max_seconds_between_status_checks=bad)
    assert packed.ExecutorSettings().process_mb == packed.PROCESS_MB and packed.ExecutorSettings(process_mb=0).process_mb == 0
    for bad in (-1, 2.5, True, "3000"):
        with pytest.raises(ValueError, match=rf"^slurm-packed-process-mb must be a whole number of MB >= 0, got {re.escape(repr(bad))}$"):
            packed.ExecutorSettings(process_mb=bad)
