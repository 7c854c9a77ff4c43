"""fedforget.finished: a finished run's outputs kept under .finished/ by `fedforget train`, and
put back instead of training again when the same run is asked for after Snakemake deleted them
(a failed job of a group deletes its finished siblings' outputs: tests/test_slurm.py shows it
on a real scheduler)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from fedforget import cli
from fedforget.finished import INPUTS, KEPT, OUTPUTS, keep, why_not_restored
from fedforget.utils import canonical_json


@pytest.fixture
def train(monkeypatch):
    """`fedforget train` in this process (its process-wide malloc settings left out); returns
    (exit code, stdout) and counts the runs it trained in ``train.trained``."""
    import fedforget.runner as runner

    monkeypatch.setattr(cli, "keep_freed_memory", lambda: None)
    real = runner.run_training
    trained: list[str] = []

    def counted(rc, out, **kw):
        trained.append(str(out))
        return real(rc, out, **kw)

    monkeypatch.setattr(runner, "run_training", counted)

    def run(rc, out: Path, *extra: str) -> int:
        return cli.main(
            ["train", "--config-json", canonical_json(rc.to_dict()), "--out", str(out), *extra]
        )

    run.trained = trained
    return run


def outputs(out: Path) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in OUTPUTS}


def test_a_finished_run_whose_outputs_were_deleted_is_put_back_not_trained(
    make_run_config, train, tmp_path, capsys
):
    rc = make_run_config(rounds=2)
    out = tmp_path / "run"
    assert train(rc, out) == 0 and len(train.trained) == 1
    first = outputs(out)
    kept = out / KEPT
    assert sorted(p.name for p in kept.iterdir()) == sorted([*OUTPUTS, INPUTS])
    for name in OUTPUTS:  # hard links: nothing more on disk
        assert os.path.samefile(out / name, kept / name), name
    capsys.readouterr()

    for name in OUTPUTS:  # what Snakemake does to every job of a failed group
        (out / name).unlink()
        os.utime(kept / name, (1e9, 1e9))  # made long ago
    start = time.time()
    assert train(rc, out) == 0
    assert len(train.trained) == 1, "trained again"
    assert outputs(out) == first
    said = capsys.readouterr().out
    assert "not trained again" in said and f"{out}/{KEPT}" in said and "--fresh" in said
    # outputs newer than the run's inputs for Snakemake: their time is the restore's
    assert all((out / n).stat().st_mtime >= start - 1 for n in OUTPUTS)

    # asked again with its outputs in place: put back too (a group's retry runs every job);
    # a checkpoint found there (never left by this run, which finished) is not read, and goes
    (out / "checkpoint.pt").write_bytes(b"not a checkpoint")
    assert train(rc, out) == 0 and len(train.trained) == 1 and outputs(out) == first
    assert not (out / "checkpoint.pt").exists()


def test_another_config_fresh_or_a_failed_run_trains_and_drops_the_copy(
    make_run_config, train, tmp_path, monkeypatch
):
    rc = make_run_config(rounds=2)
    out = tmp_path / "run"
    assert train(rc, out) == 0

    def kept_hash() -> str:
        return json.loads((out / KEPT / "run.json").read_text())["config_hash"]

    assert kept_hash() == rc.hash

    other = make_run_config(
        rounds=3
    )  # another config in the same directory: trained, its copy kept
    assert "config changed" in why_not_restored(other, out, "cpu", 1)
    assert train(other, out) == 0 and len(train.trained) == 2 and kept_hash() == other.hash

    assert train(other, out, "--fresh") == 0 and len(train.trained) == 3  # asked to train anyway

    import fedforget.runner as runner

    def fails(rc, out, **kw):
        raise RuntimeError("CUDA out of memory (injected)")

    monkeypatch.setattr(runner, "run_training", fails)
    # rc's copy was replaced by other's: this one trains, and fails (out of memory: one line, exit 2)
    assert train(rc, out) == 2
    assert not (out / KEPT).exists(), "a copy kept for a run that did not finish this time"


def test_the_copy_is_restored_only_on_the_same_device_threads_and_versions(make_run_config, train, tmp_path, monkeypatch):
    """The bytes of a CPU result depend on its torch threads (provenance.threads_differ), a
    GPU's result is another than a CPU's or another GPU model's, and another torch may round
    otherwise: a copy made elsewhere, or with other packages, trains again."""
    rc = make_run_config(rounds=2)
    out = tmp_path / "run"
    assert train(rc, out) == 0
    rec = json.loads((out / "run.json").read_text())
    device = rec["device"].split(":")[0]
    assert why_not_restored(rc, out, device, rec["torch_threads"]) is None
    other = "cuda" if device == "cpu" else "cpu"
    assert (
        why_not_restored(rc, out, other, rec["torch_threads"])
        == f"trained on {device}, this job runs on {other}"
    )
    if device == "cpu":
        assert "torch threads 1" in why_not_restored(rc, out, "cpu", 2)
    import fedforget.finished as finished

    now = finished.package_versions()
    monkeypatch.setattr(finished, "package_versions", lambda: {**now, "torch": "0.0.1", "dvc": "9"})
    said = why_not_restored(rc, out, device, rec["torch_threads"])
    assert said == f"other versions: torch {now['torch']} (now 0.0.1)"  # dvc runs no arithmetic
    monkeypatch.undo()

    on_gpu = {**rec, "device": "cuda:0", "host": {**rec["host"], "gpu": "NVIDIA A100-SXM4-80GB"}}
    (out / KEPT / "run.json").write_text(json.dumps(on_gpu))
    assert why_not_restored(rc, out, "cuda", None, "NVIDIA A100-SXM4-80GB") is None
    assert why_not_restored(rc, out, "cuda", None, "NVIDIA H200") == (
        "trained on a NVIDIA A100-SXM4-80GB, this job runs on a NVIDIA H200"
    )
    (out / KEPT / "model.pt").unlink()
    assert "model.pt missing" in why_not_restored(rc, out, device, rec["torch_threads"])


def test_a_copy_made_from_other_inputs_trains_again(make_run_config, train, tmp_path):
    """Snakemake reruns a job whose inputs are newer; when their bytes changed too (a partition
    drawn anew, a dataset prepared from other files), the kept result is not theirs."""
    import numpy as np

    rc = make_run_config(rounds=2)
    out = tmp_path / "run"
    assert train(rc, out) == 0
    rec = json.loads((out / "run.json").read_text())
    device, threads = rec["device"].split(":")[0], rec["torch_threads"]
    assert why_not_restored(rc, out, device, threads) is None
    assignment = Path(rc.partition_dir) / "assignment.npy"
    assert not assignment.exists()  # without the workflow the partition is drawn in memory
    assignment.parent.mkdir(parents=True, exist_ok=True)
    np.save(assignment, np.zeros(3, dtype=np.int64))
    assert why_not_restored(rc, out, device, threads) == f"inputs changed since: {assignment}"
    for name in OUTPUTS:
        (out / name).unlink()
    assignment.unlink()  # the inputs it was made from again: put back
    assert train(rc, out) == 0 and len(train.trained) == 1


def test_keep_takes_a_whole_run_only(make_run_config, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    for name in OUTPUTS[:-1]:
        (out / name).write_text(name)
    assert keep(make_run_config(), out) is False and not (out / KEPT).exists()  # no run.json: not finished


def test_the_training_code_digest_leaves_this_module_out():
    """Finished runs are not rerun for a change here (provenance.training_code)."""
    from fedforget.provenance import training_code

    assert "finished.py" not in training_code("fedavg").files
    assert "cli.py" not in training_code("fedavg").files


def test_the_kept_outputs_are_rule_trains(repo_root):
    """What a kept copy holds is every output Snakemake's rule train declares (a restored run
    missing one would fail the job)."""
    import re

    text = (repo_root / "workflow" / "rules" / "train.smk").read_text()
    block = text.split("output:", 1)[1].split("params:", 1)[0]
    assert sorted(re.findall(r"seed\{\{seed\}\}/([\w.]+)\"", block)) == sorted(OUTPUTS)


def test_runs_that_stopped_outside_snakemake_have_their_run_json_set_aside(tmp_path):
    """``set_aside_stopped`` (common.smk, at parse): a run.json that is not an end (running:
    a `fedforget train` killed, here after every other output of rule train was written;
    failed) is moved to run.stopped.json where no process holds the directory, so that
    Snakemake, run.json missing, trains the run again; ended runs, and one whose process still
    holds its lock, are left as they are."""
    from fedforget.finished import STOPPED, set_aside_stopped
    from fedforget.utils import dir_lock

    dirs = {}
    for status in ("running", "failed", "completed", "diverged", "busy", "none"):
        d = dirs[status] = tmp_path / status
        d.mkdir()
        if status != "none":
            (d / "run.json").write_text(json.dumps({"status": "running" if status == "busy" else status}))
            for name in OUTPUTS[:-1]:
                (d / name).write_text("x")
    with dir_lock(dirs["busy"], "training a run"):  # a process that trains it now
        moved, unknown = set_aside_stopped(str(d) for d in dirs.values())
    assert sorted(moved) == sorted(str(dirs[s]) for s in ("running", "failed")) and unknown == []
    for s in ("running", "failed"):
        assert not (dirs[s] / "run.json").exists() and json.loads((dirs[s] / STOPPED).read_text())["status"] == s
    for s in ("completed", "diverged", "busy"):
        assert (dirs[s] / "run.json").is_file() and not (dirs[s] / STOPPED).exists()
    assert set_aside_stopped(str(d) for d in dirs.values()) == ([str(dirs["busy"])], [])  # its lock let go
