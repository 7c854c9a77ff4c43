"""Reliability of one training job: checkpoints, resume after SIGKILL, determinism of
metrics.csv, stale and damaged checkpoints, and nothing lost when a job fails."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fedforget.partition import PartitionSpec
from fedforget.runner import CHECKPOINT, run_training
from fedforget.utils import FedForgetError, canonical_json

BIN = Path(sys.executable).parent


def _digits(make_run_config, rounds=14, **kw):
    """~0.2 s per round on one thread: slow enough to be killed in the middle."""
    return make_run_config(
        dataset="digits", model="cnn2d", partition=PartitionSpec("dirichlet", clients=10, alpha=0.5, seed=0),
        rounds=rounds, sample_rate=0.5, local_epochs=1, batch_size=32, eval_local_models=False, **kw,
    )  # fmt: skip


def _train_cmd(rc, out):
    return [
        str(BIN / "fedforget"),
        "train",
        "--config-json",
        canonical_json(rc.to_dict()),
        "--out",
        str(out),
    ]


def _weights_equal(a: Path, b: Path) -> bool:
    wa, wb = torch.load(a), torch.load(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _interrupted(monkeypatch, rc, out: Path, after: int) -> None:
    """Run ``rc`` into ``out`` until an exception in the metrics writer after round ``after``
    (a crash): its checkpoint of that round is left there."""
    import fedforget.runner as runner

    real = runner.metrics_csv

    def crash(rows):
        if rows[-1]["round"] == after:
            raise KeyboardInterrupt
        return real(rows)

    monkeypatch.setattr(runner, "metrics_csv", crash)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_training(rc, out, progress=False)
    finally:
        monkeypatch.setattr(runner, "metrics_csv", real)


def test_same_config_same_metrics_csv_bytes(make_run_config, tmp_path):
    rc = make_run_config(rounds=3, sample_rate=0.5)
    run_training(rc, tmp_path / "a", progress=False)
    run_training(rc, tmp_path / "b", progress=False)
    assert (tmp_path / "a/metrics.csv").read_bytes() == (tmp_path / "b/metrics.csv").read_bytes()
    assert _weights_equal(tmp_path / "a/model.pt", tmp_path / "b/model.pt")
    # wall-clock values live apart, in timings.csv, one row per round
    header = (tmp_path / "a/timings.csv").read_text().splitlines()[0]
    assert header == "round,train_time_s,eval_time_s,elapsed_s"
    assert "time" not in (tmp_path / "a/metrics.csv").read_text().splitlines()[0]
    assert not (tmp_path / "a" / CHECKPOINT).exists()  # removed when the run ends


def test_checkpoint_round_trip_through_disk(make_run_config, tmp_path, monkeypatch):
    """A crash after round 2 (here: an exception in the metrics writer) leaves a checkpoint
    of round 2; the next call resumes from it and ends where an uninterrupted run ends."""
    rc = make_run_config(rounds=4, sample_rate=0.5, method="scaffold")
    run_training(rc, tmp_path / "full", progress=False)
    _interrupted(monkeypatch, rc, tmp_path / "cut", after=2)
    ckpt = torch.load(tmp_path / "cut" / CHECKPOINT, weights_only=False)
    assert ckpt["round"] == 2 and ckpt["config_hash"] == rc.hash
    failed = json.loads((tmp_path / "cut/run.json").read_text())
    assert failed["status"] == "failed" and failed["checkpoints_written"] == 2  # rounds 1 and 2

    rec = run_training(rc, tmp_path / "cut", progress=False)
    assert rec["status"] == "completed" and rec["resumed_after_round"] == 2
    assert rec["checkpoints_written"] == 1  # this process: round 3 (never the last)
    assert (tmp_path / "cut/metrics.csv").read_bytes() == (
        tmp_path / "full/metrics.csv"
    ).read_bytes()
    assert _weights_equal(tmp_path / "cut/model.pt", tmp_path / "full/model.pt")
    assert not (tmp_path / "cut" / CHECKPOINT).exists()


def test_stale_checkpoint_of_another_config_is_discarded(make_run_config, tmp_path):
    rc = make_run_config(rounds=3)
    other = replace(rc, train=replace(rc.train, optimizer=replace(rc.train.optimizer, lr=0.05)))
    assert other.hash != rc.hash
    torch.save({"format": 1, "config_hash": other.hash, "round": 1}, tmp_path / CHECKPOINT)
    rec = run_training(rc, tmp_path, progress=False)
    assert rec["status"] == "completed" and "resumed_after_round" not in rec
    run_training(rc, tmp_path / "ref", progress=False)
    assert (tmp_path / "metrics.csv").read_bytes() == (tmp_path / "ref/metrics.csv").read_bytes()


def test_checkpoint_of_other_code_is_discarded(make_run_config, tmp_path, monkeypatch):
    """A checkpoint records the digest of the code that computed it (run.json's code_digest);
    a run resumed after that code changed starts over, as after a config change, and ends as
    an uninterrupted run; one of the same code resumes; one written before the record loads."""
    rc = make_run_config(rounds=4, sample_rate=0.5)
    run_training(rc, tmp_path / "ref", progress=False)
    for name, edit in (("same", None), ("other", "0" * 64), ("unrecorded", "drop")):
        out = tmp_path / name
        _interrupted(monkeypatch, rc, out, after=2)
        ckpt = torch.load(out / CHECKPOINT, weights_only=False)
        assert ckpt["code_digest"] == json.loads((out / "run.json").read_text())["code_digest"]
        if edit == "drop":
            del ckpt["code_digest"]
        elif edit:
            ckpt["code_digest"] = edit
        torch.save(ckpt, out / CHECKPOINT)
        rec = run_training(rc, out, progress=False)
        assert rec["status"] == "completed"
        assert rec.get("resumed_after_round") == (None if name == "other" else 2), name
        assert (out / "metrics.csv").read_bytes() == (tmp_path / "ref/metrics.csv").read_bytes(), name


def test_a_checkpoint_of_other_inputs_starts_over_other_versions_or_device_are_refused(make_run_config, tmp_path, monkeypatch):
    """A checkpoint records its input files' digests, the numeric packages' versions and the
    device (runner.resume_host): other inputs (data or partition prepared again) start the run
    over and it ends as an uninterrupted run; other versions or another device type are
    refused, naming them; another GPU model resumes, noted in run.json; a checkpoint written
    before the record resumes."""
    rc = make_run_config(rounds=4, sample_rate=0.5)
    run_training(rc, tmp_path / "ref", progress=False)
    for name in ("inputs", "versions", "device", "gpu", "unrecorded"):
        out = tmp_path / name
        _interrupted(monkeypatch, rc, out, after=2)
        ckpt = torch.load(out / CHECKPOINT, weights_only=False)
        host = ckpt["resume_host"]
        assert host["device"] == "cpu" and host["versions"]["torch"] and host["inputs"]
        if name == "inputs":
            host["inputs"] = {f: "0" * 64 for f in host["inputs"]}
        elif name == "versions":
            host["versions"]["torch"] = "0.0"
        elif name == "device":
            host.update(device="cuda", gpu="NVIDIA H100")
        elif name == "gpu":  # a retry on another GPU model (here: as if the CPU were one)
            host.update(gpu="NVIDIA H100")
        else:
            del ckpt["resume_host"]
        torch.save(ckpt, out / CHECKPOINT)
        if name in ("versions", "device"):
            what = "torch 0.0 (now" if name == "versions" else "device cuda (now cpu)"
            with pytest.raises(FedForgetError, match=rf"was computed with {re.escape(what)}.*--fresh"):
                run_training(rc, out, progress=False)
            assert (out / CHECKPOINT).exists()  # kept: the user decides
            continue
        rec = run_training(rc, out, progress=False)
        assert rec.get("resumed_after_round") == (None if name == "inputs" else 2), name
        assert ("resumed_on_another_gpu" in rec) == (name == "gpu"), name
        assert (out / "metrics.csv").read_bytes() == (tmp_path / "ref/metrics.csv").read_bytes(), name


def test_fresh_discards_the_checkpoint_and_one_process_trains_a_run(make_run_config, tmp_path, monkeypatch):
    """``resume=False`` (train --fresh, run --force) deletes the checkpoint at its start, so a
    crash before its first checkpoint does not leave the old one to be resumed; a second
    process on the same run directory is refused while the first holds it; a leftover
    temporary directory of finished.keep is cleared."""
    import fedforget.runner as runner
    from fedforget.utils import dir_lock

    rc = make_run_config(rounds=4, sample_rate=0.5)
    out = tmp_path / "run"
    _interrupted(monkeypatch, rc, out, after=2)
    real = runner.metrics_csv
    monkeypatch.setattr(runner, "metrics_csv", lambda rows: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):  # --fresh, killed at its round 0
        run_training(rc, out, progress=False, resume=False)
    monkeypatch.setattr(runner, "metrics_csv", real)
    assert not (out / CHECKPOINT).exists()
    (out / ".finished.tmp").mkdir()
    (out / ".finished.tmp" / "run.json").write_text("{}")
    with dir_lock(out, "testing"):
        with pytest.raises(FedForgetError, match=r"another process is training a run in .*run \(it holds .*\.lock\)"):
            run_training(rc, out, progress=False)
    rec = run_training(rc, out, progress=False)
    assert rec["status"] == "completed" and "resumed_after_round" not in rec
    assert not (out / ".finished.tmp").exists()


def test_a_full_disk_while_saving_is_a_clear_error(tmp_path, monkeypatch):
    """torch reports a failed write as a RuntimeError (its cause the OSError): one
    FedForgetError naming the file; the old file is kept."""
    from fedforget.utils import atomic_torch_save

    atomic_torch_save(tmp_path / "model.pt", {"w": torch.ones(2)})

    def full(obj, f):
        try:
            raise OSError(28, "No space left on device")
        except OSError as e:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from e

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(FedForgetError, match=r"cannot write .*model.pt: No space left on device"):
        atomic_torch_save(tmp_path / "model.pt", {"w": torch.zeros(2)})
    monkeypatch.undo()
    assert torch.equal(torch.load(tmp_path / "model.pt")["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_a_resume_on_another_client_engine_is_refused(make_run_config, tmp_path):
    """The engines agree within 1e-5, not byte for byte: a checkpoint names the engine that
    trained it, and a resume asked to train its clients by the other is refused, naming both;
    the checkpoint stays."""
    from fedforget.engine import Simulation

    rc = make_run_config(rounds=3, sample_rate=0.5, client_engine="sequential")
    kept = []
    Simulation(rc).run(progress=False, on_checkpoint=lambda c: kept.append(copy.deepcopy(c)))
    ckpt = kept[0]
    assert ckpt["client_engine"] == "sequential"
    other = replace(rc, train=replace(rc.train, client_engine="vectorized"))
    assert other.hash == rc.hash
    with pytest.raises(FedForgetError, match="trained by client engine 'sequential'; this run would train them by "
                       "'vectorized'.*resume with train.client_engine: sequential"):  # fmt: skip
        Simulation(other).run(progress=False, resume=ckpt)
    Simulation(rc).run(progress=False, resume=copy.deepcopy(ckpt))  # the same engine resumes
    del ckpt["client_engine"]  # written before the record
    Simulation(other).run(progress=False, resume=ckpt)


def test_a_batched_resume_with_other_groups_is_refused(make_run_config):
    """Batched, a group's sums run in an order train.max_parallel_clients sets (outside the
    run's identity): a checkpoint records it, and a resume with another group size is refused,
    naming both; the same size resumes; the sequential engine records none."""
    from fedforget.engine import Simulation

    rc = make_run_config(rounds=3, sample_rate=1.0, client_engine="vectorized", max_parallel_clients=2)
    kept = []
    Simulation(rc).run(progress=False, on_checkpoint=lambda c: kept.append(copy.deepcopy(c)))
    ckpt = kept[0]
    assert ckpt["max_parallel_clients"] == 2
    other = replace(rc, train=replace(rc.train, max_parallel_clients=4))
    assert other.hash == rc.hash
    with pytest.raises(FedForgetError, match=r"groups of at most 2 \(train.max_parallel_clients\); this run would "
                       "group 4.*resume with train.max_parallel_clients: 2"):  # fmt: skip
        Simulation(other).run(progress=False, resume=copy.deepcopy(ckpt))
    Simulation(rc).run(progress=False, resume=copy.deepcopy(ckpt))
    del ckpt["max_parallel_clients"]  # written before the record
    Simulation(other).run(progress=False, resume=ckpt)
    seq = []
    Simulation(replace(rc, train=replace(rc.train, client_engine="sequential"))).run(
        progress=False, on_checkpoint=seq.append)
    assert "max_parallel_clients" not in seq[0]


def test_a_format_2_checkpoint_loads_unless_task_reports_wait_in_it():
    """Format 3 changed only the layout of waiting task reports (FOT's and FedProTIP's
    sketches as Summed shares): a format 2 checkpoint without any loads; with some it is
    refused at the resume, naming the clients, not at the task end rounds later."""
    from fedforget.checkpoint import CHECKPOINT_FORMAT, checkpoint_of, restore
    from fedforget.state import FedState

    fed = FedState(global_params={"w": torch.arange(3.0)}, round=2)
    ckpt = {**checkpoint_of(fed, "h"), "format": 2}
    back = FedState(global_params={"w": torch.zeros(3)})
    restore(back, ckpt, "h")
    assert back.round == 2 and torch.equal(back.global_params["w"], torch.arange(3.0))
    fed.task_reports = {4: {"n": 1}, 1: {"n": 2}}
    waiting = {**checkpoint_of(fed, "h"), "format": 2}
    with pytest.raises(FedForgetError, match=r"format 2 holds the task reports of clients \[1, 4\].*delete"):
        restore(back, waiting, "h")
    restore(back, {**waiting, "format": CHECKPOINT_FORMAT}, "h")
    assert back.task_reports == {4: {"n": 1}, 1: {"n": 2}}
    with pytest.raises(FedForgetError, match=r"checkpoint format 1; this fedforget reads 2 and 3"):
        restore(back, {**ckpt, "format": 1}, "h")
    # a run that format 3's code computes otherwise (found in review: it would have resumed
    # a task-IL run trained masked, unmasked)
    with pytest.raises(FedForgetError, match=r"format 2 was written by a fedforget that computed this run "
                                             r"otherwise \(task-IL trains unmasked, since format 3\).*delete"):
        restore(back, ckpt, "h", ["task-IL trains unmasked"])


def test_the_runs_format_3_computes_otherwise_are_named(make_run_config):
    from fedforget.checkpoint import format2_changes

    assert format2_changes(make_run_config()) == []
    split = {"kind": "split", "tasks": 2, "classes_per_task": 2, "rounds_per_task": 1, "leftover_classes": "drop"}
    assert format2_changes(make_run_config(dataset="digits", scenario=split)) == []
    rc = make_run_config(dataset="digits", scenario={**split, "incremental": "task", "heads": "per_task"}, precision="bf16")
    assert format2_changes(rc) == ["task-IL trains unmasked", "per-task heads: the server's and frozen models' heads",
                                   "bf16: step terms and similarities in fp32"]  # fmt: skip
    windows = {**split, "boundaries": {"samples_per_window": 40, "window_rounds": 1}}
    assert format2_changes(make_run_config(dataset="digits", scenario=windows)) == [
        "asynchronous boundaries: passed-over tasks ended"
    ]


def test_damaged_checkpoint_is_a_clear_error(make_run_config, tmp_path):
    rc = make_run_config(rounds=3)
    (tmp_path / CHECKPOINT).write_bytes(b"\x80\x02 not a checkpoint")
    with pytest.raises(
        FedForgetError, match=rf"checkpoint {tmp_path / CHECKPOINT} cannot be read.*delete it"
    ):
        run_training(rc, tmp_path, progress=False)


@pytest.mark.parametrize("kept", [0.5, 0.0], ids=["first-half", "empty"])
def test_truncated_checkpoint_is_a_clear_error(make_run_config, tmp_path, kept):
    """Issue 34, 10: a real checkpoint cut short (its first half, or no byte) is one error
    naming the file, that it is truncated or empty, and how to start over, as a damaged one
    is; not torch's words for it (an OSError "Invalid argument", EOFError "Ran out of input",
    or its zip reader's paragraph)."""
    from fedforget.engine import Simulation
    from fedforget.utils import atomic_torch_save

    rc = make_run_config(rounds=3)
    path = tmp_path / CHECKPOINT
    Simulation(rc).run(progress=False, on_checkpoint=lambda c: atomic_torch_save(path, c))
    whole = path.read_bytes()
    path.write_bytes(whole[: int(len(whole) * kept)])
    what = r"it is empty \(0 bytes\)" if kept == 0 else rf"it is truncated \({len(whole) // 2} bytes, its end is missing\)"
    with pytest.raises(FedForgetError) as ei:
        run_training(rc, tmp_path, progress=False)
    msg = str(ei.value)
    assert re.fullmatch(rf"checkpoint {re.escape(str(path))} cannot be read: {what}; delete it to start this run over", msg), msg
    assert ei.value.__cause__ is None and ei.value.__suppress_context__  # no torch traceback chained
    assert path.exists()  # the error only names it: deleting is the user's call


def test_bit_flipped_checkpoint_is_a_clear_error(make_run_config, tmp_path):
    """A flipped bit in a tensor's bytes: torch.load reads it without a word (it checks no
    CRC), so the run resumed from weights it never had; the zip archive's CRC-32 finds it."""
    import zipfile

    from fedforget.engine import Simulation
    from fedforget.utils import atomic_torch_save

    rc = make_run_config(rounds=3)
    path = tmp_path / CHECKPOINT
    Simulation(rc).run(progress=False, on_checkpoint=lambda c: atomic_torch_save(path, c))
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size)
    blob = bytearray(path.read_bytes())
    at = info.header_offset
    name_len, extra_len = int.from_bytes(blob[at + 26 : at + 28], "little"), int.from_bytes(blob[at + 28 : at + 30], "little")
    blob[at + 30 + name_len + extra_len] ^= 0x01  # the member's first byte of data
    path.write_bytes(bytes(blob))
    with pytest.raises(
        FedForgetError,
        match=rf"checkpoint {re.escape(str(path))} cannot be read: it is damaged: its part {info.filename} "
        r"is not as written \(Bad CRC-32.*\); delete it to start this run over$",
    ):
        run_training(rc, tmp_path, progress=False)


def test_runtime_settings_do_not_change_the_run_identity(make_run_config):
    rc = make_run_config(rounds=3)
    t = rc.train
    for changed in (
        replace(t, threads=2),
        replace(t, device="auto"),
        replace(t, checkpoint_every=5),
    ):
        assert replace(rc, train=changed).hash == rc.hash
    assert replace(rc, train=replace(t, rounds=4)).hash != rc.hash


def test_a_resume_continues_on_the_checkpoints_thread_count(make_run_config):
    """CPU results depend on the torch thread count (issue 34, 3): a checkpoint records it; a
    run left to the environment's count resumes on the checkpoint's and equals the run
    uninterrupted on that count; a config that asks for another count is refused."""
    from fedforget.engine import Simulation

    rc = make_run_config(dataset="digits", model="cnn2d", rounds=3, batch_size=32, sample_rate=0.5,
                         partition=PartitionSpec("dirichlet", clients=6, alpha=0.5, seed=0))  # fmt: skip
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _, full, _ = Simulation(rc).run(progress=False)
        kept = []  # copies: a checkpoint's tensors and rows are the live run's until written out
        Simulation(rc).run(progress=False, on_checkpoint=lambda c: kept.append(copy.deepcopy(c)))
        ckpt = next(c for c in kept if c["round"] == 1)
        assert ckpt["torch_threads"] == 1
        torch.set_num_threads(2)
        env = replace(rc, train=replace(rc.train, threads=0))  # the count left to the environment
        _, resumed, _ = Simulation(env).run(progress=False, resume=ckpt)
        assert torch.get_num_threads() == 1
        strip = lambda rows: [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]  # noqa: E731
        assert strip(resumed) == strip(full)
        asks = replace(rc, train=replace(rc.train, threads=2))
        with pytest.raises(FedForgetError, match="computed on 1 torch threads and train.threads asks for 2"):
            Simulation(asks).run(progress=False, resume=ckpt)
    finally:
        torch.set_num_threads(before)


def test_run_json_names_the_thread_count_a_resumed_run_ran_on(make_run_config, tmp_path, monkeypatch):
    """run.json's torch_threads / client_threads are those the run ended on: a resume
    continues on its checkpoint's count, whatever the process started with."""
    rc = make_run_config(rounds=3, sample_rate=0.5, threads=0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _interrupted(monkeypatch, rc, tmp_path, after=1)
        torch.set_num_threads(2)
        rec = run_training(rc, tmp_path, progress=False)
        assert rec["resumed_after_round"] == 1
        assert rec["torch_threads"] == rec["client_threads"] == 1
        assert json.loads((tmp_path / "run.json").read_text())["torch_threads"] == 1
    finally:
        torch.set_num_threads(before)


def test_checkpoint_every(make_run_config, tmp_path):
    from fedforget.engine import Simulation

    rc = make_run_config(rounds=7, checkpoint_every=3)
    seen = []
    Simulation(rc).run(progress=False, on_checkpoint=lambda c: seen.append(c["round"]))
    assert seen == [3, 6]  # never after the last round: the run's outputs supersede it


def test_auto_checkpoints_bound_the_time_spent_writing():
    """checkpoint_every auto (the default) [D]: the first round's checkpoint, then one once
    the training since the last write ended lasts 10 times that write; an integer keeps its
    every n-th round; never round 0 nor the last round."""
    from fedforget.checkpoint import CheckpointCadence

    now = [0.0]
    c = CheckpointCadence("auto", rounds=50, clock=lambda: now[0])
    assert not c.due(0) and c.due(1)

    def save(seconds):
        now[0] += seconds

    c.write(lambda: save(2.0))  # a write of 2 s ends at t = 2: the next is due from t = 22
    written = [1]
    for rnd in range(2, 50):
        now[0] += 3.0  # a round of 3 s
        if c.due(rnd):
            c.write(lambda seconds=2.0 if rnd < 20 else 0.1: save(seconds))  # cheaper from round 20 on
            written.append(rnd)
    assert written[:4] == [1, 8, 15, 22]  # 7 rounds (21 s) after each 2 s write
    assert written[4:] == list(range(23, 50))  # after the 0.1 s write of round 22: every round (3 s >= 1 s)
    assert c.written == len(written) and c.write_s == pytest.approx(2.0 * 3 + 0.1 * (len(written) - 3))
    assert not c.due(50)  # the last round: the run's outputs supersede a checkpoint
    every = CheckpointCadence(3, rounds=7)
    assert [r for r in range(8) if every.due(r)] == [3, 6]


def test_auto_checkpoints_in_a_run(make_run_config, tmp_path, monkeypatch):
    """A run with checkpoint_every auto writes after its first round, and then after none of
    the next quick ones when a write takes long; run.json counts the writes; a crash after
    round 1 resumes from that checkpoint and ends byte for byte where an uninterrupted run
    ends."""
    from fedforget.engine import Simulation

    rc = make_run_config(rounds=7, checkpoint_every="auto")
    seen = []
    Simulation(rc).run(progress=False, on_checkpoint=lambda c: (seen.append(c["round"]), time.sleep(0.5)))
    assert seen == [1]  # the next needs 5 s of training: iris's rounds take milliseconds
    full = run_training(rc, tmp_path / "full", progress=False)
    assert full["checkpoints_written"] >= 1 and full["checkpoint_write_s"] > 0
    _interrupted(monkeypatch, rc, tmp_path / "cut", after=1)
    rec = run_training(rc, tmp_path / "cut", progress=False)
    assert rec["resumed_after_round"] == 1
    assert (tmp_path / "cut/metrics.csv").read_bytes() == (tmp_path / "full/metrics.csv").read_bytes()
    assert _weights_equal(tmp_path / "cut/model.pt", tmp_path / "full/model.pt")


def test_failed_job_leaves_other_results_intact(make_run_config, tmp_path):
    good = make_run_config(rounds=2)
    run_training(good, tmp_path / "good", progress=False)
    before = {p.name: p.read_bytes() for p in (tmp_path / "good").iterdir()}
    bad = replace(good, data_dir=str(tmp_path / "no-data"))
    with pytest.raises(FedForgetError, match="no-data"):
        run_training(bad, tmp_path / "bad", progress=False)
    assert json.loads((tmp_path / "bad/run.json").read_text())["status"] == "failed"
    assert {p.name: p.read_bytes() for p in (tmp_path / "good").iterdir()} == before


@pytest.mark.e2e
@pytest.mark.parametrize(
    "method, scenario",
    [
        # one task: make smoke (`long`); make test keeps the task stream below, which also kills
        # a one-model run mid-write, and the SLURM stage's scancel of a one-task FedAvg job
        pytest.param("fedavg", None, marks=pytest.mark.long),
        # a task stream: killed in the middle of task 1, with DER's per-client buffers
        ("der", {"kind": "split", "tasks": 5, "classes_per_task": 2, "rounds_per_task": 3}),
    ],
)
def test_sigkill_mid_run_then_resume_is_byte_identical(make_run_config, tmp_path, method, scenario):
    rc = _digits(make_run_config, rounds=15 if scenario else 14, method=method, scenario=scenario)
    ref = subprocess.run(
        _train_cmd(rc, tmp_path / "ref"), capture_output=True, text=True, timeout=600
    )
    assert ref.returncode == 0, ref.stderr

    out = tmp_path / "killed"
    proc = subprocess.Popen(
        _train_cmd(rc, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    metrics = out / "metrics.csv"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # kill once rounds 0..4 are written
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 6:
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    ckpt = torch.load(out / CHECKPOINT, weights_only=False)
    assert 4 <= ckpt["round"] < rc.train.rounds  # killed in the middle of the run

    done = subprocess.run(_train_cmd(rc, out), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "run.json").read_text())["resumed_after_round"] >= 4
    for f in ("metrics.csv", "tasks.csv", "accuracy_matrix.csv"):
        assert (out / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f
    assert _weights_equal(out / "model.pt", tmp_path / "ref/model.pt")
    assert not list(out.glob(".*.tmp"))  # a temp file the kill left behind is cleaned up


def test_atomic_write_failure_keeps_the_old_file(tmp_path):
    from fedforget.utils import atomic_write, atomic_write_text

    target = tmp_path / "metrics.csv"
    atomic_write_text(target, "old\n")

    def half_then_fail(tmp):
        Path(tmp).write_text("new but incomp")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, half_then_fail)
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv"]  # no temp file left


def test_every_job_of_every_shipped_config_has_its_own_directory(repo_root):
    """No job can overwrite another's outputs: run directories are distinct across all
    shipped configs' jobs (experiment / dataset / partition / method label / seed)."""
    from fedforget.parse import load_config

    dirs = []
    for f in [
        repo_root / "config/config.yaml",
        *sorted((repo_root / "config/experiments").glob("*.yaml")),
    ]:
        wf = load_config(f)
        dirs += [(f.name, str(rc.run_dir)) for rc in wf.runs()]
    by_dir = {}
    for name, d in dirs:
        by_dir.setdefault(d, set()).add(name)
    clashes = {d: n for d, n in by_dir.items() if len(n) > 1}
    # two configs may share an experiment name only if they are the same experiment
    assert not clashes, clashes
    assert len(by_dir) == len(dirs)
