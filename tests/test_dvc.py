"""The DVC steps of docs/data.md on fresh clones (issue 19): `make data` in clone A prepares every
shipped config's data and puts data/ into the DVC cache without changing data.dvc, `dvc push`
sends it to the default remote beside the clone, `dvc pull` in a fresh clone B fetches the same
bytes, and Snakemake in B then plans no preparation. Marked e2e: slower, still run in CI."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

from fedforget.finished import KEPT

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
VENV = Path(sys.prefix)
pytestmark = pytest.mark.e2e

# what a clone needs for the data steps: the rest of the repository plays no part in them
FILES = [
    "Makefile",
    ".gitignore",
    ".dvcignore",
    ".dvc/config",
    ".dvc/.gitignore",
    "data.dvc",
    "Snakefile",
]
DIRS = ["config", "workflow"]

for tool in ("make", "git", "dvc", "snakemake", "fedforget"):
    if shutil.which(tool, path=str(BIN) + os.pathsep + os.environ.get("PATH", "")) is None:
        pytest.skip(f"{tool} is not installed", allow_module_level=True)  # pragma: no cover


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PATH"] = str(BIN) + os.pathsep + e.get("PATH", "")
    e["DVC_NO_ANALYTICS"] = "1"
    e.pop("MAKEFLAGS", None)
    e.pop("MFLAGS", None)
    return e


def sh(cwd: Path, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def make(cwd: Path, target: str) -> subprocess.CompletedProcess:
    """The Makefile's target with this interpreter's environment as the venv; -o: the install
    step is not rerun (and is not needed: .installed may be missing)."""
    return sh(cwd, "make", "-o", f"{VENV}/.installed", target, f"VENV={VENV}")


def git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    ident = [
        "-c",
        "user.name=test",
        "-c",
        "user.email=test@example.com",
        "-c",
        "commit.gpgsign=false",
    ]
    return sh(cwd, "git", *ident, *args)


def dvc_ignored() -> tuple[set[str], set[str]]:
    """The repository's .dvcignore: (directory names, file names) it leaves out (a finished
    run's kept copy, fedforget.finished; a training process's run-directory lock, utils.dir_lock)."""
    lines = [ln.strip() for ln in (REPO / ".dvcignore").read_text().splitlines()]
    patterns = [ln for ln in lines if ln and not ln.startswith("#")]
    return {p.rstrip("/") for p in patterns if p.endswith("/")}, {p for p in patterns if not p.endswith("/")}


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` that a DVC remote shares: what .dvcignore lists stays on the
    machine that trained."""
    dirs, files = dvc_ignored()
    assert KEPT in dirs and ".lock" in files  # (the two the tests below expect left out)
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and not any(fnmatch(part, d) for part in p.relative_to(root).parts[:-1] for d in dirs)
        and not any(fnmatch(p.name, f) for f in files)
    }


def planned(workdir: Path, *args: str) -> dict[str, int]:
    out = sh(workdir, "snakemake", "-n", "--cores", "1", *args)
    text = out.stdout + out.stderr
    if "Nothing to be done" in text:
        return {}
    table = text.split("Job stats:")[1]
    return {
        m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m[1] != "total"
    }


def test_make_data_push_pull_round_trip(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    remote = tmp_path / "fedforget-dvc-remote"  # .dvc/config's default remote: beside the clone
    a.mkdir()
    for f in FILES:
        (a / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, a / f)
    for d in DIRS:
        shutil.copytree(REPO / d, a / d, ignore=shutil.ignore_patterns("__pycache__"))
    git(a, "init", "-q")
    git(a, "add", "-A")
    git(a, "commit", "-q", "-m", "clone")

    # clone A: prepare every shipped config's data, into the cache, data.dvc unchanged
    out = make(a, "data")
    assert "matches data.dvc" in out.stdout, out.stdout + out.stderr
    assert (a / "data.dvc").read_bytes() == (REPO / "data.dvc").read_bytes()
    assert json.loads(sh(a, "dvc", "status", "--json").stdout) == {}
    tracked = (REPO / "data.dvc").read_text()
    assert len(tree(a / "data")) == int(re.search(r"nfiles: (\d+)", tracked)[1])
    assert sh(a, "git", "status", "--porcelain").stdout == ""  # data/ ignored, nothing else touched

    sh(a, "dvc", "push")
    assert remote.is_dir() and any(p.is_file() for p in remote.rglob("*"))
    assert json.loads(sh(a, "dvc", "status", "--cloud", "--json").stdout) == {}

    # clone B: a fresh clone of A's commit (no data/, no cache) fetches the same bytes
    git(tmp_path, "clone", "-q", str(a), str(b))
    assert not (b / "data").exists() and not (b / ".dvc" / "cache").exists()
    sh(b, "dvc", "pull")
    assert tree(b / "data") == tree(a / "data")
    assert json.loads(sh(b, "dvc", "status", "--json").stdout) == {}

    # DVC writes files in parallel, in no fixed order: the worst case, every dataset newer than
    # the public sets cut from it, must still plan no preparation (rule prepare_public's input
    # is ancient; what the slice is a function of are its params)
    for meta in (b / "data").glob("*/meta.json"):
        if meta.parent.name != "public":
            os.utime(meta)

    # a second `make data` writes nothing: every file keeps its mtime
    mtimes = {p: p.stat().st_mtime_ns for p in (a / "data").rglob("*") if p.is_file()}
    make(a, "data")
    assert mtimes == {p: p.stat().st_mtime_ns for p in (a / "data").rglob("*") if p.is_file()}

    for args in [(), ("--configfile", "config/experiments/fedproj_pilot_iris.yaml")]:
        jobs = planned(b, *args)
        assert jobs.get("partition", 0) > 0, jobs  # the dry run did plan the pipeline
        assert not {"prepare_dataset", "prepare_public"} & set(jobs), (args, jobs)


@pytest.mark.long
def test_results_shared_through_a_cluster_remote_are_adopted_without_retraining(
    tmp_path: Path, minimal_config: dict
) -> None:
    """Results made on one machine (a cluster) reach a colleague through a second DVC
    remote: `dvc add data results`, `dvc push -r cluster`; a fresh clone `dvc pull -r
    cluster` gets the same bytes, whose mtimes are in no useful order (the worst case is set
    here), and `snakemake --touch` adopts them: nothing is retrained, and Snakemake then plans
    nothing. Results this checkout would not make (another config; CPU results on another
    torch thread count than the train jobs') are refused, untouched."""
    import yaml

    a, b = tmp_path / "a", tmp_path / "b"
    remote = tmp_path / "cluster-remote"  # a shared file system path; s3:// or ssh:// alike
    a.mkdir()
    for f in FILES:
        (a / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, a / f)
    shutil.copytree(REPO / "workflow", a / "workflow", ignore=shutil.ignore_patterns("__pycache__"))
    (a / "config").mkdir()
    (a / "config" / "config.yaml").write_text(yaml.safe_dump(minimal_config))
    sh(a, "snakemake", "--cores", "2")
    git(a, "init", "-q")
    sh(a, "dvc", "remote", "add", "cluster", str(remote))
    sh(a, "dvc", "add", "data", "results")
    git(a, "add", "-A")
    git(a, "commit", "-q", "-m", "results")
    sh(a, "dvc", "push", "-r", "cluster")

    git(tmp_path, "clone", "-q", str(a), str(b))
    sh(b, "dvc", "pull", "-r", "cluster")
    assert tree(b / "data") == tree(a / "data") and tree(b / "results") == tree(a / "results")
    assert list(a.glob(f"results/*/*/*/*/seed0/{KEPT}/run.json")) and not list(b.rglob(KEPT))
    files = sorted(p for d in ("data", "results") for p in (b / d).rglob("*") if p.is_file())
    for i, p in enumerate(reversed(files)):  # outputs older than their inputs: all of them
        os.utime(p, (1.7e9 + i, 1.7e9 + i))
    assert planned(b).get("train") == 1  # Snakemake alone would retrain

    # another config: its run is refused by name, and nothing is touched
    other = json.loads(json.dumps(minimal_config))
    other["experiments"][0]["train"] = {"optimizer": {"lr": 0.02}}
    (b / "config" / "config.yaml").write_text(yaml.safe_dump(other))
    mtimes = {p: p.stat().st_mtime_ns for p in files}
    refused = sh(b, "snakemake", "--touch", "--cores", "1", check=False)
    assert refused.returncode != 0
    assert re.search(r"results/tiny/iris/\S+/fedavg/seed0: config hash", refused.stdout + refused.stderr)
    assert mtimes == {p: p.stat().st_mtime_ns for p in files}

    # the config they were made with, but train jobs on another torch thread count than the
    # CPU run's (the default profile's 1): refused by name with both counts, nothing touched
    (b / "config" / "config.yaml").write_text(yaml.safe_dump(minimal_config))
    refused = sh(b, "snakemake", "--touch", "--cores", "2", "--set-threads", "train=2", check=False)
    assert refused.returncode != 0
    said = refused.stdout + refused.stderr
    assert re.search(r"fedavg/seed0: torch threads 1 on the CPU \(this invocation's train jobs: 2\)", said), said
    assert "adopt them with --set-threads train=1 --cores 1" in said
    assert mtimes == {p: p.stat().st_mtime_ns for p in files}

    # the config they were made with: adopted as they are
    sh(b, "snakemake", "--touch", "--cores", "1")
    assert planned(b) == {}
    assert tree(b / "results") == tree(a / "results")
