"""The cluster profile against a real scheduler (issue 18): a one-node SLURM cluster on this
machine (tests/slurm/cluster.sh), the default pipeline through `--workflow-profile
profiles/slurm` with only the profile's CLUSTER keys changed for this node, its training jobs
two to a submission and trained there at once (the `slurm-packed` executor, issue 32), and one
training job that fails at once in its first submission, then, resubmitted, is cancelled with
scancel in the middle of its run: Snakemake's retry resubmits it, it resumes from its last round
checkpoint, and every result equals a local run's byte for byte. The job that shares its first
submission finishes there; Snakemake deletes its outputs when the group fails, and `fedforget
train` puts them back in the retries instead of training it again (fedforget.finished).

The default config is run at CI size (one seed, one partition, fewer rounds): every rule of
the pipeline, both experiments, every method. Marked e2e.

`make test` installs nothing on your machine (issue 34, 13): the scheduler test runs where
SLURM is already installed (slurmctld, munged and sbatch on PATH), or where the environment
sets FEDFORGET_SLURM_INSTALL=1 (.ci/run does): only then may cluster.sh install Debian's
slurm-wlm and munge with apt. Anywhere else it is skipped with NOT_INSTALLED, which says how
to run it; also skipped, saying why, where SLURM cannot be set up (not root, no apt-get, or a
real cluster's slurm.conf on this machine). The tests of that decision run everywhere."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CLUSTER = REPO / "tests" / "slurm" / "cluster.sh"

# what cluster.sh checks before it installs anything (`command -v`, the same PATH); the
# switch that lets it install (CI: .ci/run), and the skip reason where neither holds
SLURM_BINARIES = ("slurmctld", "munged", "sbatch")
INSTALL_SWITCH = "FEDFORGET_SLURM_INSTALL"
NOT_INSTALLED = (
    "SLURM is not installed: the scheduler tests run where it is, or with "
    f"{INSTALL_SWITCH}=1 (CI), which installs slurm-wlm and munge with apt"
)

# the run scancel interrupts: long enough (6 rounds, about 1 s each under SLURM here) to be
# caught after its first checkpoint and before its end. The profile polls job states 1 s after
# a submission, then every 2 s (slurm-packed-max-seconds-between-status-checks; the SLURM
# plugin's 10 s longer each time, 1, 12, 33, 64 s, saw a 35 s submission end at 64 s)
PREEMPTED = "results/embedded/digits/dirichlet-0.1_k20_min10_ps0/fedavg/seed0"
RUN_FILES = ("metrics.csv", "tasks.csv", "accuracy_matrix.csv", "model.pt")
SUMMARY_FILES = ("table.csv", "continual.csv", "accuracy_matrix.csv")


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    e["PATH"] = str(BIN) + os.pathsep + e.get("PATH", "")
    return e


def not_installed(environ: Mapping[str, str]) -> str | None:
    """Why the test cluster must not be set up here (NOT_INSTALLED), or None where it may:
    SLURM is installed (every SLURM_BINARIES on environ's PATH, so cluster.sh installs
    nothing), or environ asks for the install (INSTALL_SWITCH=1)."""
    path = environ.get("PATH", "")
    if all(shutil.which(b, path=path) for b in SLURM_BINARIES):
        return None
    return None if environ.get(INSTALL_SWITCH) == "1" else NOT_INSTALLED


def one_node_cluster(environ: Mapping[str, str]) -> Iterator[Path]:
    """Yields the state directory of a running one-node cluster; its daemons stopped
    afterwards, by their PIDs. cluster.sh runs only where not_installed() allows it, in
    environ. The state directory is world-traversable: slurmctld runs as the slurm user."""
    reason = not_installed(environ)
    if reason is not None:
        pytest.skip(reason)
    state = Path(tempfile.mkdtemp(prefix="fedforget-slurm-"))
    state.chmod(0o755)
    up = subprocess.run(
        ["bash", str(CLUSTER), "up", str(state)],
        env=dict(environ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if up.returncode == 3:
        shutil.rmtree(state, ignore_errors=True)
        pytest.skip(up.stderr.strip().splitlines()[-1])
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield state
    finally:
        subprocess.run(["bash", str(CLUSTER), "down", str(state)], env=dict(environ), timeout=120)
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm() -> Iterator[Path]:
    yield from one_node_cluster(os.environ)


def ci_config() -> dict:
    """config/config.yaml at CI size: the same experiments, models and methods; the first
    dataset, partition and seed of each, fewer rounds."""
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for e in cfg["experiments"]:
        e["datasets"] = e["datasets"][:1]
        e["seeds"] = [0]
        e["partitions"] = e["partitions"][:1]
        scenarios = [d["scenario"] for d in e["datasets"] if "scenario" in d]
        if scenarios:
            for s in scenarios:
                s["rounds_per_task"] = 1
            e["train"]["rounds"] = scenarios[0]["tasks"]
        else:
            e["train"]["rounds"] = 6
    return cfg


def cluster_profile() -> dict:
    """profiles/slurm with its CLUSTER keys set for this node (a CPU-only partition 'debug',
    2 cores) and the settings of a cluster without accounting (squeue for job status)."""
    p = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    p["default-resources"]["slurm_partition"] = "debug"
    p["default-resources"]["mem_mb"] = 1000
    p["set-threads"]["train"] = 1
    p["set-resources"]["train"].update(gpu=0, cpus_per_task=1, mem_mb=1500, runtime=10)
    p["group-components"] = ["train=2"]  # 2 submissions of 2 jobs each, run at once in it
    p["resources"] = ["gpu=0", "cpus_per_task=1", "mem_mb=1500"]
    p.update(
        {
            "slurm-packed-no-account": True,
            "slurm-packed-status-command": "squeue",
            "slurm-packed-init-seconds-before-status-checks": 1,
            "slurm-packed-max-seconds-between-status-checks": 2,
            "slurm-packed-keep-successful-logs": True,  # read by launched_at_once()
            # a small job's process (benchmarks/process_memory.py: the embedded digits, 722 MiB
            # on a CPU, cpu-2026-12-08) besides the default's GPU ResNet-18; 2 fit in the 1,500 MB asked
            "slurm-packed-process-mb": 700,
        }
    )
    return p


def workdir(root: Path, profile: dict | None) -> Path:
    root.mkdir()
    (root / "config").mkdir()
    shutil.copy2(REPO / "config" / "paper_results.csv", root / "config")
    (root / "config" / "config.yaml").write_text(yaml.safe_dump(ci_config(), sort_keys=False))
    if profile is not None:
        (root / "profiles" / "slurm").mkdir(parents=True)
        (root / "profiles" / "slurm" / "config.yaml").write_text(yaml.safe_dump(profile))
    return root


def snakemake(cwd: Path, *args: str, environ: Mapping[str, str] | None = None) -> subprocess.Popen:
    cmd = ["snakemake", "-s", str(REPO / "Snakefile"), *args]
    return subprocess.Popen(
        cmd, cwd=cwd, env=dict(environ or env()), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def failing_once(root: Path, run: str) -> dict[str, str]:
    """env() with a `fedforget` first on PATH whose first `train` of ``run`` fails at once (as
    a job that runs out of GPU memory would, later); every other call is the real one's."""
    root.mkdir()
    (root / "fedforget").write_text(
        "#!/bin/sh\n"
        f'case "$*" in *"--out {run} "*) mkdir "{root}/failed" 2>/dev/null && '
        '{ echo "injected failure" >&2; exit 1; };; esac\n'
        f'exec "{BIN}/fedforget" "$@"\n'
    )
    (root / "fedforget").chmod(0o755)
    e = env()
    e["PATH"] = str(root) + os.pathsep + e["PATH"]
    return e


def preempt(cluster_dir: Path, cancelled: list[str], stop: threading.Event) -> None:
    """Once PREEMPTED has a round checkpoint, scancel the SLURM job running it (its run.json
    names the job while it runs)."""
    run = cluster_dir / PREEMPTED
    while not stop.is_set():
        if (run / "checkpoint.pt").exists():
            job = json.loads((run / "run.json").read_text())["host"]["slurm_job_id"]
            subprocess.run(["scancel", job], check=True)
            cancelled.append(job)
            return
        time.sleep(0.1)


def launched_at_once(cluster_dir: Path, job: str, jobs: int) -> bool:
    """Whether the Snakemake inside SLURM job ``job`` (its log: the plugin's slurm_logs) started
    all ``jobs`` training jobs of its submission before any of them finished. [D] Not the runs'
    spans in run.json: a digits run takes 1-5 s, and on a loaded machine (CI) one ended before
    its sibling's process had imported torch and written its start (seen once)."""
    log = (cluster_dir / ".snakemake" / "slurm_logs" / "group_train_train" / f"{job}.log").read_text()
    first_end = re.search(r"^Finished job", log, re.M)
    head = log[: first_end.start()] if first_end else log
    return f"Execute {jobs} jobs" in head and head.count("localrule train:") == jobs


def jobcomp(state: Path) -> dict[str, str]:
    """JobId -> JobState from the job-completion log (what sacct would list)."""
    text = (state / "log" / "jobcomp.txt").read_text()
    return dict(re.findall(r"JobId=(\d+) .*?JobState=(\w+)", text))


@pytest.mark.e2e
@pytest.mark.skipif(
    shutil.which("snakemake", path=str(BIN)) is None,
    reason="snakemake is not installed (pip install -e .[workflow])",
)
def test_pipeline_through_slurm_with_a_preempted_job_equals_a_local_run(slurm, tmp_path) -> None:
    local = workdir(tmp_path / "local", None)
    cluster = workdir(tmp_path / "cluster", cluster_profile())
    # the reference: what the comparison below reads (training and tables; the local plot
    # rules add nothing to it, and the cluster run draws the figures through the profile)
    local_run = snakemake(local, "--cores", "1", "--until", "aggregate", "aggregate_continual")
    cancelled: list[str] = []
    stop = threading.Event()
    watcher = threading.Thread(target=preempt, args=(cluster, cancelled, stop), daemon=True)
    watcher.start()
    cluster_run = snakemake(cluster, "--workflow-profile", "profiles/slurm",
                            environ=failing_once(tmp_path / "bin", PREEMPTED))  # fmt: skip
    try:
        out, _ = cluster_run.communicate(timeout=480)
    finally:
        stop.set()
        cluster_run.kill()
        # the cancelled job's own Snakemake (its --wait-for-files names this directory) can
        # outlive scancel and the cluster (seen here: 18 minutes after the suite ended)
        if shutil.which("pkill"):
            subprocess.run(["pkill", "-KILL", "-f", f"{cluster}/"], check=False)
    local_out, _ = local_run.communicate(timeout=300)
    assert local_run.returncode == 0, local_out[-4000:]
    assert cluster_run.returncode == 0, out[-6000:]

    # the training jobs went through sbatch; the cancelled one was resubmitted and resumed
    assert cancelled, "the training job was not caught running after its first checkpoint"
    states = jobcomp(slurm)
    assert all(states[i] == "CANCELLED" for i in cancelled), states
    assert list(states.values()).count("COMPLETED") >= 2, states
    runs = sorted(cluster.glob("results/*/*/*/*/seed0/run.json"))
    assert len(runs) == len(list(local.glob("results/*/*/*/*/seed0/run.json"))) == 4
    records = {str(p.parent.relative_to(cluster)): json.loads(p.read_text()) for p in runs}
    assert all(r["host"]["slurm_job_id"] in states for r in records.values()), records
    # the jobs of one submission trained at once (slurm-packed), not one after another: its
    # Snakemake started both before either finished
    by_job: dict[str, list[str]] = {}
    for run, r in records.items():
        by_job.setdefault(r["host"]["slurm_job_id"], []).append(run)
    shared = {job: runs for job, runs in by_job.items() if len(runs) > 1}
    assert shared, by_job
    # so did every submission of a group (2 jobs each), the failed and the cancelled ones too
    # (the plugin once sent one of two groups submitted together to slurm-jobstep --jobs 1)
    logs = cluster / ".snakemake" / "slurm_logs" / "group_train_train"
    groups = sorted(p.stem for p in logs.glob("*.log"))
    assert len(groups) >= 3 and set(cancelled) | set(shared) <= set(groups), (groups, states)
    assert all(launched_at_once(cluster, job, 2) for job in groups), groups
    # PREEMPTED failed at once in its first submission, where its sibling (Snakemake's grouping
    # varies) finished: Snakemake deleted the sibling's outputs (and again when the next attempt
    # was cancelled) and ran the group again, where `fedforget train` put the sibling's kept
    # outputs back (fedforget.finished): its record is the failed submission's, not trained again
    failed = [i for i, st in states.items() if st == "FAILED"]
    assert len(failed) == 1 and (tmp_path / "bin" / "failed").is_dir(), states
    sibling = [run for run, r in records.items() if r["host"]["slurm_job_id"] == failed[0]]
    assert len(sibling) == 1 and sibling[0] != PREEMPTED, (sibling, states)
    assert re.search(rf"Removing output files of failed job train[^\n]*\n[^\n]*{re.escape(sibling[0])}/", out), out[-6000:]
    resumed = records[PREEMPTED]
    assert resumed["resumed_after_round"] >= 1 and resumed["host"]["slurm_job_id"] not in cancelled
    assert all(
        "slurm_job_id" not in json.loads(p.read_text())["host"]
        for p in local.glob("results/*/*/*/*/seed0/run.json")
    )

    # every result equals the local run's, byte for byte
    compared = 0
    for run in records:
        for name in RUN_FILES:
            assert (cluster / run / name).read_bytes() == (local / run / name).read_bytes(), (run, name)
            compared += 1
    for summary in local.glob("results/*/summary"):
        for name in SUMMARY_FILES:
            if (summary / name).exists():
                twin = cluster / summary.relative_to(local) / name
                assert twin.read_bytes() == (summary / name).read_bytes(), twin
                compared += 1
    assert compared >= 4 * len(RUN_FILES) + 3

    # jobs whose client model copies (SCAFFOLD's, resource client_state_mb: 12 MiB each here)
    # and processes exceed their submission's mem_mb (1 MB here; this cluster does not enforce
    # it) train in it one after another, with a warning, and complete: a new experiment of 2 such runs
    cfg = ci_config()
    packed = json.loads(json.dumps(cfg["experiments"][0]))
    packed.update(name="packed", methods=[{"name": "scaffold"}], seeds=[0, 1])
    packed["train"]["rounds"] = 2
    cfg["experiments"].append(packed)
    (cluster / "config" / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    profile = cluster_profile()
    profile["set-resources"]["train"]["mem_mb"] = 1
    (cluster / "profiles" / "slurm" / "config.yaml").write_text(yaml.safe_dump(profile))
    again = snakemake(cluster, "--workflow-profile", "profiles/slurm")
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out[-6000:]
    assert re.search(r"slurm-packed: the 2 training jobs of one submission \(jobids \d+, \d+\) keep 24 MiB of per-client "
                     r"state together \(client_state_mb\) and take 700 MB each for their process \(slurm-packed-process-mb\), "
                     r"1,424 in all, more than its mem_mb 1: they run there one at a time", out), out[-6000:]  # fmt: skip
    new = sorted(p.stem for p in logs.glob("*.log") if p.stem not in groups)
    assert len(new) == 1 and not launched_at_once(cluster, new[0], 2), new
    runs = sorted(cluster.glob("results/packed/*/*/*/seed*/run.json"))
    assert len(runs) == 2 and all(json.loads(p.read_text())["status"] == "completed" for p in runs), runs


# --- whether `make test` may install SLURM (issue 34, 13): no scheduler, no apt, run everywhere


def fake_binaries(root: Path, names) -> str:
    """A PATH directory holding executables with these names (they are never run)."""
    root.mkdir()
    for name in names:
        (root / name).write_text("#!/bin/sh\nexit 99\n")
        (root / name).chmod(0o755)
    return str(root)


@pytest.fixture
def cluster_sh(monkeypatch) -> list[list[str]]:
    """Every command one_node_cluster runs, recorded instead of run: `up` succeeds."""
    calls: list[list[str]] = []

    def run(cmd, **kwargs):
        calls.append([*cmd, kwargs["env"].get(INSTALL_SWITCH, "")])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", run)
    return calls


@pytest.mark.parametrize("switch", [None, "", "0", "yes"])
def test_without_slurm_or_the_switch_nothing_is_installed_and_the_skip_says_how(
    cluster_sh, tmp_path, switch
) -> None:
    """SLURM missing (sbatch alone, as on a login node, counts as missing) and no
    FEDFORGET_SLURM_INSTALL=1: cluster.sh (whose `up` would apt-get install slurm-wlm and
    munge) is not run, and the test is skipped with the one line that says how to run it."""
    environ = {"PATH": fake_binaries(tmp_path / "bin", ["sbatch"])}
    if switch is not None:
        environ[INSTALL_SWITCH] = switch
    with pytest.raises(pytest.skip.Exception) as skipped:
        next(one_node_cluster(environ))
    assert cluster_sh == []
    assert skipped.value.msg == NOT_INSTALLED and "\n" not in NOT_INSTALLED
    assert f"{INSTALL_SWITCH}=1" in NOT_INSTALLED and "apt" in NOT_INSTALLED


@pytest.mark.parametrize("installed", [True, False])
def test_with_slurm_installed_or_the_switch_the_cluster_is_set_up(
    cluster_sh, tmp_path, installed
) -> None:
    """SLURM on PATH (cluster.sh then installs nothing), or the CI switch without it: `up`
    runs, in that environment (the switch reaches cluster.sh), and `down` afterwards."""
    names = SLURM_BINARIES if installed else ()
    environ = {"PATH": fake_binaries(tmp_path / "bin", names)}
    if not installed:
        environ[INSTALL_SWITCH] = "1"
    assert not_installed(environ) is None
    cluster = one_node_cluster(environ)
    state = next(cluster)
    cluster.close()
    switch = "" if installed else "1"
    assert cluster_sh == [
        ["bash", str(CLUSTER), "up", str(state), switch],
        ["bash", str(CLUSTER), "down", str(state), switch],
    ]
    assert not state.exists()
