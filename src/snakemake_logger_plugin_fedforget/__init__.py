"""fedforget's Snakemake plugin: one-line errors for a bad ``--configfile``, and a job timeline.

[D] Snakemake reads every ``--configfile`` while it parses its command line, before any code of
the workflow runs, so the Snakefile cannot word the errors of a config file that does not load:
Snakemake 9 says "Config file is not valid JSON or YAML" for a syntax error (no file, no line)
and prints a traceback for a missing file. The only code of ours that runs that early is a
plugin module: Snakemake imports every installed ``snakemake_logger_plugin_*`` package when it
starts. Importing this one wraps Snakemake's config-file loader so that a file that fails to
load (missing, not YAML, empty, not a mapping) is reported in one line with no traceback,
naming the file and, for YAML, the line and column, exactly as ``fedforget validate --config
FILE`` reports it. A file that loads is returned as Snakemake loaded it, untouched; if
Snakemake's loader moves, nothing is wrapped and Snakemake's own message stands
(tests/test_snakemake_plugin.py checks that the wrap is in place).

The plugin Snakemake registers is a real logger, ``--logger fedforget``: a JSON-lines timeline
of the run's jobs (one line per job announced, started, finished or failed: time, event, job
id, rule, wildcards), written to ``--logger-fedforget-path`` (default
``.snakemake/log/fedforget-jobs.jsonl``, appended to), from which each job's wall time is the
difference of its ``job_started`` and ``job_finished`` times.
"""

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from snakemake_interface_logger_plugins.base import LogHandlerBase
from snakemake_interface_logger_plugins.settings import LogHandlerSettingsBase

DEFAULT_PATH = ".snakemake/log/fedforget-jobs.jsonl"


def _config_file_problem(path: Any) -> str | None:
    """fedforget's one-line account of why ``path`` is not a usable config file, or None when
    fedforget reads it as a mapping (imported only here: a failed load is the rare path)."""
    from fedforget.config import load_yaml
    from fedforget.utils import FedForgetError

    try:
        load_yaml(path)
    except FedForgetError as e:
        return str(e)
    return None


def _wrap_config_loader() -> bool:
    """Wrap Snakemake's ``load_configfile`` where the command line's ``--configfile`` reads it
    (``snakemake.settings.types``) and where a Snakefile's ``configfile:`` directive does
    (``snakemake.common.configfile``, imported when the directive runs); False, wrapping
    nothing, where this Snakemake has no such function."""
    try:
        import snakemake.common.configfile as common
        import snakemake.settings.types as types
        from snakemake.exceptions import CliException
        from snakemake_interface_common.exceptions import WorkflowError
    except ImportError:
        return False
    loader = getattr(common, "load_configfile", None)
    if loader is None or getattr(types, "load_configfile", None) is None:
        return False
    if getattr(loader, "fedforget_wrapped", False):
        return True

    def load_configfile(path: Any) -> Any:
        try:
            return loader(path)
        except (WorkflowError, OSError) as e:
            problem = _config_file_problem(path)
            if problem is None:  # fedforget reads it: Snakemake's reason stands
                raise
            # Snakemake prints a CliException as "Error: <message>", one line, no traceback
            raise CliException(problem) from e

    load_configfile.fedforget_wrapped = True  # type: ignore[attr-defined]
    load_configfile.__wrapped__ = loader  # type: ignore[attr-defined]
    common.load_configfile = types.load_configfile = load_configfile
    return True


_wrap_config_loader()


@dataclass
class LogHandlerSettings(LogHandlerSettingsBase):
    path: str = field(
        default=DEFAULT_PATH,
        metadata={"help": "the JSON-lines job timeline (appended to)", "env_var": False},
    )


# the Snakemake log events the timeline keeps
_EVENTS = ("job_info", "job_started", "job_finished", "job_error")


class LogHandler(LogHandlerBase):
    """Appends one JSON line per job event: ``time`` (Unix seconds), ``event``, ``jobs`` (the
    job ids), and for announced and failed jobs ``rule`` and ``wildcards``."""

    def __post_init__(self) -> None:
        self.path = getattr(self.settings, "path", None) or DEFAULT_PATH
        self.baseFilename = os.path.abspath(self.path)  # Snakemake lists it as a log file
        os.makedirs(os.path.dirname(self.baseFilename), exist_ok=True)

    def emit(self, record: logging.LogRecord) -> None:
        line = timeline_line(record)
        if line is None or getattr(self.common_settings, "dryrun", False):
            return
        with open(self.baseFilename, "a") as f:
            f.write(json.dumps(line, sort_keys=True, default=str) + "\n")

    @property
    def writes_to_stream(self) -> bool:
        return False

    @property
    def writes_to_file(self) -> bool:
        return True

    @property
    def has_filter(self) -> bool:
        return True

    @property
    def has_formatter(self) -> bool:
        return True

    @property
    def needs_rulegraph(self) -> bool:
        return False


def timeline_line(record: logging.LogRecord) -> dict[str, Any] | None:
    """The timeline's line for a Snakemake log record, None for a record it does not keep."""
    event = str(getattr(record, "event", "") or "")
    if event not in _EVENTS:
        return None
    jobs = getattr(record, "jobs", None)
    if jobs is None:
        one = getattr(record, "jobid", getattr(record, "job_id", None))
        jobs = [] if one is None else [one]
    line: dict[str, Any] = {"time": record.created, "event": event, "jobs": list(jobs)}
    if event in ("job_info", "job_error"):
        line["rule"] = getattr(record, "rule_name", None)
        wildcards = getattr(record, "wildcards", None)
        if wildcards is not None:
            line["wildcards"] = dict(wildcards)
    return line
