"""End-to-end: the Snakemake workflow on a tiny config in a temporary directory (dry runs of
every shipped config, a full run with report, incremental reruns) and the DVC hash of the
prepared data. Marked e2e: slower, still run in CI."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.e2e

if (
    shutil.which("snakemake", path=str(BIN) + os.pathsep + os.environ.get("PATH", "")) is None
):  # pragma: no cover
    pytest.skip("snakemake is not installed (pip install -e .[workflow])", allow_module_level=True)


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PATH"] = str(BIN) + os.pathsep + e.get("PATH", "")
    return e


def snakemake(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["snakemake", "-s", str(REPO / "Snakefile"), "--cores", "2", *args]
    proc = subprocess.run(cmd, cwd=workdir, env=env(), capture_output=True, text=True, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def planned_jobs(workdir: Path) -> dict[str, int]:
    """Job counts per rule that a dry run would execute now."""
    out = snakemake(workdir, "-n")
    text = out.stdout + out.stderr
    if "Nothing to be done" in text:
        return {}
    table = text.split("Job stats:")[1]
    return {
        m.group(1): int(m.group(2))
        for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M)
        if m.group(1) != "total"
    }


TINY = {
    "data_dir": "prepared data",  # a path with a space: every rule's shell quotes its paths
    "experiments": [
        {
            "name": "tiny",
            "datasets": [{"name": "digits", "model": {"name": "cnn2d", "options": {"channels": [8, 16], "hidden": 32}},
                          "public": {"source": "holdout", "fraction": 0.1, "seed": 0}}],
            "partitions": [
                {"scheme": "dirichlet", "alpha": 0.5, "clients": 4, "min_size": 10, "seed": 0},
                {"scheme": "shards", "shards_per_client": 2, "clients": 4, "seed": 0},
            ],
            "methods": [{"name": "fedavg"}, {"name": "fedavg", "label": "fedavg-lr0.1", "train": {"optimizer": {"lr": 0.1}}}],
            "seeds": [0],  # several seeds per table: tests/test_aggregation.py, and the dry runs' job counts
            "train": {"rounds": 2, "local_epochs": 1, "batch_size": 32, "sample_rate": 0.5,
                      "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}},
        }
    ]
}  # fmt: skip


def write_config(workdir: Path, cfg: dict) -> None:
    (workdir / "config").mkdir(exist_ok=True)
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def shipped_configs() -> list[Path]:
    return [
        REPO / "config" / "config.yaml",
        *sorted((REPO / "config" / "experiments").glob("*.yaml")),
    ]


def test_dry_run_of_every_shipped_config(tmp_path: Path) -> None:
    """Every shipped experiment in one dry run (one Snakemake start instead of one per file:
    their names are distinct, and each file alone is validated in tests/test_config.py):
    one training job per dataset x partition x method x seed, one aggregation and one plot
    per experiment, the partitions each pool needs."""
    shutil.copytree(REPO / "config", tmp_path / "config")
    experiments = [e for c in shipped_configs() for e in yaml.safe_load(c.read_text())["experiments"]]
    assert len({e["name"] for e in experiments}) == len(experiments)
    merged = tmp_path / "all.yaml"
    merged.write_text(yaml.safe_dump({"experiments": experiments}, sort_keys=False))
    jobs = planned_jobs_for(tmp_path, merged)
    expected = sum(
        len(e["datasets"]) * len(e["partitions"]) * len(e["methods"]) * len(e["seeds"])
        for e in experiments
    )
    assert jobs["train"] == expected
    # experiments with continual runs (a scenario of more than one task) aggregate and plot
    # through rules aggregate_continual and plot_continual (their extra outputs)
    continual = sum(any(d.get("scenario", {}).get("tasks", 1) > 1 for d in e["datasets"]) for e in experiments)
    assert jobs.get("aggregate", 0) == jobs.get("plot", 0) == len(experiments) - continual
    assert jobs.get("aggregate_continual", 0) == jobs.get("plot_continual", 0) == continual
    figures = sum(len(e.get("figures", [])) for e in experiments)
    assert jobs.get("figure", 0) == figures
    # the local models' curve only for the experiments where some run measures it (issue 35):
    # train.eval_local_models (default true) in the experiment's or a method's train block
    def measures_local(e):
        trains = [{**e.get("train", {}), **m.get("train", {})} for m in e["methods"]]
        return any(t.get("eval_local_models", True) for t in trains)

    local = sum(measures_local(e) for e in experiments)
    assert 0 < local < len(experiments)
    assert jobs.get("plot_local_models_global_test_acc_mean", 0) == local


def planned_jobs_for(workdir: Path, configfile: Path) -> dict[str, int]:
    out = snakemake(workdir, "-n", "--configfile", str(configfile))
    table = (out.stdout + out.stderr).split("Job stats:")[1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M)}


def test_only_runs_part_of_a_file(tmp_path: Path) -> None:
    """``--config only=EXPERIMENT[/METHOD[/SEED]]`` (issue 35): a whole experiment is its runs,
    tables and figures; a method or a seed is its training runs alone (a table of part of an
    experiment would overwrite the whole one); an unknown name fails before any job, naming
    the nearest one."""
    cfg = json.loads(json.dumps(TINY))
    cfg["experiments"][0]["seeds"] = [0, 1]
    cfg["experiments"].append({**json.loads(json.dumps(cfg["experiments"][0])), "name": "other"})
    write_config(tmp_path, cfg)

    def jobs(only: str) -> dict[str, int]:
        out = snakemake(tmp_path, "-n", "--config", f"only={only}")
        table = (out.stdout + out.stderr).split("Job stats:")[1]
        return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M)}

    whole = jobs("tiny")
    assert whole["train"] == 8 and whole["aggregate"] == whole["plot"] == 1  # 2 partitions x 2 methods x 2 seeds
    # the first start in a new directory (Snakemake makes .snakemake/ after the parse) cached
    # its parse: the starts below validate nothing again
    assert len(list((tmp_path / ".snakemake" / "fedforget").glob("parse-*.pickle"))) == 1
    part = jobs("tiny/fedavg-lr0.1")
    assert part["train"] == 4 and "aggregate" not in part and "plot" not in part
    assert jobs("tiny/fedavg-lr0.1/1")["train"] == 2
    proc = snakemake(tmp_path, "-n", "--config", "only=tiny/fedavg-lr01", check=False)
    assert proc.returncode != 0
    assert "unknown method 'fedavg-lr01' (did you mean 'fedavg-lr0.1'?)" in proc.stdout + proc.stderr


def test_every_path_in_a_rules_shell_command_is_quoted() -> None:
    """A data or results directory with a space (``data_dir: "My Drive/data"``) split the
    shell commands' unquoted paths ("unrecognized arguments: Drive/data"): every placeholder
    of a shell command is quoted (``:q``) but the thread count and the raw-data arguments,
    which data.smk quotes itself."""
    unquoted = []
    for path in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        shell = False
        for n, line in enumerate(path.read_text().splitlines(), 1):
            text = line.strip()
            shell = text.startswith("shell:") or (shell and text.startswith('"'))
            unquoted += [f"{path.name}:{n}: {{{m}}}" for m in re.findall(r"\{([\w.\[\]]+)\}", text)
                         if shell and m not in ("threads", "params.raw")]  # fmt: skip
    assert not unquoted, unquoted


def test_snakemake_lint_is_clean() -> None:
    """`snakemake --lint` finds nothing (issue 35): every rule names its software
    (workflow/envs/fedforget.yaml), helpers and rules live in separate files."""
    proc = subprocess.run(
        ["snakemake", "--lint"], cwd=REPO, env=env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "Lints for" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_nested_config_values_from_the_command_line(tmp_path: Path) -> None:
    """``--config "smoke={rounds: 1, clients: 2}"`` (Snakemake reads nested scalars as strings;
    workflow/rules/common.smk types them before validation, fedforget.config.typed_overrides)."""
    write_config(tmp_path, TINY)
    cfg = tmp_path / "config" / "config.yaml"  # a float without a dot: a string to YAML 1.1 (Snakemake's load)
    assert "lr: 0.1" in cfg.read_text()
    cfg.write_text(cfg.read_text().replace("lr: 0.1", "lr: 1e-1"))
    out = snakemake(tmp_path, "-n", "--config", "scale=smoke", "smoke={rounds: 1, clients: 2, results_dir: small}",
                    "download=true")  # the README's spelling (Snakemake itself types only True)
    assert "small/" in out.stdout + out.stderr
    assert not (tmp_path / "results").exists() and not (tmp_path / "small").exists()


def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path: Path) -> None:
    """Snakemake's own YAML load keeps a repeated key's last value; common.smk reads each
    config file again with fedforget's loader, which refuses it before any job."""
    write_config(tmp_path, TINY)
    cfg = tmp_path / "config" / "config.yaml"
    cfg.write_text(cfg.read_text() + "results_dir: results\nresults_dir: elsewhere\n")
    proc = snakemake(tmp_path, "-n", check=False)
    assert proc.returncode != 0
    assert "key 'results_dir' is given twice in one mapping" in proc.stdout + proc.stderr


def _bad_config_catalogue():
    """The catalogue of tests/test_config.py (id -> (mutation, expected message parts))."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_catalogue", Path(__file__).with_name("test_config.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {i: (m, e) for i, m, e in mod.BAD}


BAD = _bad_config_catalogue()
# through Snakemake for real: one case in make test (a registry check), one per kind of
# check with make smoke (schema, sizes, method hyperparameters, method needs, NaN); each costs
# a Snakemake start (~8 s in the suite, it imports torch) and goes the same way, an error
# raised by common.smk's parse. The whole catalogue goes through `fedforget run` in
# tests/test_config.py, which calls the same parse_config that workflow/rules/common.smk
# calls at parse time.
SNAKEMAKE_CATALOGUE = [
    "unknown-method",
    *(pytest.param(c, marks=pytest.mark.long) for c in (
        "alpha-zero", "shards-times-clients-gt-samples", "fedprox-negative-mu", "feddf-without-public-set", "lr-nan")),
]  # fmt: skip


@pytest.mark.parametrize("case", SNAKEMAKE_CATALOGUE)
def test_bad_config_catalogue_starts_no_job(tmp_path: Path, minimal_config: dict, case: str) -> None:
    """Not a dry run: the real command. It must fail at parse time with the message naming
    the key and value, and create nothing (no data, results, partitions or logs)."""
    mutate, expected = BAD[case]
    mutate(minimal_config)
    write_config(tmp_path, minimal_config)
    proc = snakemake(tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for part in expected:
        assert part in out, f"{part!r} not in the Snakemake output:\n{out[-3000:]}"
    assert "Building DAG of jobs" not in out
    created = sorted(p.name for p in tmp_path.iterdir())
    assert created in (["config"], [".snakemake", "config"]), created
    assert not list(tmp_path.glob(".snakemake/**/*.log")) or "Execute" not in out


def run_dirs(workdir: Path) -> dict[str, float]:
    """metrics.csv of every run -> its mtime."""
    return {
        str(p.relative_to(workdir)): p.stat().st_mtime_ns
        for p in (workdir / "results" / "tiny").glob("*/*/*/seed*/metrics.csv")
    }


def trains_overlapped(timeline: Path) -> bool:
    """Whether the two training jobs of a run logged by ``--logger fedforget`` (``timeline``)
    ran at the same time: both started before either finished. [D] Snakemake's own job times
    (sub-second), not run.json's started_at/finished_at (whole seconds, and only the training
    itself: a job of about a second could share a second with the other and not count)."""
    events = [json.loads(line) for line in timeline.read_text().splitlines()]
    trains = {t["jobs"][0] for t in events if t["event"] == "job_info" and t["rule"] == "train"}
    assert len(trains) == 2, events
    at = {e: {j: t["time"] for t in events if t["event"] == e for j in t["jobs"] if j in trains}
          for e in ("job_started", "job_finished")}  # fmt: skip
    assert set(at["job_started"]) == set(at["job_finished"]) == trains, events
    return max(at["job_started"].values()) < min(at["job_finished"].values())


def test_a_configfile_that_does_not_load_is_one_line(tmp_path: Path) -> None:
    """Snakemake reads --configfile before the Snakefile: fedforget's Snakemake plugin
    (src/snakemake_logger_plugin_fedforget) words the error in one line, naming the file (and
    line and column), with no traceback (Snakemake alone: "not valid JSON or YAML"). An
    empty, missing or non-mapping file: tests/test_snakemake_plugin.py, through the same
    wrap."""
    name, message = "syntax.yaml", "syntax.yaml, line 2, column 7 is not valid YAML: mapping values are not allowed here"
    (tmp_path / name).write_text("results_dir: r\n seeds: 2\n")
    proc = snakemake(tmp_path, "-n", "--configfile", str(tmp_path / name), check=False)
    out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr).strip()  # no colours
    assert proc.returncode != 0
    errors = [line for line in out.splitlines() if "rror" in line]
    assert len(errors) == 1 and errors[0].startswith("Error: config file "), out
    assert message in errors[0] and str(tmp_path) in errors[0], out
    assert "Traceback" not in out and 'File "' not in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], [name], [".snakemake", name])


def test_pipeline_end_to_end_and_incremental_reruns(tmp_path: Path) -> None:
    write_config(tmp_path, TINY)
    # with fedforget's job timeline (src/snakemake_logger_plugin_fedforget): one line per job
    # event; each train job announced with its wildcards, started and finished
    snakemake(tmp_path, "--logger", "fedforget", "--logger-fedforget-path", "timeline.jsonl")
    timeline = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    trains = {t["jobs"][0]: t for t in timeline if t["event"] == "job_info" and t["rule"] == "train"}
    assert len(trains) == 4 and all(t["wildcards"]["method"] for t in trains.values()), trains
    for event in ("job_started", "job_finished"):
        done = [j for t in timeline if t["event"] == event for j in t["jobs"]]
        assert set(trains) <= set(done), (event, timeline)
    assert not [t for t in timeline if t["event"] == "job_error"]
    summary = tmp_path / "results" / "tiny" / "summary"
    table = summary / "table.md"
    assert table.exists() and "fedavg-lr0.1" in table.read_text()
    import pandas as pd

    t = pd.read_csv(summary / "table.csv")
    assert len(t) == 4 and (t["n_seeds"] == 1).all() and t["final_acc_mean"].between(0, 100).all()
    metrics = pd.read_parquet(summary / "metrics.parquet")
    assert set(metrics["round"]) == {0, 1, 2}
    for fig in ("global_model_test_acc", "local_models_global_test_acc_mean"):
        assert (tmp_path / "results" / "tiny" / "figures" / f"{fig}.png").stat().st_size > 1000
    run = json.loads(
        next((tmp_path / "results" / "tiny").glob("digits/*/fedavg/seed0/run.json")).read_text()
    )
    assert (
        run["status"] == "completed"
        and len(run["config_hash"]) == 12
        and "torch" in run["versions"]
    )
    heatmaps = list((tmp_path / "results" / "partitions").glob("*/*/heatmap.png"))
    assert len(heatmaps) == 2

    # nothing reruns on a second invocation
    before = run_dirs(tmp_path)
    assert len(before) == 4
    assert planned_jobs(tmp_path) == {}

    # a finished run's deleted output (rule all names only the missing ones) redoes that run
    # alone; it is one of the 2 runs the hyperparameter change below redoes anyway
    model = next((tmp_path / "results" / "tiny").glob("digits/*/fedavg-lr0.1/seed0/model.pt"))
    model.unlink()
    assert planned_jobs(tmp_path).get("train") == 1

    # one method's hyperparameter: only that method's 2 jobs (+ aggregate, plot, default),
    # here through profiles/gpu with one GPU slot: the 2 training jobs run one after another
    cfg = json.loads(json.dumps(TINY))
    cfg["experiments"][0]["methods"][1]["train"]["optimizer"]["lr"] = 0.2
    write_config(tmp_path, cfg)
    jobs = planned_jobs(tmp_path)
    assert jobs.get("train") == 2 and "partition" not in jobs and "prepare_dataset" not in jobs
    gpu_profile = ("--workflow-profile", str(REPO / "profiles" / "gpu"), "--set-threads", "train=1")
    timeline = ("--logger", "fedforget", "--logger-fedforget-path")
    snakemake(tmp_path, *gpu_profile, "--resources", "gpu_slots=1", *timeline, "one-slot.jsonl")
    assert not trains_overlapped(tmp_path / "one-slot.jsonl")
    assert model.is_file()
    after = run_dirs(tmp_path)
    changed = {k for k in before if after[k] != before[k]}
    assert changed == {k for k in before if "/fedavg-lr0.1/" in k}
    lr = json.loads(
        next(
            (tmp_path / "results" / "tiny").glob("digits/*/fedavg-lr0.1/seed0/run.json")
        ).read_text()
    )
    assert lr["config"]["train"]["optimizer"]["lr"] == 0.2

    # one partition setting: only that partition and its 2 jobs
    cfg["experiments"][0]["partitions"][0]["alpha"] = 0.3
    write_config(tmp_path, cfg)
    jobs = planned_jobs(tmp_path)
    assert jobs.get("train") == 2 and jobs.get("partition") == 1 and "prepare_dataset" not in jobs
    before = run_dirs(tmp_path)
    snakemake(tmp_path, *gpu_profile, "--resources", "gpu_slots=2", *timeline, "two-slots.jsonl")  # at once
    assert trains_overlapped(tmp_path / "two-slots.jsonl")
    after = run_dirs(tmp_path)
    shards = {k for k in before if "/shards-2_" in k}
    assert all(after[k] == before[k] for k in shards)
    assert any("dirichlet-0.3_" in k for k in after)
    assert planned_jobs(tmp_path) == {}

    # SCAFFOLD keeps a copy of the model per client: each job declares its copies as resource
    # client_state_mb (1 MiB here, rounded up), and with room for one job's copies its 2 jobs
    # run one after another although 2 GPU slots are free (as slurm-packed runs a group whose
    # copies exceed the submission's mem_mb: tests/test_snakemake_plugin.py)
    cfg["experiments"][0]["methods"][1] = {"name": "scaffold"}
    write_config(tmp_path, cfg)
    assert planned_jobs(tmp_path).get("train") == 2
    snakemake(tmp_path, *gpu_profile, "--resources", "gpu_slots=2", "client_state_mb=1", *timeline, "copies.jsonl")
    assert not trains_overlapped(tmp_path / "copies.jsonl")
    assert planned_jobs(tmp_path) == {}
    # the HTML report of these outputs: tests/test_report.py (its own pipeline)


def test_a_run_warns_before_its_first_job_of_state_the_machine_cannot_hold(tmp_path: Path) -> None:
    """On one machine, where the training jobs to run could keep more per-client state
    (client_state_mb) with their processes than its memory and no `--resources
    client_state_mb` caps them, the run warns before its first job (common.smk's
    check_host_memory: slurm-packed's machine_warning, its cases in
    tests/test_snakemake_plugin.py); here FedCurv's three copies of a wide MLP for each of 100
    clients, more than this machine holds, and the job itself refuses before round 1."""
    from fedforget.utils import host_memory_limit

    limit = host_memory_limit()
    if limit is None:
        pytest.skip("no memory limit to read here (not Linux)")
    # digits' 64 inputs, one hidden layer of h, 10 classes: 75 h + 10 parameters; 3 x 100 copies
    hidden = limit[0] // (4 * 75 * 300) + 1000
    cfg = {"data_dir": "data", "experiments": [{
        "name": "wide", "datasets": [{"name": "digits", "model": {"name": "mlp", "options": {"hidden": [hidden]}}}],
        "partitions": [{"scheme": "iid", "clients": 100, "seed": 0}], "methods": [{"name": "fedcurv"}], "seeds": [0],
        "train": {"rounds": 1, "local_epochs": 1, "batch_size": 32, "sample_rate": 1.0}}]}  # fmt: skip
    write_config(tmp_path, cfg)
    proc = snakemake(tmp_path, check=False)
    assert proc.returncode != 0
    err = proc.stderr
    warned = err.find("fedforget: warning: the 1 training job to run here could keep")
    assert 0 <= warned < err.find("rule train"), err[-3000:]
    assert "the largest may not fit even alone" in err[warned:].splitlines()[0]
    log = next((tmp_path / "logs" / "train").rglob("seed0.log")).read_text()
    assert "method 'fedcurv' keeps 3 copies of the model's" in log
